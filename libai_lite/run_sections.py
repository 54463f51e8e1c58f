"""The settings of a run's optimizer step, checkpoints, evaluation, writers and profiler, each declared once.

Each section is a frozen dataclass whose fields name their config key, default, range and meaning
(``config.settings.setting``); ``read_sections`` fills them from a config and ``check_settings`` checks every
key they declare before anything is built, so builders and hooks take settings, not config nodes. A default
is what a key the config leaves out reads as; it matches ``configs/common/train.py`` (a test checks) except
where absence means off: warmup, evaluation, the best checkpoint, ``max_to_keep`` and clipping.
"""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import OmegaConf

from .config.instantiate import locate
from .config.settings import read_settings, setting, setting_rules
from .config.validate import (COUNT, COUNT_OR_NULL, NON_NEGATIVE, NON_NEGATIVE_INT, POSITIVE, SWITCH, OneOf, PathValue,
                              Range, check_ranges)
from .data.build import PATHS as DATA_PATHS
from .data.build import RULES as DATA_RULES
from .optim.build import RULES as OPTIM_RULES
from .scheduler.lr_scheduler import RULES as SCHEDULER_RULES
from .utils.parallel_dims import PIPELINE_SCHEDULES


@dataclass(frozen=True)
class LossScale:
    """fp16's dynamic loss scaling (``train.amp``)."""

    initial_scale: float = setting(65536.0, key="train.amp.initial_scale", rule=POSITIVE,
                                   doc="the loss scale of the first step")
    growth_interval: int = setting(1000, key="train.amp.growth_interval", rule=COUNT,
                                   doc="steps without an overflow before the scale doubles")
    min_loss_scale: float = setting(1.0, key="train.amp.min_loss_scale", rule=POSITIVE,
                                    doc="an overflow at this scale or below stops the run: its gradients are not "
                                        "finite at any scale")


@dataclass(frozen=True)
class OptimStep:
    """What the trainer adds to ``cfg.optim``'s step: gradient clipping (``optim.params``) and how many batches
    with a non-finite loss it skips before stopping."""

    clip_grad_max_norm: float | None = setting(None, key="optim.params.clip_grad_max_norm",
                                               rule=Range(low=0, low_open=True, nullable=True),
                                               doc="the gradients' global norm is clipped to this; null: not clipped")
    clip_grad_norm_type: float = setting(2.0, key="optim.params.clip_grad_norm_type",
                                         rule=Range(low=0, low_open=True, infinite=True), null_is_default=True,
                                         doc="the p of the clipped p-norm (inf: the largest entry)")
    max_skipped_nonfinite: int = setting(0, key="train.max_skipped_nonfinite",
                                         rule=Range(low=0, integer=True, nullable=True), null_is_default=True,
                                         doc="batches with a NaN/inf loss skipped before the run stops (not fp16)")


@dataclass(frozen=True)
class CheckpointSettings:
    """``train.checkpointer`` and where the run writes (``train.output_dir``) and reads weights from."""

    output_dir: str | None = setting(None, key="train.output_dir", doc="the run's folder")
    period: int | None = setting(None, key="train.checkpointer.period", rule=NON_NEGATIVE_INT, needed_when="trains",
                                 doc="iterations between periodic checkpoints (0: only the final one)")
    max_to_keep: int | None = setting(None, key="train.checkpointer.max_to_keep", rule=COUNT_OR_NULL,
                                      doc="periodic checkpoints kept; null: all")
    async_save: bool | None = setting(None, key="train.checkpointer.async_save", rule=OneOf((None, False, True)),
                                      doc="write checkpoints in the background; null: on a GPU, off on the CPU")
    load_weight: str | None = setting("", key="train.load_weight", doc="a checkpoint to load weights from")


