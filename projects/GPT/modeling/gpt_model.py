"""GPT-2 style decoder-only language model, built from libai_lite's parallel-aware layers.

Read top to bottom: embeddings -> transformer layers -> final layer norm -> tied LM head,
then the pretraining wrapper that adds the loss. Every piece is a direct attribute so a
pipeline splitter can delete what a stage does not own (torchtitan style) and the
forward still runs on what is left.
"""
from typing import Any, Mapping, Optional

import torch
from torch import nn

from libai_lite.config.validate import COUNT_OR_NULL, SWITCH
from libai_lite.lm.decoder import DecoderLM, DecoderLMForPreTraining
from libai_lite.layers import (
    Embedding,
    LayerNorm,
    Linear1D,
    MoEConfig,
    TransformerLayer,
    VocabEmbedding,
    init_method_normal,
    scaled_init_method_normal,
)
from libai_lite.layers.attention import KVCache
from libai_lite.layers.moe import inactive_expert_parameters

# LiBai GPT config keys that name kernel fusions or fp16 tricks with no numerical effect
# here; accepted so LiBai configs load unchanged.
_IGNORED_CFG_KEYS = frozenset(
    {
        "bias_gelu_fusion",
        "bias_dropout_fusion",
        "scale_mask_softmax_fusion",
        "apply_query_key_layer_scaling",
        "amp_enabled",
    }
)


