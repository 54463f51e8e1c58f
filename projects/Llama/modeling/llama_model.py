"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, TinyLlama), built from libai_lite's parallel-aware layers.

Read top to bottom: token embedding -> pre-RMSNorm layers (rotary positions, grouped-query attention,
SwiGLU MLP, no biases) -> final RMSNorm -> LM head (untied unless ``tie_word_embeddings``), then
the pretraining wrapper that adds the loss. Every piece is a direct attribute so a pipeline splitter
can delete what a stage does not own; the rotary angles are computed by the first attention that
needs them in a step and shared by the others (no weights).
"""
from typing import Any, Mapping, Optional

import torch
from torch import nn

from libai_lite.config.validate import COUNT_OR_NULL
from libai_lite.lm.decoder import DecoderLM, DecoderLMForPreTraining
from libai_lite.layers import (
    Linear1D,
    MoEConfig,
    RMSLayerNorm,
    TransformerLayer,
    VocabEmbedding,
    init_method_normal,
    scaled_init_method_normal,
)
from libai_lite.layers.attention import KVCache
from libai_lite.layers.moe import inactive_expert_parameters


class LlamaModel(DecoderLM):
    """The decoder: ``forward(input_ids)`` returns logits ``[batch, seq, vocab]``.

    ``num_key_value_heads`` (default ``num_attention_heads``) < heads is grouped-query attention;
    ``head_size`` defaults to ``hidden_size // num_attention_heads``; ``rope_theta`` and
    ``rope_scaling`` (Llama 3's ``{"rope_type": "llama3", ...}``) set the rotary frequencies;
    no projection has a bias but, with ``qkv_bias``, q/k/v (Qwen2); ``qk_norm`` RMS-normalises each query
    and key head before RoPE (Qwen3, whose ``head_size`` need not be hidden / heads). On a pipeline stage that lacks
    pieces: with ``embeddings`` None the input is hidden states; with ``final_layernorm`` and/or
    ``lm_head`` None hidden states come out.
    ``max_seq_length`` bounds generation and sets the demo's sequence length (RoPE has no table).
    ``moe`` (``model.cfg.moe``, a ``MoEConfig``) makes feed-forward layers mixtures of SwiGLU experts;
    Mixtral is ``every_n_layers=1``, ``top_k=2`` of 8, ``capacity_factor=None`` (no token dropped).
    ``sliding_window`` (Mistral 7B v0.1: 4096) lets each position attend to itself and the
    ``sliding_window - 1`` before it only; None attends to the whole prefix.
    """

    def __init__(
        self,
        hidden_layers: int,
        vocab_size: int,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_key_value_heads: Optional[int] = None,
        head_size: Optional[int] = None,
        max_seq_length: int = 2048,
        rope_theta: float = 10000.0,
        rope_scaling: Optional[Mapping[str, Any]] = None,
        attention_dropout_prob: float = 0.0,
        output_dropout_prob: float = 0.0,
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_scaled_init_for_output_weights: bool = True,
        tie_word_embeddings: bool = False,
        qkv_bias: bool = False,
        pad_token_id: Optional[int] = None,
        fused_cross_entropy: bool = True,
        moe: Optional[Mapping[str, Any]] = None,
        sliding_window: Optional[int] = None,
        qk_norm: bool = False,
    ):
        super().__init__()
        self.hidden_layers = hidden_layers
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.head_size = head_size or hidden_size // num_attention_heads
        self.max_seq_length = max_seq_length
        self.tie_word_embeddings = bool(tie_word_embeddings)
        self.fused_cross_entropy = fused_cross_entropy

        init_method = init_method_normal(initializer_range)
        output_init = (scaled_init_method_normal(initializer_range, hidden_layers)
                       if use_scaled_init_for_output_weights else init_method)
        last = hidden_layers - 1
        moe_cfg = MoEConfig.from_mapping(moe)
        self.embeddings = VocabEmbedding(vocab_size, hidden_size, padding_idx=pad_token_id, init_method=init_method)
        # Keyed by the global index, so layer names stay when a pipeline stage drops the others.
        self.layers = nn.ModuleDict({
            str(i): TransformerLayer(
                hidden_size, ffn_hidden_size, num_attention_heads,
                attention_dropout_prob=attention_dropout_prob, output_dropout_prob=output_dropout_prob,
                layernorm_epsilon=layernorm_epsilon, init_method=init_method, output_layer_init_method=output_init,
                bias=False, activation="silu", attn_mask_type="causal", layer_idx=i, norm="rmsnorm",
                gated=True, num_key_value_heads=num_key_value_heads, qkv_bias=qkv_bias,
                moe=moe_cfg if moe_cfg.is_moe_layer(i) else None, rope_theta=rope_theta, rope_scaling=rope_scaling,
                sliding_window=sliding_window, qk_norm=qk_norm, head_size=head_size,
            )
            for i in range(hidden_layers)
        })
        self.final_layernorm = RMSLayerNorm(hidden_size, eps=layernorm_epsilon, layer_idx=last)
        # A vocab-parallel head; tied, it shares the embedding's Parameter (both split(0)), as GPT's.
        self.lm_head = Linear1D(hidden_size, vocab_size, bias=False, parallel="vocab", init_method=init_method,
                                layer_idx=last, device="meta" if self.tie_word_embeddings else None)
        self.tie_weights()
        # Counted whole, now: a pipeline stage later holds only some of the layers. A token runs only
        # top_k experts, so the others' weights cost it no FLOPs.
        self.active_parameters = self.num_parameters(non_embedding=True) - inactive_expert_parameters(self)

    @property
    def pipeline_tied(self):
        """``(source, copy)`` of the weight the first and last pipeline stage share, or None (untied head)."""
        return ("embeddings.weight", "lm_head.weight") if self.tie_word_embeddings else None

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings``, point the LM head at the token-embedding Parameter (again after
        ``to_empty`` or tensor parallelism, which untie it); a no-op otherwise or on a stage lacking either."""
        if self.tie_word_embeddings and self.embeddings is not None and self.lm_head is not None:
            self.lm_head.weight = self.embeddings.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        kv_caches: Optional[Mapping[str, KVCache]] = None,
        logits_to_keep: int = 0,
        lm_labels: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``input_ids`` ``[batch, seq]`` (or hidden states on a stage without embeddings) -> logits or hidden states.

        As ``libai_lite.lm.decoder`` asks of a decoder: ``attention_mask`` ``[batch, keys]`` (0 = left padding),
        ``position_ids`` ``[batch, seq]`` (default ``0..seq-1``), ``kv_caches`` per layer key,
        ``logits_to_keep`` and ``lm_labels`` (per-token loss from the fused head instead of logits).
        Packed documents: ``position_ids`` restarting per document and ``document_ids`` ``[batch, seq]``.
        """
        hidden_states = self.embeddings(input_ids) if self.embeddings is not None else input_ids
        if position_ids is None and kv_caches is None and self.embeddings is not None:
            # One positions tensor for every layer, so the layers share one rotary computation
            # (libai_lite.layers.rotary); the token ids are whole even under sequence parallelism.
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        extra = {} if document_ids is None else {"document_ids": document_ids}
        for name, layer in self.layers.items():
            cache = kv_caches[name] if kv_caches is not None else None
            # The attention computes its rotary angles itself (once for all layers given one
            # positions tensor): under sequence parallelism only it sees the whole sequence.
            hidden_states = layer(hidden_states, attention_mask, kv_cache=cache, position_ids=position_ids, **extra)
        return self.norm_and_head(hidden_states, logits_to_keep, lm_labels)

    def word_embedding(self):
        """The token embedding (None on a pipeline stage without it): ``embedding_parameters`` reads it."""
        return self.embeddings

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameters present on this module (a tied head once); ``non_embedding`` drops an untied token
        embedding, a lookup that costs no matmul (a tied one stays: it is also the head's weight)."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.tie_word_embeddings and self.embeddings is not None:
            total -= self.embeddings.weight.numel()
        return total

    def flops_per_token(self, seq_length: int) -> int:
        """Training FLOPs per token, ``6 N + 12 L (heads x head_size) T`` (PaLM appendix B), ``N`` the
        active parameters (non-embedding, a token's ``top_k`` experts only) counted at construction."""
        attn_width = self.num_attention_heads * self.head_size
        return 6 * self.active_parameters + 12 * self.hidden_layers * attn_width * seq_length


class LlamaForPreTraining(DecoderLMForPreTraining):
    """Llama with its pretraining loss; configs build it as ``LazyCall(LlamaForPreTraining)(cfg=cfg)``.

    ``forward``, the loss and the model protocol are ``libai_lite.lm.decoder.DecoderLMForPreTraining``'s.
    """

    config_ranges = {**DecoderLMForPreTraining.config_ranges, "ffn_hidden_size": COUNT_OR_NULL,
                     "num_key_value_heads": COUNT_OR_NULL}

    def __init__(self, cfg: Mapping[str, Any]):
        # "llama" is the prefix of every checkpoint key (and the Hugging Face mapping's ``inner``).
        super().__init__(LlamaModel(**dict(cfg)), decoder_name="llama")