@dataclass(frozen=True)
class EvalSettings:
    """``train.evaluation``: whether and how often the run evaluates, and the metric ``model_best`` follows
    (``metric`` None: no ``model_best``)."""

    enabled: bool = setting(False, key="train.evaluation.enabled", rule=OneOf((None, False, True)),
                            null_is_default=True, doc="evaluate on the valid split during training")
    period: int = setting(0, key="train.evaluation.eval_period", rule=NON_NEGATIVE_INT, null_is_default=True,
                          needed_when="evaluates", doc="iterations between evaluations (0: only at the end)")
    metric: str | None = setting(None, key="train.evaluation.eval_metric",
                                 doc="the evaluator's result model_best follows; null: no model_best")
    mode: str = setting("min", key="train.evaluation.eval_mode", rule=OneOf(("min", "max")),
                        doc="whether model_best has the least or the most of the metric")


@dataclass(frozen=True)
class WandbSettings:
    """``train.wandb`` when enabled."""

    project: str = setting("libai_lite", key="train.wandb.project", null_is_default=True, doc="the W&B project")
    name: str | None = setting(None, key="train.wandb.name", doc="the W&B run's name; null: W&B's")
    mode: str = setting("offline", key="train.wandb.mode", null_is_default=True,
                        doc="offline (no network), online or disabled")


@dataclass(frozen=True)
class LogSettings:
    """The log line, metrics.json and TensorBoard (every ``period`` steps), W&B, and the start-up estimate."""

    period: int | None = setting(None, key="train.log_period", rule=COUNT, needed_when="trains",
                                 doc="iterations between log lines and metrics.json rows")
    peak_tflops: float | None = setting(None, key="train.peak_tflops", rule=Range(low=0, low_open=True, nullable=True),
                                        doc="MFU's denominator per GPU; null: the device table's")
    memory_estimate: bool = setting(True, key="train.log_memory_estimate", rule=SWITCH,
                                    doc="log the memory planner's per-rank estimate at start-up")
    wandb: WandbSettings | None = setting(None, doc="train.wandb when enabled")
    straggler_ratio: float | None = setting(1.2, key="train.straggler.ratio",
                                            rule=Range(low=1, high=100, low_open=True, nullable=True),
                                            doc="a rank this many times the median rank's step time is named; "
                                                "null: not watched")
    straggler_periods: int = setting(2, key="train.straggler.periods", rule=Range(low=1, high=1000, integer=True),
                                     null_is_default=True, doc="log periods running a straggler must be slower")
    straggler_min_seconds: float = setting(0.02, key="train.straggler.min_seconds", rule=NON_NEGATIVE,
                                           doc="seconds over the median a straggler must also be")


@dataclass(frozen=True)
class ProfileSettings:
    """``train.profile`` when enabled: ``torch.profiler``'s schedule, and the CUDA memory snapshot."""

    wait: int = setting(10, key="train.profile.wait", rule=NON_NEGATIVE_INT, doc="steps before the profiler starts")
    warmup: int = setting(2, key="train.profile.warmup", rule=NON_NEGATIVE_INT, doc="steps it warms up, not traced")
    active: int = setting(3, key="train.profile.active", rule=COUNT, doc="steps traced")
    repeat: int = setting(1, key="train.profile.repeat", rule=COUNT, doc="times the wait-warmup-active cycle runs")
    memory_snapshot: bool = setting(False, key="train.profile.memory_snapshot", rule=SWITCH,
                                    doc="also dump the CUDA allocator's history of the traced steps")


