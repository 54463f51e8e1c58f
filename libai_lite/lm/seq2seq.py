"""The parts every encoder-decoder language model shares: loss with token accuracy, the LM head, generation
and the model protocol of ``libai_lite.model``. A project keeps its embedding, layers and FLOPs.

A ``Seq2SeqLM`` subclass provides ``embedding`` and ``lm_head`` (None on a pipeline stage without them),
``decoder_layers`` taking ``kv_cache=`` and ``cross_kv_cache=``, ``vocab_size``, ``fused_cross_entropy``,
``pipeline_num_layers``, ``pipeline_forward``, ``encode`` and ``decode``. ``Seq2SeqLMForPreTraining``
adds ``Seq2SeqLMLoss`` and reads the span-corruption batch's keys.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from .base import LanguageModel, LMForPreTraining
from ..layers import ParallelCrossEntropyLoss, linear_cross_entropy
from ..layers.attention import KVCache
from ..model import LOSS, MEAN
from ..utils.errors import UsageError

MASK_KEYS = ("encoder_attn_mask", "decoder_attn_mask", "encoder_decoder_attn_mask")


def label_is_top1(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Bool ``labels.shape``, True where the label's logit is the row's largest; ties count as correct.

    Compares with the row max instead of ``argmax`` so vocab-sharded logits exchange one value per token.
    Labels must be valid ids.
    """
    index = labels.unsqueeze(-1)
    if isinstance(logits, DTensor):
        vocab_dim = logits.ndim - 1
        # The index is split like the logits on every other dim and whole along the vocabulary.
        placements = [
            Replicate() if isinstance(p, Shard) and p.dim in (-1, vocab_dim) else p for p in logits.placements
        ]
        index = DTensor.from_local(index, logits.device_mesh, placements, run_check=False)
        picked = logits.gather(-1, index).redistribute(placements=placements).to_local()
        best = logits.amax(-1, keepdim=True).redistribute(placements=placements).to_local()
    else:
        picked = logits.gather(-1, index)
        best = logits.amax(-1, keepdim=True)
    return (picked >= best).squeeze(-1)


