"""Warmup + decay schedules with LiBai's class names.

Each is a pure function of the iteration, so its state is a few numbers and resuming at iteration k
gives exactly the lr of an uninterrupted run. The trainer fills in `max_iter` and `warmup_iter`.
"""
from __future__ import annotations

import math

from torch.optim.lr_scheduler import LRScheduler

from ..config.validate import FRACTION, NON_NEGATIVE, POSITIVE, OneOf, Range
from ..utils.errors import UsageError

_DECAYS = ("cosine", "linear", "polynomial", "exponential", "constant", "inverse_sqrt")


# The ranges of train.scheduler's keys these schedules take (checked before anything is built).
RULES = {
    "train.scheduler.warmup_factor": FRACTION,
    "train.scheduler.alpha": FRACTION,
    "train.scheduler.min_lr_ratio": FRACTION,
    "train.scheduler.end_learning_rate": NON_NEGATIVE,
    "train.scheduler.gamma": Range(low=0, high=1, low_open=True),
    "train.scheduler.power": POSITIVE,
    "train.scheduler.warmup_method": OneOf(("linear", "constant")),
}


def _iterations(value: float) -> float:
    """An iteration count as an int where it is whole (a fractional one comes from a sample count)."""
    value = float(value)
    return int(value) if value.is_integer() else value


class WarmupDecayLR(LRScheduler):
    """lr = base_lr * factor(it): warmup over `warmup_iter`, then `decay` down to `min_lr_ratio`.

    The decay ends at `decay_end_iter` (None: `max_iter`) and the lr stays at the floor after it.
    ``inverse_sqrt`` decays as ``sqrt(warmup_iter / it)`` from the end of the warmup (it has no end and no
    floor), as fairseq's and the original Transformer's schedule.
    A param group with a `min_lr` (optim.params.decoupled_min_lr) has its own floor, `min_lr / its lr`,
    on the same shape.
    `warmup_iter` and `decay_end_iter` may be fractional, since Megatron-LM counts its schedule in samples.
    """

    def __init__(self, optimizer, max_iter: int, warmup_iter: float = 0, warmup_factor: float = 0.001,
                 warmup_method: str = "linear", decay: str = "cosine", min_lr_ratio: float = 0.0, power: float = 1.0,
                 gamma: float = 0.999, last_epoch: int = -1, decay_end_iter: float | None = None):
        if decay not in _DECAYS:
            raise UsageError(f"unknown lr decay {decay!r}; choose one of {', '.join(_DECAYS)}")
        if warmup_method not in ("linear", "constant"):
            raise UsageError(f"unknown warmup_method {warmup_method!r}; choose 'linear' or 'constant'")
        if decay == "inverse_sqrt" and warmup_iter <= 0:
            raise UsageError("the inverse_sqrt lr decay is sqrt(warmup / iteration): it needs a warmup of at least "
                             "one iteration (train.warmup_ratio > 0 or the scheduler's warmup_iter)")
        if decay_end_iter is not None and decay not in ("constant", "inverse_sqrt") and decay_end_iter <= warmup_iter:
            raise UsageError(f"the lr decay would end at iteration {decay_end_iter}, not after the warmup's "
                             f"{warmup_iter}: make the decay longer than the warmup")
        self.max_iter = int(max_iter)
        self.warmup_iter = _iterations(warmup_iter)
        self.decay_end_iter = None if decay_end_iter is None else _iterations(decay_end_iter)
        self.warmup_factor = float(warmup_factor)
        self.warmup_method = warmup_method
        self.decay = decay
        self.min_lr_ratio = float(min_lr_ratio)
        self.power = float(power)
        self.gamma = float(gamma)
        # Held here, not read from the groups, so a resume takes this run's floors (restore_scheduler).
        self.min_lrs = [g.get("min_lr") for g in optimizer.param_groups]
        super().__init__(optimizer, last_epoch)

    def factor(self, it: int, min_lr_ratio: float | None = None) -> float:
        """Multiplier of the base lr at iteration `it` (0-based), decaying to `min_lr_ratio` (None: the
        schedule's own)."""
        if it < self.warmup_iter:
            if self.warmup_method == "constant":
                return self.warmup_factor
            alpha = it / self.warmup_iter
            return self.warmup_factor * (1 - alpha) + alpha
        if self.decay_end_iter is None:
            span = max(self.max_iter - self.warmup_iter, 1)
        else:
            span = self.decay_end_iter - self.warmup_iter
        progress = min(max(it - self.warmup_iter, 0) / span, 1.0) if span > 0 else 1.0
        floor = self.min_lr_ratio if min_lr_ratio is None else min_lr_ratio
        if self.decay == "constant":
            return 1.0
        if self.decay == "inverse_sqrt":
            return math.sqrt(self.warmup_iter / it) if it > 0 else 1.0
        if self.decay == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if self.decay == "linear":
            return floor + (1 - floor) * (1 - progress)
        if self.decay == "polynomial":
            return floor + (1 - floor) * (1 - progress) ** self.power
        return max(self.gamma ** (it - self.warmup_iter), floor)

    def get_lr(self):
        return [base * self.factor(self.last_epoch, None if low is None or not base else low / base)
                for base, low in zip(self.base_lrs, self.min_lrs)]