class GPTEmbedding(nn.Module):
    """Token embedding (vocab-parallel) + learned position embedding (replicated) + dropout."""

    def __init__(self, vocab_size, hidden_size, max_seq_length, embedding_dropout_prob, init_method, pad_token_id=None):
        super().__init__()
        self.token_embeddings = VocabEmbedding(vocab_size, hidden_size, padding_idx=pad_token_id, init_method=init_method)
        self.position_embeddings = Embedding(max_seq_length, hidden_size, init_method=init_method)
        self.dropout = nn.Dropout(embedding_dropout_prob)
        self.layer_idx = 0

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``position_ids`` ``[batch, seq]`` default to ``0..seq-1``; generation passes its own (left padding, cache)."""
        if position_ids is None:
            seq_length = input_ids.shape[1]
            if seq_length > self.position_embeddings.num_embeddings:
                raise ValueError(
                    f"sequence length {seq_length} exceeds max_seq_length {self.position_embeddings.num_embeddings}"
                )
            position_ids = torch.arange(seq_length, device=input_ids.device)
        return self.dropout(self.token_embeddings(input_ids) + self.position_embeddings(position_ids))


class GPTModel(DecoderLM):
    """GPT-2: pre-LN causal transformer whose LM head shares the token-embedding weight.

    ``forward(input_ids)`` returns logits ``[batch, seq, vocab]``. On a pipeline stage
    that lacks pieces: with ``embeddings`` set to None the input is taken to be hidden
    states; with ``final_layernorm`` and/or ``lm_head`` None the corresponding step is
    skipped and hidden states come out.

    ``bias_gelu_fusion`` and the other LiBai fusion flags are accepted and ignored.
    ``activation`` is ``"gelu_tanh"`` for GPT-2 (``gelu_new``) or ``"gelu"``/``"relu"``.
    ``moe`` (``model.cfg.moe``, see ``libai_lite.layers.MoEConfig``) makes every
    ``every_n_layers``-th feed-forward a mixture of experts when ``enabled``.
    ``fused_cross_entropy`` lets the pretraining loss compute the LM head and the cross entropy in
    one step (``libai_lite.layers.linear_cross_entropy``), without the logits.
    """

    def __init__(
        self,
        hidden_layers: int,
        vocab_size: int,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        max_seq_length: int = 1024,
        embedding_dropout_prob: float = 0.1,
        attention_dropout_prob: float = 0.1,
        output_dropout_prob: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_scaled_init_for_output_weights: bool = True,
        apply_residual_post_layernorm: bool = False,
        activation: str = "gelu_tanh",
        pad_token_id: Optional[int] = None,
        moe: Optional[Mapping[str, Any]] = None,
        fused_cross_entropy: bool = True,
        **ignored_fusion_flags,
    ):
        super().__init__()
        unknown = set(ignored_fusion_flags) - _IGNORED_CFG_KEYS
        if unknown:
            raise TypeError(f"GPTModel got unknown arguments {sorted(unknown)}")
        self.hidden_layers = hidden_layers
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.max_seq_length = max_seq_length
        self.fused_cross_entropy = fused_cross_entropy

        moe_cfg = MoEConfig.from_mapping(moe)
        init_method = init_method_normal(initializer_range)
        output_layer_init_method = (
            scaled_init_method_normal(initializer_range, hidden_layers)
            if use_scaled_init_for_output_weights
            else init_method
        )

        self.embeddings = GPTEmbedding(
            vocab_size, hidden_size, max_seq_length, embedding_dropout_prob, init_method, pad_token_id
        )
        # A dict keyed by the global index keeps layer names stable when a pipeline
        # stage drops the layers it does not own, so checkpoints line up across layouts.
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerLayer(
                    hidden_size,
                    ffn_hidden_size,
                    num_attention_heads,
                    attention_dropout_prob=attention_dropout_prob,
                    output_dropout_prob=output_dropout_prob,
                    layernorm_epsilon=layernorm_epsilon,
                    init_method=init_method,
                    output_layer_init_method=output_layer_init_method,
                    activation=activation,
                    attn_mask_type="causal",
                    apply_residual_post_layernorm=apply_residual_post_layernorm,
                    layer_idx=i,
                    moe=moe_cfg if moe_cfg.is_moe_layer(i) else None,
                )
                for i in range(hidden_layers)
            }
        )
        self.final_layernorm = LayerNorm(hidden_size, eps=layernorm_epsilon, layer_idx=hidden_layers - 1)
        # logits = h @ wte.T: a vocab-parallel (column-split) Linear1D sharing the very
        # Parameter of the vocab-parallel token embedding. Both are split(0), so one
        # placement serves both, and the head keeps the weight when a pipeline stage
        # drops the embeddings. Its own weight is built on meta (it is replaced at
        # once), and it gets the embedding's init so reset_parameters() in any module
        # order draws the shared weight from the same distribution.
        self.lm_head = Linear1D(
            hidden_size,
            vocab_size,
            bias=False,
            parallel="vocab",
            init_method=init_method,
            layer_idx=hidden_layers - 1,
            device="meta",
        )
        self.tie_weights()
        # Counted whole, now: a pipeline stage later holds only some of the layers.
        self.active_parameters = self.num_parameters(non_embedding=True) - inactive_expert_parameters(self)

    # For the pipeline splitter: the token embedding and the LM head are one weight, held by the
    # first and the last stage.
    pipeline_tied = ("embeddings.token_embeddings.weight", "lm_head.weight")

    def tie_weights(self) -> None:
        """Point the LM head at the token-embedding Parameter.

        Anything that swaps parameters module by module unties them: ``to_empty()``
        after a meta-device build, ``parallelize_module`` (it distributes each use
        separately). Call this afterwards; it is a no-op on a pipeline stage that lacks
        either piece, and a tensor-parallel model stays correct because both are split(0).
        """
        if self.embeddings is not None and self.lm_head is not None:
            self.lm_head.weight = self.embeddings.token_embeddings.weight

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "GPTModel":
        """Build from a LiBai-style model cfg (dict or OmegaConf DictConfig of constructor arguments)."""
        return cls(**dict(cfg))

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

        The optional arguments serve incremental decoding (``generate``): ``attention_mask``
        ``[batch, keys]`` (1 = real token, 0 = left padding; covering cached keys too),
        ``position_ids`` ``[batch, seq]``, ``kv_caches`` (a ``KVCache`` per key of ``layers``;
        ``input_ids`` are then only the positions after the cached ones) and
        ``logits_to_keep`` (> 0: logits of the last that many positions only).
        With ``lm_labels`` (next-token ids, -100 ignored) and a head that can fuse
        (``fuses_cross_entropy``), the per-token loss ``[batch, seq]`` (fp32) comes out instead of
        logits: the pretraining loss and a pipeline's last stage never hold the logits.
        Packed documents (``libai_lite.data.packing``): ``position_ids`` restarting per document and
        ``document_ids`` ``[batch, seq]``, which keep each token's attention inside its document.
        """
        if self.embeddings is not None:
            hidden_states = self.embeddings(input_ids, position_ids)
        else:
            hidden_states = input_ids
        extra = {} if document_ids is None else {"document_ids": document_ids}
        for name, layer in self.layers.items():
            cache = kv_caches[name] if kv_caches is not None else None
            hidden_states = layer(hidden_states, attention_mask, kv_cache=cache, **extra)
        return self.norm_and_head(hidden_states, logits_to_keep, lm_labels)

    def word_embedding(self):
        """The token embedding (None on a pipeline stage without it): ``embedding_parameters`` reads it."""
        return None if self.embeddings is None else self.embeddings.token_embeddings

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Count parameters present on this module (the tied embedding/head once).

        ``non_embedding=True`` drops the position embeddings only, as nanoGPT does: the
        token embedding stays counted because it is also the LM head's weight, whose
        matmul costs compute on every token. Call it on the whole model, before any
        pipeline split; on a DTensor-sharded model it still counts global sizes.
        """
        total = sum(p.numel() for p in self.parameters())
        if non_embedding and self.embeddings is not None:
            total -= self.embeddings.position_embeddings.weight.numel()
        return total

    def flops_per_token(self, seq_length: int) -> int:
        """Training FLOPs per token, forward plus backward: ``6 N + 12 L H T``.

        ``N`` is ``num_parameters(non_embedding=True)`` (every weight matmul costs 2
        FLOPs per parameter forward and 4 backward); ``12 L H T`` adds attention's
        score and context matmuls (PaLM appendix B, as in nanoGPT's MFU estimate).
        With MoE layers ``N`` counts the active parameters: a token runs ``top_k`` experts. Counted
        at construction, so a pipeline stage still reports the whole model's FLOPs.
        """
        return 6 * self.active_parameters + 12 * self.hidden_layers * self.hidden_size * seq_length


class GPTForPreTraining(DecoderLMForPreTraining):
    """GPT language model with its pretraining loss; LiBai configs build it as ``LazyCall(GPTForPreTraining)(cfg=cfg)``.

    ``forward``, the loss and the model protocol are ``libai_lite.lm.decoder.DecoderLMForPreTraining``'s.
    """

    # LiBai's bias_dropout_fusion is a switch, though its name matches the dropout probabilities' pattern.
    config_ranges = {**DecoderLMForPreTraining.config_ranges, "ffn_hidden_size": COUNT_OR_NULL,
                     "bias_dropout_fusion": SWITCH}

    def __init__(self, cfg: Mapping[str, Any]):
        # "GPT_model" is the prefix of every checkpoint key (and the Hugging Face mapping's ``inner``).
        super().__init__(GPTModel.from_config(cfg), decoder_name="GPT_model")
