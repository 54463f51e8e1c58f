"""Seq2seq LM loss with the sums needed for token-weighted perplexity, plus token accuracy."""
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from libai_lite.layers import ParallelCrossEntropyLoss, linear_cross_entropy


def label_is_top1(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Bool ``labels.shape``: whether each label's logit is the largest of its row (ties count as correct).

    Written as "gathered logit >= row max" rather than ``argmax`` because, on logits
    sharded over the vocabulary (a DTensor from the vocab-parallel LM head), ``gather``
    and ``amax`` reduce shard-locally and exchange one value per token, while ``argmax``
    would all-gather the full ``[batch, seq, vocab]`` logits. Labels must be valid ids
    (replace ignored ones first).
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


class MT5Loss(nn.Module):
    """Token-averaged cross entropy over the decoder positions whose label is not ``ignore_index``.

    Returns ``lm_loss`` (what the trainer back-propagates), ``num_tokens`` (LongTensor count
    of scored tokens), ``nll_sum`` (detached sum of their NLL; perplexity over many batches
    or ranks is ``exp(sum(nll_sum) / sum(num_tokens))``) and ``token_acc`` (detached fraction
    of scored tokens whose label is the top-1 prediction; its name avoids "loss" so the
    trainer does not back-propagate it). Logits may be vocab-sharded DTensors (run it under
    ``loss_parallel()`` then, as ``ParallelCrossEntropyLoss`` says).
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
