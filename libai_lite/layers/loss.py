"""Cross entropy that stays correct when the logits are split over the vocabulary."""
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


class ParallelCrossEntropyLoss(nn.Module):
    """Per-token cross entropy (``reduction="none"``) computed in fp32.

    The logits may be a plain tensor or a DTensor sharded on the vocabulary dimension.
    In the sharded case call it under ``torch.distributed.tensor.parallel.loss_parallel()``
    (which also must wrap ``backward``): that context makes ``F.cross_entropy`` itself
    vocab-parallel, which is why this layer goes through ``F.cross_entropy`` and not
    a hand-written logsumexp. The result is always a plain tensor shaped like ``target``
    (ignored positions hold 0), so callers can mask and sum it without DTensor rules.
    """

    def forward(self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        loss = F.cross_entropy(
            logits.float().flatten(0, -2), target.flatten(), reduction="none", ignore_index=ignore_index
        )
        if isinstance(loss, DTensor):
            # loss_parallel returns the per-token loss replicated over the tensor-parallel
            # ranks, so the local tensor already holds every token's value (no communication).
            loss = loss.to_local()
        return loss.view(target.shape)
