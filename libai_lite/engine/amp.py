"""Mixed precision: the autocast context and fp16 loss scaling that agrees on every rank (the autocast dtype is
``run_spec.amp_dtype``)."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist


def autocast_context(device: torch.device, amp_dtype: torch.dtype | None):
    """The autocast context for a run's precision on ``device`` (a no-op in fp32): training and evaluation alike."""
    if amp_dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=amp_dtype)


class SyncedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose "found inf" flags agree over a process group: 1 where any rank overflowed.

    The flags are reduced with MAX, never summed: fused Adam/AdamW/SGD skip a step only where ``found_inf`` is
    exactly 1 and apply a step (with inf gradients) given 2. torch's ``ShardedGradScaler`` keeps a ``[1]``
    flag, which the fused AdamW kernel refuses after ``unscale_``; this keeps GradScaler's ``[]`` flags.
    """

    def __init__(self, device: str, process_group=None, **kwargs):
        super().__init__(device, **kwargs)
        self.process_group = process_group

    def _sync(self, found_inf_per_device: dict) -> dict:
        for found_inf in found_inf_per_device.values():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.process_group)
        return found_inf_per_device

    def unscale_(self, optimizer) -> None:
        """Unscale this rank's gradients, then agree with every rank on whether any overflowed."""
        super().unscale_(optimizer)
        if self._enabled:
            self._sync(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"])

    def _check_inf_per_device(self, optimizer):
        # step() without unscale_() (fused optimizers) checks through here.
        return self._sync(super()._check_inf_per_device(optimizer))


def build_loss_scaler(device: torch.device, initial_scale: float, growth_interval: int):
    """fp16 dynamic loss scaling whose overflow check agrees on every rank.

    Ranks hold different gradients under ZeRO-2/3, tensor and expert parallelism, so with a
    rank-local check one rank could skip a step another takes and the replicas would drift apart.
    """
    kwargs = dict(init_scale=initial_scale, growth_interval=growth_interval)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return SyncedGradScaler(device.type, process_group=dist.group.WORLD, **kwargs)
    return torch.amp.GradScaler(device.type, **kwargs)
