"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, TinyLlama), built from libai_lite's parallel-aware layers.

Read top to bottom: token embedding -> pre-RMSNorm layers (rotary positions, grouped-query attention,
SwiGLU MLP, no biases) -> final RMSNorm -> LM head (untied unless ``tie_word_embeddings``), then
the pretraining wrapper that adds the loss. Every piece is a direct attribute so a pipeline splitter
can delete what a stage does not own; the rotary angles are computed by the first attention that
needs them in a step and shared by the others (no weights).
"""
from dataclasses import replace
from typing import Any, Mapping, Optional

import torch
from torch import nn

from libai_lite.layers import (
    Linear1D,
    MoEConfig,
    ParallelCrossEntropyLoss,
    RMSLayerNorm,
    TransformerLayer,
    VocabEmbedding,
    fusable_head_weight,
    init_method_normal,
    linear_cross_entropy,
    scaled_init_method_normal,
)
from libai_lite.layers.attention import KVCache
from libai_lite.layers.moe import MOE_METRICS, collect_moe_outputs, inactive_expert_parameters, moe_layers
from libai_lite.model import LOSS


class LlamaModel(nn.Module):
    """The decoder: ``forward(input_ids)`` returns logits ``[batch, seq, vocab]``.

    ``num_key_value_heads`` (default ``num_attention_heads``) < heads is grouped-query attention;
    ``head_size`` defaults to ``hidden_size // num_attention_heads``; ``rope_theta`` and
    ``rope_scaling`` (Llama 3's ``{"rope_type": "llama3", ...}``) set the rotary frequencies;
    no projection has a bias but, with ``qkv_bias``, q/k/v (Qwen2). On a pipeline stage that lacks
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
                sliding_window=sliding_window,
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
        self.matmul_parameters = self.num_parameters(non_embedding=True) - inactive_expert_parameters(self)

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

        As ``GPTModel.forward``: ``attention_mask`` ``[batch, keys]`` (0 = left padding),
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
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        if self.lm_head is None:
            return hidden_states
        if lm_labels is not None and self.fuses_cross_entropy():
            return linear_cross_entropy(hidden_states, self.lm_head.weight, lm_labels)
        return self.lm_head(hidden_states)

    def fuses_cross_entropy(self) -> bool:
        """Whether the training loss may skip the logits (see ``GPTModel.fuses_cross_entropy``)."""
        return self.fused_cross_entropy and self.lm_head is not None and fusable_head_weight(self.lm_head.weight)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameters present on this module (a tied head once); ``non_embedding`` drops an untied token
        embedding, a lookup that costs no matmul (a tied one stays: it is also the head's weight)."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.tie_word_embeddings and self.embeddings is not None:
            total -= self.embeddings.weight.numel()
        return total

    def flops_per_token(self, seq_length: int) -> int:
        """Training FLOPs per token, ``6 N + 12 L (heads x head_size) T`` (PaLM appendix B), ``N`` the
        matmul parameters counted at construction."""
        attn_width = self.num_attention_heads * self.head_size
        return 6 * self.matmul_parameters + 12 * self.hidden_layers * attn_width * seq_length

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                 max_new_tokens: int = 20, use_cache: bool = True, vocab_size: Optional[int] = None, **options):
        """Continue the prompts ``input_ids`` ``[batch, len]``; returns ``[batch, len + new]`` ids.

        Left-padded prompts carry ``attention_mask`` 0 on the padding, and positions count from each
        row's first real token, as Hugging Face does. ``use_cache`` keeps each layer's keys and values
        (only the key/value heads); ``vocab_size`` is the tokenizer's real size. ``options`` are
        ``libai_lite.inference.decode``'s (``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``repetition_penalty``, ``eos_token_id``, ``pad_token_id``, ``generator``, ``return_logits``).
        """
        from libai_lite.inference import decode, eval_mode, gather_logits, tensor_parallel_group
        from libai_lite.utils.errors import UsageError

        if self.embeddings is None or self.lm_head is None:
            raise UsageError("generate needs the whole Llama model (embeddings to LM head); build it without "
                             "pipeline parallelism")
        prompt_len = input_ids.shape[1]
        total = prompt_len + int(max_new_tokens)
        if total > self.max_seq_length:
            raise UsageError(f"a prompt of {prompt_len} tokens plus max_new_tokens={max_new_tokens} exceeds the "
                             f"model's max_seq_length={self.max_seq_length}; shorten the prompt or generate fewer")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = attention_mask.to(device=input_ids.device, dtype=torch.long)
        padded = not bool(mask.all())
        caches = {name: KVCache(capacity=total) for name in self.layers} if use_cache else None
        seen = {"ids": input_ids[:, :0], "mask": mask[:, :0]}

        def step(tokens: torch.Tensor) -> torch.Tensor:
            new_mask = mask if seen["ids"].shape[1] == 0 else torch.ones_like(tokens)
            seen["ids"] = torch.cat([seen["ids"], tokens], dim=1)
            seen["mask"] = torch.cat([seen["mask"], new_mask], dim=1)
            ids = tokens if use_cache else seen["ids"]
            # Left padding shifts each row: its first real token is position 0.
            positions = (seen["mask"].cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
            logits = self(ids, seen["mask"] if padded else None, positions, caches, logits_to_keep=1)
            return gather_logits(logits)[:, -1]

        with eval_mode(self):
            return decode(step, input_ids, max_new_tokens=int(max_new_tokens), vocab_size=vocab_size or self.vocab_size,
                          ignore_mask=mask == 0, sync_group=tensor_parallel_group(self), **options)


class LlamaLoss(nn.Module):
    """Token-averaged LM loss plus ``num_tokens`` and ``nll_sum`` for token-weighted perplexity (as GPT's)."""

    def __init__(self, ignore_index: int = -100):
        super().__init__()
        self.ignore_index = ignore_index
        self.cross_entropy = ParallelCrossEntropyLoss()

    def forward(self, logits: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor] = None) -> dict:
        """The loss dict from logits ``[batch, seq, vocab]`` (a DTensor under tensor parallelism)."""
        return self.reduce(self.cross_entropy(logits, labels, ignore_index=self.ignore_index), labels, loss_mask)

    def reduce(self, per_token: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor] = None) -> dict:
        """Token-weighted mean of a per-token loss and the sums for perplexity."""
        weights = (labels != self.ignore_index).to(per_token.dtype)
        if loss_mask is not None:
            weights = weights * loss_mask.to(per_token.dtype)
        nll_sum = (per_token * weights).sum()
        lm_loss = nll_sum / weights.sum().clamp(min=torch.finfo(weights.dtype).tiny)
        return {"lm_loss": lm_loss, "num_tokens": (weights != 0).sum(), "nll_sum": nll_sum.detach()}


