"""The settings of a run's optimizer step, checkpoints, evaluation, writers and profiler, read once from its config.

Each section is a frozen dataclass ``run_spec.resolve_run`` fills, so builders and hooks take settings, not
config nodes. A key a config leaves out takes the field's default, which matches ``configs/common/train.py``
except where absence means off: warmup, evaluation, the best checkpoint, ``max_to_keep`` and clipping.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from .utils.errors import UsageError


@dataclass(frozen=True)
class LossScale:
    """fp16's dynamic loss scaling (``train.amp``)."""

    initial_scale: float = 65536.0
    growth_interval: int = 1000
    # An overflow at this scale or below stops the run: its gradients are not finite at any scale.
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class OptimStep:
    """What the trainer adds to ``cfg.optim``'s step: gradient clipping (``optim.params``) and how many batches
    with a non-finite loss it skips before stopping."""

    clip_grad_max_norm: float | None = None
    clip_grad_norm_type: float = 2.0
    max_skipped_nonfinite: int = 0


@dataclass(frozen=True)
class CheckpointSettings:
    """``train.checkpointer`` and where the run writes (``train.output_dir``) and reads weights from."""

    output_dir: str | None
    # Iterations between periodic checkpoints (0: only the final one); None only where no training runs.
    period: int | None
    max_to_keep: int | None = None
    async_save: bool | None = None  # None: on a GPU, off on the CPU (checkpoint.dcp_io.resolve_async_save)
    load_weight: str | None = ""


@dataclass(frozen=True)
class EvalSettings:
    """``train.evaluation``: whether and how often the run evaluates, and the metric ``model_best`` follows
    (``metric`` None: no ``model_best``)."""

    enabled: bool = False
    period: int = 0
    metric: str | None = None
    mode: str = "min"


@dataclass(frozen=True)
class WandbSettings:
    """``train.wandb`` when enabled."""

    project: str = "libai_lite"
    name: str | None = None
    mode: str = "offline"


@dataclass(frozen=True)
class LogSettings:
    """The log line, metrics.json and TensorBoard (every ``period`` steps), W&B, and the start-up estimate."""

    period: int | None
    peak_tflops: float | None = None  # MFU's denominator; None: the device table's
    memory_estimate: bool = True
    wandb: WandbSettings | None = None
    # A rank over straggler_ratio x the median rank's step time (and straggler_min_seconds over it) for
    # straggler_periods log lines is named.
    straggler_ratio: float | None = 1.2  # None: not watched
    straggler_periods: int = 2
    straggler_min_seconds: float = 0.02


@dataclass(frozen=True)
class ProfileSettings:
    """``train.profile`` when enabled: ``torch.profiler``'s schedule, and the CUDA memory snapshot."""

    wait: int = 10
    warmup: int = 2
    active: int = 3
    repeat: int = 1
    memory_snapshot: bool = False


def read_sections(cfg, *, trains: bool, evaluates: bool, fp16: bool) -> dict:
    """``RunSpec``'s section fields from ``cfg``: ``loss_scale`` (fp16 only), ``optim``, ``checkpoint``,
    ``evaluation``, ``log`` and ``profile``. The log and checkpoint periods are required when the run ``trains``,
    the evaluation period when it ``evaluates``; null reads as the default where the trainer always read it so."""
    train = cfg.train
    amp, ck, ev = train.get("amp") or {}, train.get("checkpointer") or {}, train.get("evaluation") or {}
    straggler = train.get("straggler") or {}
    params = (cfg.get("optim") or {}).get("params") or {}
    eval_period = _needed(ev, "eval_period", "train.evaluation") if evaluates else ev.get("eval_period")
    return dict(
        loss_scale=LossScale(initial_scale=float(amp.get("initial_scale", LossScale.initial_scale)),
                             growth_interval=int(amp.get("growth_interval", LossScale.growth_interval)),
                             min_loss_scale=float(amp.get("min_loss_scale", LossScale.min_loss_scale)))
        if fp16 else None,
        optim=OptimStep(clip_grad_max_norm=params.get("clip_grad_max_norm"),
                        clip_grad_norm_type=float(params.get("clip_grad_norm_type") or OptimStep.clip_grad_norm_type),
                        max_skipped_nonfinite=int(train.get("max_skipped_nonfinite") or 0)),
        checkpoint=CheckpointSettings(output_dir=train.get("output_dir"),
                                      period=_needed(ck, "period", "train.checkpointer") if trains else ck.get("period"),
                                      max_to_keep=ck.get("max_to_keep"), async_save=ck.get("async_save"),
                                      load_weight=train.get("load_weight")),
        evaluation=EvalSettings(enabled=bool(ev.get("enabled", False)), period=int(eval_period or 0),
                                metric=ev.get("eval_metric"), mode=ev.get("eval_mode", EvalSettings.mode)),
        log=LogSettings(period=_needed(train, "log_period", "train") if trains else train.get("log_period"),
                        peak_tflops=train.get("peak_tflops", None),
                        memory_estimate=bool(train.get("log_memory_estimate", LogSettings.memory_estimate)),
                        wandb=wandb_settings(train.get("wandb", None)),
                        straggler_ratio=straggler.get("ratio", LogSettings.straggler_ratio),
                        straggler_periods=int(straggler.get("periods") or LogSettings.straggler_periods),
                        straggler_min_seconds=float(straggler.get("min_seconds", LogSettings.straggler_min_seconds)
                                                    or 0.0)),
        profile=profile_settings(train.get("profile")),
    )


def _needed(node, key: str, where: str):
    """``node[key]``, or a one-line UsageError naming the missing key (null is a value here)."""
    if key not in node:
        raise UsageError(f"{where}.{key} is missing from the config: set it (configs/common/train.py has every "
                         f"train key with its default)")
    return node[key]


def wandb_settings(wandb) -> WandbSettings | None:
    """``train.wandb`` when it is enabled, else None (an empty name, project or mode reads as the default)."""
    if not (wandb or {}).get("enabled", False):
        return None
    return WandbSettings(project=wandb.get("project") or WandbSettings.project, name=wandb.get("name"),
                         mode=wandb.get("mode") or WandbSettings.mode)


def profile_settings(profile) -> ProfileSettings | None:
    """``train.profile`` when it is enabled, else None."""
    profile = profile or {}
    if not profile.get("enabled", False):
        return None
    return ProfileSettings(**{f.name: profile[f.name] for f in fields(ProfileSettings) if f.name in profile})
