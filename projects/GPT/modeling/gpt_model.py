"""GPT-2 style decoder-only language model, built from libai_lite's parallel-aware layers.

Read top to bottom: embeddings -> transformer layers -> final layer norm -> tied LM head,
then the pretraining wrapper that adds the loss. Every piece is a direct attribute so a
pipeline splitter can delete what a stage does not own (torchtitan style) and the
forward still runs on what is left.
"""
from dataclasses import replace
from typing import Any, Mapping, Optional

import torch
from torch import nn

from libai_lite.layers import (
    Embedding,
    LayerNorm,
    Linear1D,
    MoEConfig,
    ParallelCrossEntropyLoss,
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


class GPTModel(nn.Module):
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
        """Whether the training loss may skip the logits (``linear_cross_entropy``): configured so, on a
        stage with the head, and the head plain or split on the vocabulary over the tensor-parallel ranks."""
        return self.fused_cross_entropy and self.lm_head is not None and fusable_head_weight(self.lm_head.weight)

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

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        max_new_tokens: int = 20,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        eos_token_id=None,
        pad_token_id: Optional[int] = None,
        use_cache: bool = True,
        generator: Optional[torch.Generator] = None,
        vocab_size: Optional[int] = None,
        return_logits: bool = False,
    ):
        """Continue the prompts ``input_ids`` ``[batch, len]``; returns ``[batch, len + new]`` ids.

        Prompts of different lengths are left-padded, with ``attention_mask`` 0 on the padding
        (``libai_lite.inference.pad_prompts``); positions count from each row's first real token,
        as Hugging Face does. ``use_cache`` keeps every layer's keys and values so each step
        feeds one token; without it each step re-reads the whole sequence (same tokens, slower).
        ``vocab_size`` is the tokenizer's real size: ids from it up to the padded embedding
        size are never produced (default: the model's whole, padded vocabulary). The other
        options are those of ``libai_lite.inference.decode``. Runs in eval mode, also on a
        tensor-parallel model (every rank must call it with the same arguments).
        """
        from libai_lite.inference import decode, eval_mode, gather_logits, tensor_parallel_group
        from libai_lite.utils.errors import UsageError

        if self.embeddings is None or self.lm_head is None:
            raise UsageError(
                "generate needs the whole GPT model (embeddings to LM head); build it without pipeline parallelism"
            )
        prompt_len = input_ids.shape[1]
        total = prompt_len + int(max_new_tokens)
        if total > self.max_seq_length:
            raise UsageError(
                f"a prompt of {prompt_len} tokens plus max_new_tokens={max_new_tokens} exceeds the model's "
                f"max_seq_length={self.max_seq_length}; shorten the prompt or generate fewer tokens"
            )
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
            # Without padding SDPA's causal kernel needs no mask at all.
            logits = self(ids, seen["mask"] if padded else None, positions, caches, logits_to_keep=1)
            return gather_logits(logits)[:, -1]

        with eval_mode(self):
            return decode(
                step, input_ids, max_new_tokens=int(max_new_tokens), vocab_size=vocab_size or self.vocab_size,
                do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                repetition_penalty=repetition_penalty, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                generator=generator, ignore_mask=mask == 0, sync_group=tensor_parallel_group(self),
                return_logits=return_logits,
            )


class GPTLoss(nn.Module):
    """Token-averaged LM loss plus the sums needed for token-weighted perplexity across ranks.

    Labels equal to ``ignore_index`` (-100) do not count; ``loss_mask`` (1 keep / 0 drop,
    or fractional weights) multiplies each token's loss. Returns ``lm_loss`` (to
    back-propagate), ``num_tokens`` (LongTensor count of tokens with non-zero weight)
    and ``nll_sum`` (detached weighted sum of token NLLs): perplexity over many batches
    or ranks is ``exp(sum(nll_sum) / sum(num_tokens))`` for 0/1 masks.
    """

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
        # A batch with nothing to predict yields 0, not NaN (0 / tiny == 0).
        lm_loss = nll_sum / weights.sum().clamp(min=torch.finfo(weights.dtype).tiny)
        return {"lm_loss": lm_loss, "num_tokens": (weights != 0).sum(), "nll_sum": nll_sum.detach()}