class Seq2SeqLMLoss(nn.Module):
    """Token-averaged cross entropy over the decoder positions whose label is not ``ignore_index``.

    Returns ``lm_loss``, the count ``num_tokens``, the detached ``nll_sum`` from which perplexity over
    ranks is ``exp(sum(nll_sum) / sum(num_tokens))``, and ``token_acc``, the detached top-1 accuracy.
    Vocab-sharded DTensor logits need ``loss_parallel()``.
    """

    def __init__(self, ignore_index: int = -100):
        super().__init__()
        self.ignore_index = ignore_index
        self.cross_entropy = ParallelCrossEntropyLoss()

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> dict:
        """The loss dict from logits ``[batch, dec_seq, vocab]`` (a DTensor under tensor parallelism)."""
        per_token = self.cross_entropy(logits, labels, ignore_index=self.ignore_index)
        keep = labels != self.ignore_index
        with torch.no_grad():
            correct = label_is_top1(logits.detach(), torch.where(keep, labels, 0)) & keep
        return self.reduce(per_token, correct, labels)

    def from_hidden(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> dict:
        """The loss dict of ``logits = hidden @ weight.T`` without materialising the logits."""
        per_token, correct = linear_cross_entropy(hidden, weight, labels, self.ignore_index, return_top1=True)
        return self.reduce(per_token, correct, labels)

    def reduce(self, per_token: torch.Tensor, correct: Optional[torch.Tensor], labels: torch.Tensor) -> dict:
        """Token-averaged loss, perplexity sums and accuracy from per-token losses and top-1 hits (None: no accuracy)."""
        keep = labels != self.ignore_index
        weights = keep.to(per_token.dtype)
        nll_sum = (per_token * weights).sum()
        num_tokens = keep.sum()
        # A batch with nothing to predict yields 0, not NaN.
        denominator = weights.sum().clamp(min=1.0)
        lm_loss = nll_sum / denominator
        out = {"lm_loss": lm_loss, "num_tokens": num_tokens, "nll_sum": nll_sum.detach()}
        if correct is not None:
            out["token_acc"] = correct.sum().to(per_token.dtype) / denominator
        return out


class Seq2SeqLM(LanguageModel):
    """Base of an encoder-decoder language model: its forward, LM head and generation (see the module docstring)."""

    def forward(
        self,
        encoder_input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        encoder_attn_mask: Optional[torch.Tensor] = None,
        decoder_attn_mask: Optional[torch.Tensor] = None,
        encoder_decoder_attn_mask: Optional[torch.Tensor] = None,
        skip_lm_head: bool = False,
    ) -> torch.Tensor:
        """Encode, decode and project to the vocabulary: logits ``[batch, dec_seq, vocab]``.

        Ids are ``[batch, enc_seq]`` and ``[batch, dec_seq]``. Masks mark real tokens with 1/True.
        ``encoder_attn_mask`` is ``[batch, enc_seq]``, LiBai's ``[batch, enc_seq, enc_seq]`` or 4-D;
        ``decoder_attn_mask`` gets causality added. ``encoder_decoder_attn_mask`` defaults to a 2-D
        ``encoder_attn_mask``, as in Hugging Face. ``skip_lm_head`` is as in ``head``.
        """
        return self.pipeline_forward(
            encoder_input_ids, decoder_input_ids, encoder_attn_mask=encoder_attn_mask,
            decoder_attn_mask=decoder_attn_mask, encoder_decoder_attn_mask=encoder_decoder_attn_mask,
            skip_lm_head=skip_lm_head,
        )

    def head(self, hidden: torch.Tensor, skip_lm_head: bool = False,
             lm_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The decoder's last hidden states (normed, as the head multiplies them) -> logits; with
        ``skip_lm_head`` those hidden states; with ``lm_labels`` and a head that fuses, ``[batch, dec_seq, 2]``:
        each token's loss and whether its label was the top-1 prediction (1.0 or 0.0)."""
        if skip_lm_head:
            return hidden
        if lm_labels is not None and self.fuses_cross_entropy():
            per_token, correct = linear_cross_entropy(hidden, self.lm_head.weight, lm_labels, return_top1=True)
            # A stage hands the schedule one tensor: the top-1 hits ride along, without gradient.
            return torch.stack((per_token, correct.to(per_token.dtype)), dim=-1)
        return self.lm_head(hidden)

    @torch.no_grad()
    def generate(
        self,
        encoder_input_ids: torch.Tensor,
        encoder_attn_mask: Optional[torch.Tensor] = None,
        decoder_start_token_id: int = 0,
        max_new_tokens: int = 20,
        use_cache: bool = True,
        vocab_size: Optional[int] = None,
        **options,
    ):
        """Decode from ``decoder_start_token_id`` given the encoder input; returns the decoder ids
        ``[batch, 1 + new]``, start token first, as Hugging Face does.

        Right-pad ``encoder_input_ids`` of different lengths and mark the padding 0 in ``encoder_attn_mask``.
        With ``use_cache`` each decoder step feeds one token. ``vocab_size`` and ``options`` are as in
        ``libai_lite.inference.decode``.
        """
        from ..inference import decode, eval_mode, gather_logits, tensor_parallel_group

        if self.embedding is None or self.lm_head is None:
            raise UsageError(f"generate needs the whole {type(self).__name__} (embedding to LM head); build it "
                             f"without pipeline parallelism")
        batch = encoder_input_ids.shape[0]
        start = torch.full((batch, 1), int(decoder_start_token_id), dtype=torch.long, device=encoder_input_ids.device)
        capacity = 1 + int(max_new_tokens)
        caches = {name: KVCache(capacity) for name in self.decoder_layers} if use_cache else None
        cross = {name: KVCache() for name in self.decoder_layers} if use_cache else None
        seen = {"ids": start[:, :0]}

        with eval_mode(self):
            encoder_hidden = self.encode(encoder_input_ids, encoder_attn_mask)

            def step(tokens: torch.Tensor) -> torch.Tensor:
                seen["ids"] = torch.cat([seen["ids"], tokens], dim=1)
                ids = tokens if use_cache else seen["ids"]
                logits = self.decode(ids, encoder_hidden, encoder_attn_mask, caches, cross, logits_to_keep=1)
                return gather_logits(logits)[:, -1]

            return decode(step, start, max_new_tokens=int(max_new_tokens), vocab_size=vocab_size or self.vocab_size,
                          sync_group=tensor_parallel_group(self), **options)


class Seq2SeqLMForPreTraining(LMForPreTraining):
    """A ``Seq2SeqLM`` with its pretraining loss, answering the model protocol (``libai_lite.model``).

    ``forward`` takes the span-corruption batch as keyword arguments. With ``labels`` ``[batch, dec_seq]``,
    -100 where nothing is predicted, it returns ``Seq2SeqLMLoss``'s dict plus MoE outputs, else ``{"logits"}``.
    """

    loss_metrics = {"lm_loss": LOSS, "token_acc": MEAN}
    # What pipeline_metrics returns, known on every pipeline rank (only the last stage computes it).
    pipeline_metric_names = ("token_acc",)

    def __init__(self, model: Seq2SeqLM, name: str):
        super().__init__(model, name, Seq2SeqLMLoss())

    def forward(
        self,
        encoder_input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        encoder_attn_mask: Optional[torch.Tensor] = None,
        decoder_attn_mask: Optional[torch.Tensor] = None,
        encoder_decoder_attn_mask: Optional[torch.Tensor] = None,
    ) -> dict:
        model = self.inner
        inputs = (encoder_input_ids, decoder_input_ids, encoder_attn_mask, decoder_attn_mask, encoder_decoder_attn_mask)
        if labels is not None and model.fuses_cross_entropy():
            hidden = model(*inputs, skip_lm_head=True)
            return self.with_moe_outputs(self.loss_func.from_hidden(hidden, model.lm_head.weight, labels))
        logits = model(*inputs)
        if labels is None:
            return {"logits": logits}
        return self.with_moe_outputs(self.loss_func(logits, labels))

    # ------------------------------------------------------------------ the model protocol (libai_lite.model)
    @staticmethod
    def tokens_per_sample(sample: Mapping) -> int:
        """Tokens one sample feeds the model: encoder plus decoder input."""
        return len(sample["encoder_input_ids"]) + len(sample["decoder_input_ids"])

    def flops_per_sample(self, sample: Mapping) -> float:
        """Training FLOPs of one sample (see the network's ``flops_per_token``, per encoder token)."""
        enc, dec = len(sample["encoder_input_ids"]), len(sample["decoder_input_ids"])
        return float(self.inner.flops_per_token(enc, decoder_seq_length=dec)) * enc

    def pipeline_batch(self, batch: dict) -> tuple[tuple, dict, torch.Tensor]:
        """A span-corruption batch as ``(first-stage inputs, masks every stage takes, labels)``; with a fused
        head the labels reach the stages as ``lm_labels`` too, and the last one returns per-token losses."""
        masks = {k: batch[k] for k in MASK_KEYS if batch.get(k) is not None}
        if self.inner.fused_cross_entropy:
            masks["lm_labels"] = batch["labels"]
        return (batch["encoder_input_ids"], batch["decoder_input_ids"]), masks, batch["labels"]

    def last_stage_outputs(self, output: torch.Tensor, labels: torch.Tensor) -> dict:
        """The loss dict of the last stage's output: per-token losses and top-1 hits (``[*labels.shape, 2]``)
        when the stage fused its head, else logits."""
        if self.inner.fuses_cross_entropy():
            return self.loss_func.reduce(output[..., 0], output[..., 1] > 0.5, labels)
        return self.loss_func(output, labels)

    def generate(self, encoder_input_ids: torch.Tensor, encoder_attn_mask: Optional[torch.Tensor] = None, **options):
        """Decode for the encoder input with ``Seq2SeqLM.generate``'s options. Callers tell an encoder-decoder
        by these parameter names."""
        return self.inner.generate(encoder_input_ids, encoder_attn_mask, **options)

    @torch.no_grad()
    def pipeline_metrics(self, output: torch.Tensor, labels: torch.Tensor) -> dict:
        """The logged scalars other than the loss (``pipeline_metric_names``) of the last stage's output."""
        out = self.last_stage_outputs(output, labels)
        return {k: out[k] for k in self.pipeline_metric_names}