def WarmupCosineLR(optimizer, max_iter, warmup_factor=0.001, warmup_iter=0, alpha=0.0, warmup_method="linear"):
    """Cosine decay to `alpha` x base lr (LiBai's name and arguments)."""
    return WarmupDecayLR(optimizer, max_iter, warmup_iter, warmup_factor, warmup_method, "cosine", alpha)


def WarmupLinearLR(optimizer, max_iter, warmup_factor=0.001, warmup_iter=0, min_lr_ratio=0.0, warmup_method="linear"):
    """Linear decay to `min_lr_ratio` x base lr."""
    return WarmupDecayLR(optimizer, max_iter, warmup_iter, warmup_factor, warmup_method, "linear", min_lr_ratio)


def WarmupPolynomialLR(optimizer, max_iter, warmup_factor=0.001, warmup_iter=0, end_learning_rate=0.0, power=1.0,
                       warmup_method="linear"):
    """Polynomial decay to `end_learning_rate` (an absolute lr, as in LiBai)."""
    base = optimizer.param_groups[0]["lr"]
    ratio = end_learning_rate / base if base else 0.0
    return WarmupDecayLR(optimizer, max_iter, warmup_iter, warmup_factor, warmup_method, "polynomial", ratio,
                         power=power)


def WarmupExponentialLR(optimizer, max_iter, gamma=0.999, warmup_factor=0.001, warmup_iter=0, min_lr_ratio=0.0,
                        warmup_method="linear"):
    """lr x gamma per iteration after warmup, never below `min_lr_ratio` x base lr."""
    return WarmupDecayLR(optimizer, max_iter, warmup_iter, warmup_factor, warmup_method, "exponential", min_lr_ratio,
                         gamma=gamma)


def WarmupConstantLR(optimizer, max_iter, warmup_factor=0.001, warmup_iter=0, warmup_method="linear"):
    """Warmup, then the base lr for the rest of training."""
    return WarmupDecayLR(optimizer, max_iter, warmup_iter, warmup_factor, warmup_method, "constant")


def MegatronLR(optimizer, max_iter, warmup_iter=0, decay="linear", min_lr_ratio=0.0, init_lr_ratio=0.0,
               decay_iters=None, warmup_iters=None, warmup_fraction=None):
    """Megatron-LM's lr schedule, in iterations.

    Linear warmup from `init_lr_ratio` x lr over `warmup_iters`, or `warmup_fraction` of the decay length,
    then `decay` to `min_lr_ratio` x lr at `decay_iters` (None: the end of the run), and that floor after.
    Sample counts are passed as samples / global batch size. The trainer's `warmup_iter` must be 0 when
    the schedule has a warmup of its own.
    """
    if warmup_iter and (warmup_iters is not None or warmup_fraction is not None):
        raise UsageError("train.warmup_ratio and the scheduler's own warmup (warmup_iters/warmup_fraction, "
                         "Megatron's --lr-warmup-*) are both set: set train.warmup_ratio=0 or drop the other")
    length = max_iter if decay_iters is None else decay_iters
    if warmup_fraction is not None:
        warmup = float(warmup_fraction) * float(length)
    else:
        warmup = warmup_iter if warmup_iters is None else warmup_iters
    return WarmupDecayLR(optimizer, max_iter, warmup, init_lr_ratio, "linear", decay, min_lr_ratio,
                         decay_end_iter=decay_iters)


def check_group_floors(scheduler):
    """``scheduler``, refused when its optimizer has a group with a floor of its own (``min_lr``) that it
    would not read: only ``WarmupDecayLR`` does."""
    if not isinstance(scheduler, WarmupDecayLR) and any("min_lr" in g for g in scheduler.optimizer.param_groups):
        raise UsageError(f"optim.params.decoupled_min_lr needs a libai_lite.scheduler schedule, not "
                         f"{type(scheduler).__name__}: use one (WarmupCosineLR, MegatronLR, ...) or drop it")
    return scheduler


# Only the position is resumed; the schedule itself comes from this run's config, so a changed lr or
# train_iter takes effect on resume.
_POSITION_KEYS = ("last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial")


def restore_scheduler(scheduler, state: dict) -> dict:
    """Load a checkpoint's scheduler `state` into `scheduler`: the position from the checkpoint, the schedule
    from this run's config.

    So the lr at iteration k is what a fresh run of this config has at k. Returns {key: (saved, now)} for
    the schedule settings that changed.
    """
    own = {k: v for k, v in vars(scheduler).items() if k != "optimizer" and k not in _POSITION_KEYS}
    scheduler.load_state_dict(state)
    changed = {k: (state.get(k), v) for k, v in own.items() if k in state and state[k] != v}
    if changed:
        for k, v in own.items():
            setattr(scheduler, k, v)
        # The optimizer's lr was loaded with the old schedule's value: set the new schedule's.
        lrs = scheduler.get_lr()
        for group, lr, base in zip(scheduler.optimizer.param_groups, lrs, scheduler.base_lrs):
            group["lr"], group["initial_lr"] = lr, base
        scheduler._last_lr = list(lrs)
    return changed
