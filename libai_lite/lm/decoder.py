"""The parts every decoder-only language model shares: loss, the end of its forward, generation and the
model protocol of ``libai_lite.model``. A project keeps its embeddings, layers, head and FLOPs.

A ``DecoderLM`` subclass provides ``embeddings``, ``layers`` taking ``kv_cache=``, ``final_layernorm``,
``lm_head``, ``vocab_size``, ``max_seq_length``, ``hidden_layers``, ``fused_cross_entropy`` and a
``forward(input_ids, attention_mask, position_ids, kv_caches, logits_to_keep, lm_labels, document_ids)``
that ends in ``norm_and_head``. ``DecoderLMForPreTraining`` adds ``CausalLMLoss``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Optional

import torch
from torch import nn

from .base import LanguageModel, LMForPreTraining
from ..layers import ParallelCrossEntropyLoss, linear_cross_entropy
from ..layers.attention import KVCache
from ..model import LOSS
from ..utils.errors import UsageError


class CausalLMLoss(nn.Module):
    """Token-averaged LM loss plus the sums needed for token-weighted perplexity across ranks.

    Labels equal to ``ignore_index`` do not count, and ``loss_mask`` weights each token's loss. Returns
    ``lm_loss``, ``num_tokens`` with non-zero weight, and the detached ``nll_sum``; with 0/1 masks
    perplexity over ranks is ``exp(sum(nll_sum) / sum(num_tokens))``.
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
        # A batch with nothing to predict yields 0, not NaN.
        lm_loss = nll_sum / weights.sum().clamp(min=torch.finfo(weights.dtype).tiny)
        return {"lm_loss": lm_loss, "num_tokens": (weights != 0).sum(), "nll_sum": nll_sum.detach()}


class DecoderLM(LanguageModel):
    """Base of a decoder-only language model: the final norm and head and generation (see the module docstring)."""

    @property
    def pipeline_num_layers(self) -> int:
        """Layers the pipeline places: the decoder layers (embeddings go with 0, norm and head with the last)."""
        return self.hidden_layers

    def norm_and_head(self, hidden_states: torch.Tensor, logits_to_keep: int = 0,
                      lm_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The end of ``forward``: keep the last ``logits_to_keep`` positions if > 0, then apply the final norm
        and LM head where this stage has them. With ``lm_labels`` and a fusing head it returns the fp32
        per-token loss ``[batch, seq]`` instead, so the full logits are never held."""
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        if self.lm_head is None:
            return hidden_states
        if lm_labels is not None and self.fuses_cross_entropy():
            return linear_cross_entropy(hidden_states, self.lm_head.weight, lm_labels)
        return self.lm_head(hidden_states)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                 max_new_tokens: int = 20, use_cache: bool = True, vocab_size: Optional[int] = None, **options):
        """Continue the prompts ``input_ids`` ``[batch, len]``; returns ``[batch, len + new]`` ids.

        Left-pad prompts of different lengths and mark the padding 0 in ``attention_mask``; positions count
        from each row's first real token. ``use_cache`` keeps keys and values so each step feeds one token.
        ``vocab_size`` is the tokenizer's real size, so padded embedding rows are never sampled; it defaults
        to the model's padded vocabulary. ``options`` are ``libai_lite.inference.decode``'s. Under tensor
        parallelism every rank must call it with the same arguments.
        """
        from ..inference import decode, eval_mode, gather_logits, tensor_parallel_group

        if self.embeddings is None or self.lm_head is None:
            raise UsageError(f"generate needs the whole {type(self).__name__} (embeddings to LM head); build it "
                             f"without pipeline parallelism")
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
            return decode(step, input_ids, max_new_tokens=int(max_new_tokens), vocab_size=vocab_size or self.vocab_size,
                          ignore_mask=mask == 0, sync_group=tensor_parallel_group(self), **options)


class DecoderLMForPreTraining(LMForPreTraining):
    """A ``DecoderLM`` with its pretraining loss, answering the model protocol (``libai_lite.model``).

    ``forward`` with labels returns ``CausalLMLoss``'s dict plus MoE outputs, else ``{"logits"}``. Labels
    are already shifted: ``labels[:, t]`` follows ``input_ids[:, t]``. ``position_ids`` and ``document_ids``
    ``[batch, seq]`` come with packed documents. ``decoder_name`` is the attribute holding the decoder.
    """

    # Under context parallelism the loss is re-weighted to the whole sequence's token mean.
    loss_metrics = {"lm_loss": replace(LOSS, tokens="num_tokens")}

    def __init__(self, decoder: DecoderLM, decoder_name: str):
        super().__init__(decoder, decoder_name, CausalLMLoss())

    @property
    def decoder(self) -> DecoderLM:
        """The decoder, whatever the attribute holding it is named."""
        return self.inner

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        document_ids: Optional[torch.Tensor] = None,
    ) -> dict:
        model = self.decoder
        packed = dict(position_ids=position_ids, document_ids=document_ids)
        if labels is not None and model.fuses_cross_entropy():
            return self.with_moe_outputs(
                self.loss_func.reduce(model(input_ids, lm_labels=labels, **packed), labels, loss_mask))
        logits = model(input_ids, **packed)
        if labels is None:
            return {"logits": logits}
        return self.with_moe_outputs(self.loss_func(logits, labels, loss_mask))

    # ------------------------------------------------------------------ the model protocol (libai_lite.model)
    @staticmethod
    def tokens_per_sample(sample: Mapping) -> int:
        """Tokens one training sample feeds the model: its sequence."""
        return len(sample["input_ids"])

    def flops_per_sample(self, sample: Mapping) -> float:
        """Training FLOPs of one sample (see the decoder's ``flops_per_token``)."""
        seq = self.tokens_per_sample(sample)
        return float(self.decoder.flops_per_token(seq)) * seq

    @property
    def max_seq_length(self) -> int:
        """The longest sequence generation and evaluation feed the model."""
        return self.decoder.max_seq_length

    def pipeline_batch(self, batch: dict) -> tuple[tuple, dict, torch.Tensor]:
        """``(first-stage inputs, every-stage kwargs, labels)``. With a fused head the labels also reach the
        stages as ``lm_labels``; packed documents' ``position_ids`` and ``document_ids`` reach every stage."""
        kwargs = {"lm_labels": batch["labels"]} if self.decoder.fused_cross_entropy else {}
        kwargs.update({k: batch[k] for k in ("position_ids", "document_ids") if batch.get(k) is not None})
        return (batch["input_ids"],), kwargs, batch["labels"]

    def last_stage_outputs(self, output: torch.Tensor, labels: torch.Tensor) -> dict:
        """The loss dict of the last stage's output: per-token losses when the stage fuses its head
        (``pipeline_batch`` sent it ``lm_labels``), else logits."""
        if self.decoder.fuses_cross_entropy():
            return self.loss_func.reduce(output, labels)
        return self.loss_func(output, labels)