class LlamaForPreTraining(nn.Module):
    """Llama with its pretraining loss; configs build it as ``LazyCall(LlamaForPreTraining)(cfg=cfg)``.

    ``forward(input_ids, labels=None, loss_mask=None, position_ids=None, document_ids=None)``: with labels
    (already shifted, as the GPT dataset gives them) returns ``{"lm_loss", "num_tokens", "nll_sum"}`` (plus
    ``moe_aux_loss``, ``moe_dropped_frac`` and ``moe_load_max`` with MoE layers); without, ``{"logits"}``.
    ``position_ids`` and ``document_ids`` come with packed documents (``libai_lite.data.packing``).
    """

    def __init__(self, cfg: Mapping[str, Any]):
        super().__init__()
        self.llama = LlamaModel(**dict(cfg))
        self.loss_func = LlamaLoss()

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None) -> dict:
        model = self.llama
        packed = dict(position_ids=position_ids, document_ids=document_ids)
        if labels is not None and model.fuses_cross_entropy():
            outputs = self.loss_func.reduce(model(input_ids, lm_labels=labels, **packed), labels, loss_mask)
        else:
            logits = model(input_ids, **packed)
            if labels is None:
                return {"logits": logits}
            outputs = self.loss_func(logits, labels, loss_mask)
        outputs.update(collect_moe_outputs(model))
        return outputs

    # ------------------------------------------------------------------ the model protocol (libai_lite.model)
    def output_metrics(self) -> dict:
        """``lm_loss`` is back-propagated; MoE layers add their auxiliary loss and statistics."""
        # `tokens`: under context parallelism the loss is re-weighted to the whole sequence's token mean.
        lm_loss = replace(LOSS, tokens="num_tokens")
        return {"lm_loss": lm_loss, **(MOE_METRICS if moe_layers(self.llama) else {})}

    @staticmethod
    def tokens_per_sample(sample: Mapping) -> int:
        """Tokens one training sample feeds the model: its sequence."""
        return len(sample["input_ids"])

    def flops_per_sample(self, sample: Mapping) -> float:
        """Training FLOPs of one sample (see ``LlamaModel.flops_per_token``)."""
        seq = self.tokens_per_sample(sample)
        return float(self.llama.flops_per_token(seq)) * seq

    @property
    def max_seq_length(self) -> int:
        """The longest sequence generation and evaluation feed the model."""
        return self.llama.max_seq_length

    @property
    def pipeline_num_layers(self) -> int:
        """Layers the pipeline places: the decoder layers (embedding with 0, norm and head with the last)."""
        return self.llama.hidden_layers

    def pipeline_module(self) -> nn.Module:
        """The module ``libai_lite.parallel.pipeline_split`` cuts into stages by its pieces' ``layer_idx``."""
        return self.llama

    def pipeline_batch(self, batch: dict) -> tuple[tuple, dict, torch.Tensor]:
        """``(first-stage inputs, every-stage kwargs, labels)``; labels reach the last stage as ``lm_labels``,
        packed documents' ``position_ids`` (rotary, in every layer) and ``document_ids`` every stage."""
        kwargs = {"lm_labels": batch["labels"]} if self.llama.fused_cross_entropy else {}
        kwargs.update({k: batch[k] for k in ("position_ids", "document_ids") if batch.get(k) is not None})
        return (batch["input_ids"],), kwargs, batch["labels"]

    def pipeline_loss_fn(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token loss of the last stage's output: per-token losses when it fuses its head, else logits."""
        if self.llama.fuses_cross_entropy():
            return self.loss_func.reduce(output, labels)["lm_loss"]
        return self.loss_func(output, labels)["lm_loss"]

    def num_parameters(self, non_embedding: bool = False) -> int:
        """See ``LlamaModel.num_parameters``."""
        return self.llama.num_parameters(non_embedding)

    def flops_per_token(self, seq_length: int) -> int:
        """See ``LlamaModel.flops_per_token``."""
        return self.llama.flops_per_token(seq_length)

    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, **options):
        """Continue prompts; ``LlamaModel.generate`` lists the options."""
        return self.llama.generate(input_ids, attention_mask, **options)