# The keys of train (its layout, batch, iterations) no record declares, each with its rule; periods of 0 mean
# "never" (only at the end) where the hooks say so.
RUN_RULES = {
    "train.train_micro_batch_size": COUNT_OR_NULL,
    "train.global_batch_size": COUNT_OR_NULL,
    "train.num_accumulation_steps": COUNT_OR_NULL,
    "train.test_micro_batch_size": COUNT,
    "train.train_iter": Range(low=0, integer=True, nullable=True),
    "train.train_epoch": Range(low=0, nullable=True),
    "train.warmup_ratio": Range(low=0, high=1, nullable=True),
    "train.seed": Range(low=0, high=2**32 - 1, integer=True),
    "train.evaluation.eval_iter": COUNT,
    "train.activation_checkpoint.every_n_layers": COUNT_OR_NULL,
    "train.zero_optimization.stage": Range(low=1, high=3, integer=True),
    "train.dist.data_parallel_size": COUNT_OR_NULL,
    "train.dist.data_parallel_replicate_size": COUNT_OR_NULL,
    "train.dist.data_parallel_shard_size": COUNT_OR_NULL,
    "train.dist.tensor_parallel_size": COUNT,
    "train.dist.pipeline_parallel_size": COUNT,
    "train.dist.context_parallel_size": COUNT,
    "train.dist.pipeline_num_layers": COUNT_OR_NULL,
    "train.dist.virtual_pipeline_size": COUNT,
    "train.dist.timeout": POSITIVE,
    "train.dist.strict_layout": OneOf((False, True)),
    "train.dist.backend": OneOf((None, "nccl", "gloo")),
    "train.dist.pipeline_schedule": OneOf(PIPELINE_SCHEDULES),
    "train.amp.dtype": OneOf(("bf16", "fp16")),
}
# Every rule of the keys the core reads beside the records': the run's, the optimizer's, the schedule's, the data's.
RANGES = {**RUN_RULES, **OPTIM_RULES, **SCHEDULER_RULES, **DATA_RULES}
# The paths a run reads or writes: a number, list or dict there is refused in one line before os.path meets it.
PATHS = {
    "train.output_dir": PathValue(),
    "train.load_weight": PathValue(nullable=True),
    **DATA_PATHS,
}

RECORDS = (LossScale, OptimStep, CheckpointSettings, EvalSettings, WandbSettings, LogSettings, ProfileSettings)


def check_settings(cfg) -> None:
    """Refuse, in one line, the first key of ``cfg`` out of its range: ``RANGES``, the records' own rules and the
    ``model.cfg`` ranges its model class declares (``config_ranges``)."""
    check_ranges(cfg, {**RANGES, **setting_rules(RECORDS), **model_ranges(cfg)})


def model_ranges(cfg) -> dict:
    """``{"model.cfg.<key>": rule}`` from the ``config_ranges`` of the class ``model._target_`` names ({} when it
    names none or cannot be imported: ``check_targets`` reports that)."""
    target = OmegaConf.select(cfg, "model._target_", default=None, throw_on_missing=False)
    try:
        cls = locate(target) if isinstance(target, str) else target
    except Exception:  # noqa: BLE001 - a target that does not import is check_targets' to report
        return {}
    return {f"model.cfg.{key}": rule for key, rule in (getattr(cls, "config_ranges", None) or {}).items()}


def read_sections(cfg, *, trains: bool, evaluates: bool, fp16: bool) -> dict:
    """``RunSpec``'s section fields from ``cfg``: ``loss_scale`` (fp16 only), ``optim``, ``checkpoint``,
    ``evaluation``, ``log`` and ``profile``. The log and checkpoint periods are required when the run ``trains``,
    the evaluation period when it ``evaluates``."""
    train = cfg.train
    return dict(
        loss_scale=read_settings(LossScale, cfg) if fp16 else None,
        optim=read_settings(OptimStep, cfg),
        checkpoint=read_settings(CheckpointSettings, cfg, trains=trains),
        evaluation=read_settings(EvalSettings, cfg, evaluates=evaluates),
        log=read_settings(LogSettings, cfg, {"wandb": wandb_settings(cfg)}, trains=trains),
        profile=read_settings(ProfileSettings, cfg) if (train.get("profile") or {}).get("enabled", False) else None,
    )


def wandb_settings(cfg) -> WandbSettings | None:
    """``train.wandb`` of ``cfg`` when it is enabled, else None (an empty name, project or mode reads as the
    default)."""
    if not ((cfg.get("train") or {}).get("wandb") or {}).get("enabled", False):
        return None
    return read_settings(WandbSettings, cfg)
