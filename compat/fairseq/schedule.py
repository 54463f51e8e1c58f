"""fairseq's lr schedulers (``--lr-scheduler``) as this project's ``WarmupDecayLR``.

Iteration ``k`` here is fairseq's ``num_updates`` after ``k`` updates: the lr update ``k + 1`` trains at.
Each schedule is fairseq's formula at every ``k``, except ``polynomial_decay``'s first update (below).
"""
from __future__ import annotations

from libai_lite.scheduler import WarmupDecayLR
from libai_lite.utils.errors import UsageError

__all__ = ["FairseqLR", "SCHEDULES"]

SCHEDULES = ("polynomial_decay", "inverse_sqrt", "cosine", "fixed")


def FairseqLR(optimizer, max_iter, warmup_iter=0, kind="fixed", lr=1e-3, warmup_updates=0, warmup_init_lr=-1.0,
              end_learning_rate=0.0, power=1.0, total_num_update=None, min_lr=0.0, lr_period_updates=-1.0):
    """fairseq's ``kind`` schedule with its options; the trainer's ``warmup_iter`` must be 0 (the schedule
    has its own warmup, ``warmup_updates``)."""
    if warmup_iter:
        raise UsageError("train.warmup_ratio and fairseq's --warmup-updates are both set: set train.warmup_ratio=0")
    if kind not in SCHEDULES:
        raise UsageError(f"unknown fairseq lr scheduler {kind!r}; choose one of {', '.join(SCHEDULES)}")
    w = int(warmup_updates)
    if kind == "polynomial_decay":
        # fairseq: lr * k / w in the warmup (update 1 at lr / w), then down to the end lr at total_num_update.
        # Here update 1 trains at 0, the linear warmup's start; every later update is fairseq's.
        total = max_iter if total_num_update is None else float(total_num_update)
        return WarmupDecayLR(optimizer, max_iter, w, 0.0, "linear", "polynomial", end_learning_rate / lr, power=power,
                             decay_end_iter=total)
    if kind == "fixed":
        # fairseq: min((k + 1) / w, 1): a linear warmup from 1 / w that reaches lr after w - 1 updates.
        return WarmupDecayLR(optimizer, max_iter, max(w - 1, 0), 1.0 / w if w else 1.0, "linear", "constant")
    if kind == "inverse_sqrt":
        init = (0.0 if w > 0 else lr) if warmup_init_lr < 0 else warmup_init_lr
        return WarmupDecayLR(optimizer, max_iter, w, init / lr, "linear", "inverse_sqrt")
    init = min_lr if warmup_init_lr < 0 else warmup_init_lr
    period = float(lr_period_updates) if lr_period_updates > 0 else max_iter - w
    return WarmupDecayLR(optimizer, max_iter, w, init / lr, "linear", "cosine", min_lr / lr, decay_end_iter=w + period)