class GPTForPreTraining(nn.Module):
    """GPT language model with its pretraining loss; LiBai configs build it as ``LazyCall(GPTForPreTraining)(cfg=cfg)``.

    ``forward(input_ids, labels=None, loss_mask=None, position_ids=None, document_ids=None)``: with labels returns
    ``{"lm_loss", "num_tokens", "nll_sum"}`` (see ``GPTLoss``), plus ``moe_aux_loss``,
    ``moe_dropped_frac`` and ``moe_load_max`` with MoE layers (``collect_moe_outputs``);
    without, ``{"logits"}``. Labels are already shifted (``labels[:, t]`` is the token after ``input_ids[:, t]``),
    as the GPT dataset produces them. ``position_ids`` and ``document_ids`` ``[batch, seq]`` come with packed
    documents (the loader's ``reset_position_ids`` / ``reset_attention_mask``, see ``libai_lite.data.packing``).
    """

    def __init__(self, cfg: Mapping[str, Any]):
        super().__init__()
        self.GPT_model = GPTModel.from_config(cfg)
        self.loss_func = GPTLoss()

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
    ) -> dict:
        model = self.GPT_model
        packed = dict(position_ids=position_ids, document_ids=document_ids)
        if labels is not None and model.fuses_cross_entropy():
            outputs = self.loss_func.reduce(model(input_ids, lm_labels=labels, **packed), labels, loss_mask)
            outputs.update(collect_moe_outputs(model))
            return outputs
        logits = model(input_ids, **packed)
        if labels is None:
            return {"logits": logits}
        outputs = self.loss_func(logits, labels, loss_mask)
        outputs.update(collect_moe_outputs(self.GPT_model))
        return outputs

    # ------------------------------------------------------------------ the model protocol (libai_lite.model)
    def output_metrics(self) -> dict:
        """``lm_loss`` is back-propagated; MoE layers add their auxiliary loss and statistics."""
        # `tokens`: under context parallelism the loss is re-weighted to the whole sequence's token mean.
        lm_loss = replace(LOSS, tokens="num_tokens")
        return {"lm_loss": lm_loss, **(MOE_METRICS if moe_layers(self.GPT_model) else {})}

    @staticmethod
    def tokens_per_sample(sample: Mapping) -> int:
        """Tokens one training sample feeds the model: its sequence."""
        return len(sample["input_ids"])

    def flops_per_sample(self, sample: Mapping) -> float:
        """Training FLOPs of one sample (see ``GPTModel.flops_per_token``)."""
        seq = self.tokens_per_sample(sample)
        return float(self.GPT_model.flops_per_token(seq)) * seq

    @property
    def max_seq_length(self) -> int:
        """The longest sequence the position embeddings cover."""
        return self.GPT_model.max_seq_length

    @property
    def pipeline_num_layers(self) -> int:
        """Layers the pipeline places: the transformer layers (embeddings go with 0, the head with the last)."""
        return self.GPT_model.hidden_layers

    def pipeline_module(self) -> nn.Module:
        """The module ``libai_lite.parallel.pipeline_split`` cuts into stages by its pieces' ``layer_idx``."""
        return self.GPT_model

    def pipeline_batch(self, batch: dict) -> tuple[tuple, dict, torch.Tensor]:
        """``(first-stage inputs, every-stage kwargs, labels)``: the labels also reach the stages as
        ``lm_labels``, so the last one returns per-token losses from the fused head; packed documents'
        ``position_ids`` and ``document_ids`` reach every stage too (each attention masks with the latter)."""
        kwargs = {"lm_labels": batch["labels"]} if self.GPT_model.fused_cross_entropy else {}
        kwargs.update({k: batch[k] for k in ("position_ids", "document_ids") if batch.get(k) is not None})
        return (batch["input_ids"],), kwargs, batch["labels"]

    def pipeline_loss_fn(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token loss (labels of -100 ignored) of the last stage's output: the schedule's loss_fn.

        The output is the per-token loss when the stage fuses its head (``pipeline_batch`` then sent
        it ``lm_labels``), else logits (``model.cfg.fused_cross_entropy=False``, or a head that
        cannot fuse).
        """
        if self.GPT_model.fuses_cross_entropy():
            return self.loss_func.reduce(output, labels)["lm_loss"]
        return self.loss_func(output, labels)["lm_loss"]

    def num_parameters(self, non_embedding: bool = False) -> int:
        """See ``GPTModel.num_parameters``."""
        return self.GPT_model.num_parameters(non_embedding)

    def flops_per_token(self, seq_length: int) -> int:
        """See ``GPTModel.flops_per_token``."""
        return self.GPT_model.flops_per_token(seq_length)

    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, **options):
        """Continue prompts; ``GPTModel.generate`` lists the options (``max_new_tokens``, ``do_sample``, ...)."""
        return self.GPT_model.generate(input_ids, attention_mask, **options)
