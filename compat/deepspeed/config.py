"""A DeepSpeed ``ds_config.json`` as this project's config: assignments, no-effect notes, or one refusal.

:func:`read_ds_config` reads the file as DeepSpeed's engine does (its defaults for what a section it has
leaves out; no ``fp16``/``bf16`` section is fp32, no ``zero_optimization`` is stage 0, no
``gradient_clipping`` is no clipping) and returns dotted config keys with their values plus one note for
each key that has no effect here. Every key it cannot take is reported together in one ``UsageError``.
``"auto"`` (Hugging Face Trainer's placeholder) is resolved as the Trainer would from this run's config:
a batch size is inferred, anything else keeps the config's value. docs/migrating.md has the table.
"""
from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

from libai_lite.utils.errors import UsageError

from .keys import (_ADAM_PARAMS, _BATCH, _BF16, _BUCKETS, _FP16, _NO_EFFECT, _OFFLOAD_TUNING, _REFUSED, _SCHEDULERS,
                   _SECTIONS, _ZERO_TUNING, KNOWN_KEYS)

__all__ = ["DeepSpeedRun", "read_ds_config", "to_overrides"]

@dataclass
class DeepSpeedRun:
    """What a ds_config asks for here: ``assignments`` (dotted config key -> value; ``train.scheduler`` a
    dict with its ``_target_``) and ``notes`` (one line per key with no effect or a shape of its own)."""

    assignments: Dict[str, Any] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)


class _Reader:
    """The file's values with the problems found so far; a bad value is a problem, not an exception."""

    def __init__(self, name: str):
        self.name, self.problems, self.run, self.autos = name, [], DeepSpeedRun(), []

    def refuse(self, key: str, reason: str) -> None:
        self.problems.append(f"{key} ({reason})")

    def note(self, key: str, reason: str) -> None:
        self.run.notes.append(f"{key} ({reason})")

    def set(self, key: str, value: Any) -> None:
        self.run.assignments[key] = value

    def section(self, d: Mapping, key: str) -> Mapping:
        value = d.get(key, {})
        if not isinstance(value, Mapping):
            self.refuse(key, f"must be an object {{...}}, got {json.dumps(value)}")
            return {}
        return value

    def number(self, where: str, value: Any, kind=float, low: Optional[float] = None) -> Any:
        """``value`` as ``kind`` (``"auto"`` stays ``"auto"``); None and a problem when it is not one."""
        if value == "auto":
            self.autos.append(where)
            return "auto"
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok and kind is int and float(value) != int(value):
            ok = False
        if not ok or (low is not None and value < low):
            bound = f" >= {low:g}" if low is not None else ""
            self.refuse(where, f"{json.dumps(value)} is not {'an integer' if kind is int else 'a number'}{bound}")
            return None
        return kind(value)

    def flag(self, where: str, value: Any) -> Any:
        if value == "auto":
            self.autos.append(where)
            return "auto"
        if not isinstance(value, bool):
            self.refuse(where, f"{json.dumps(value)} is not true or false")
            return None
        return value

    def unknown(self, where: str, name: str, known) -> None:
        near = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
        prefix = where.rsplit(".", 1)[0] + "." if "." in where else ""
        self.refuse(where, "not a DeepSpeed key known here" + (f"; did you mean {prefix}{near[0]}?" if near else ""))


def read_ds_config(source: Union[str, Path, Mapping], name: Optional[str] = None,
                   engine_defaults: bool = True) -> DeepSpeedRun:
    """This project's assignments and notes for a ds_config (a path to its JSON, or the dict itself).

    ``engine_defaults``: also assign DeepSpeed's defaults for the sections the file leaves out (fp32, no
    ZeRO, no clipping); a caller whose own settings give those (Megatron flags) passes False.

    Every key that is unknown or not taken is reported together in one ``UsageError``, each with its reason.
    """
    if isinstance(source, Mapping):
        ds, name = source, name or "(given as a dict)"
    else:
        name = name or str(source)
        try:
            text = Path(source).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"DeepSpeed config {name} not found; give the path of its ds_config.json") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read the DeepSpeed config {name}: {e}") from None
        try:
            ds = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(f"the DeepSpeed config {name} is not JSON ({e.msg} at line {e.lineno} column "
                             f"{e.colno}); fix the file") from None
    if not isinstance(ds, Mapping):
        raise UsageError(f"the DeepSpeed config {name} must be a JSON object {{...}}, not {type(ds).__name__}")
    r = _Reader(name)
    for key in ds:
        if key in _REFUSED:
            off = isinstance(ds[key], Mapping) and ds[key].get("enabled") is False
            if not off:
                r.refuse(key, _REFUSED[key])
        elif key in _NO_EFFECT:
            r.note(key, _NO_EFFECT[key])
        elif key not in _SECTIONS:
            r.unknown(key, key, KNOWN_KEYS)
    _batch(r, ds)
    if engine_defaults or "fp16" in ds or "bf16" in ds or "bfloat16" in ds:
        _precision(r, ds)
    if engine_defaults or "zero_optimization" in ds:
        _zero(r, ds)
    _optimizer(r, ds)
    _scheduler(r, ds)
    if "gradient_clipping" in ds:
        clip = r.number("gradient_clipping", ds["gradient_clipping"], low=0)
        if clip not in (None, "auto"):
            r.set("optim.params.clip_grad_max_norm", clip if clip > 0 else None)
    elif engine_defaults:  # DeepSpeed's default: no clipping
        r.set("optim.params.clip_grad_max_norm", None)
    if "steps_per_print" in ds:
        period = r.number("steps_per_print", ds["steps_per_print"], int, low=1)
        if period not in (None, "auto"):
            r.set("train.log_period", period)
    if r.problems:
        count = f"{len(r.problems)} problems" if len(r.problems) > 1 else "a problem"
        raise UsageError(f"{count} with the DeepSpeed config {name}, each with its reason: " + "; ".join(r.problems))
    r.run.assignments = {k: v for k, v in r.run.assignments.items() if v != "auto"}
    if r.autos:
        r.run.notes.append(f"{', '.join(r.autos)} (\"auto\": inferred from the other batch sizes, or this "
                           f"run's config value kept, as Hugging Face Trainer fills them in)")
    return r.run


def _batch(r: _Reader, ds: Mapping) -> None:
    given = {k: r.number(k, ds[k], int, low=1) for k in _BATCH if k in ds}
    if not given:
        return
    if "gradient_accumulation_steps" in given and len(given) == 1:
        r.refuse("gradient_accumulation_steps", "give train_batch_size or train_micro_batch_size_per_gpu too, "
                 "as DeepSpeed requires")
        return
    if None in given.values() or all(v == "auto" for v in given.values()):
        return  # a problem, or the config's batch sizes kept
    values = {k: (None if v == "auto" else v) for k, v in given.items()}
    batch, micro, acc = (values.get(k) for k in _BATCH)
    if batch is not None and micro is not None and batch % (micro * (acc or 1)):
        r.refuse("train_batch_size", f"{batch} is not train_micro_batch_size_per_gpu {micro} x "
                 f"gradient_accumulation_steps {acc or 1} x a number of data-parallel ranks; DeepSpeed needs "
                 f"train_batch_size = micro x accumulation x data-parallel size: fix one of them or leave one out")
        return
    for k, key in _BATCH.items():
        r.set(key, values.get(k))  # what the file leaves out is inferred, as DeepSpeed infers it
    if micro is not None:
        r.set("train.test_micro_batch_size", micro)


def _precision(r: _Reader, ds: Mapping) -> None:
    fp16 = r.section(ds, "fp16")
    if "bf16" in ds and "bfloat16" in ds:
        r.refuse("bfloat16", "the same section as bf16: give one")
    bf16 = r.section(ds, "bf16" if "bf16" in ds else "bfloat16")
    bf16_name = "bf16" if "bf16" in ds else "bfloat16"
    for key in fp16:
        if key not in _FP16:
            r.unknown(f"fp16.{key}", key, _FP16)
    for key in bf16:
        if key not in _BF16:
            r.unknown(f"{bf16_name}.{key}", key, _BF16)
    on16 = r.flag("fp16.enabled", fp16.get("enabled", False))
    onbf = r.flag(f"{bf16_name}.enabled", bf16.get("enabled", False))
    if on16 is True and onbf is True:
        r.refuse(f"{bf16_name}.enabled", "excludes fp16.enabled (one mixed precision), as in DeepSpeed")
        return
    if "auto" in (on16, onbf):
        return  # the config's train.amp is kept
    if on16:
        r.set("train.amp.enabled", True)
        r.set("train.amp.dtype", "fp16")
        power = r.number("fp16.initial_scale_power", fp16.get("initial_scale_power", 16), low=0)
        scale = r.number("fp16.loss_scale", fp16.get("loss_scale", 0), low=0)
        if scale not in (None, "auto") and scale > 0:
            r.set("train.amp.initial_scale", scale)
            r.note("fp16.loss_scale", "a fixed scale is not built here: the dynamic scale starts at it")
        elif power not in (None, "auto"):
            r.set("train.amp.initial_scale", 2.0 ** power)
        r.set("train.amp.growth_interval", r.number("fp16.loss_scale_window", fp16.get("loss_scale_window", 1000),
                                                    int, low=1))
        r.set("train.amp.min_loss_scale", r.number("fp16.min_loss_scale", fp16.get("min_loss_scale", 1), low=0))
        for key in ("hysteresis", "consecutive_hysteresis"):
            if key in fp16:
                r.note(f"fp16.{key}", "the loss scale halves at the first overflow here")
        if fp16.get("auto_cast") is False or "auto_cast" not in fp16:
            r.note("fp16", "autocast over fp32 master weights here; DeepSpeed without auto_cast casts the model "
                   "to fp16")
        if fp16.get("fp16_master_weights_and_grads"):
            r.refuse("fp16.fp16_master_weights_and_grads", "master weights are fp32 here; drop it")
    elif onbf:
        r.set("train.amp.enabled", True)
        r.set("train.amp.dtype", "bf16")
        r.note(bf16_name, "autocast over fp32 master weights here; DeepSpeed holds the model in bf16")
        for key in ("immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
                    "bf16_optimizer_states"):
            if key in bf16:
                r.note(f"{bf16_name}.{key}", "master weights, gradients and optimizer state are fp32 here")
    elif on16 is False and onbf is False:
        r.set("train.amp.enabled", False)  # DeepSpeed's default: fp32
    if not on16:
        for key in fp16:
            if key != "enabled":
                r.note(f"fp16.{key}", "no effect without fp16.enabled, as in DeepSpeed")


def _offload(r: _Reader, zero: Mapping, which: str) -> Optional[str]:
    """The device of ``zero_optimization.<which>`` ("cpu" or None); nvme and unknown keys are problems."""
    part = r.section(zero, which)
    where = f"zero_optimization.{which}"
    for key in part:
        if key not in ("device", *_OFFLOAD_TUNING):
            r.unknown(f"{where}.{key}", key, ("device", *_OFFLOAD_TUNING))
        elif key != "device":
            r.note(f"{where}.{key}", "the CPU offload here chooses its own buffers (pinned with a GPU)")
    device = part.get("device", "none")
    if device == "nvme":
        r.refuse(f"{where}.device", "no NVMe offload here: use cpu")
    elif device == "cpu":
        return "cpu"
    elif device not in ("none", None):
        r.refuse(f"{where}.device", f"{json.dumps(device)} is not a device: use cpu or none")
    return None


def _zero(r: _Reader, ds: Mapping) -> None:
    zero = r.section(ds, "zero_optimization")
    known = ("stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_params", *_ZERO_TUNING)
    for key in zero:
        if key not in known:
            r.unknown(f"zero_optimization.{key}", key, known)
        elif key in _ZERO_TUNING:
            r.note(f"zero_optimization.{key}", _BUCKETS)
    stage = r.number("zero_optimization.stage", zero.get("stage", 0), int, low=0)
    if stage == "auto" or stage is None:
        return
    if stage > 3:
        r.refuse("zero_optimization.stage", f"{stage} does not exist: use 0 (off), 1, 2 or 3")
        return
    optimizer = _offload(r, zero, "offload_optimizer") or ("cpu" if zero.get("cpu_offload") is True else None)
    params = _offload(r, zero, "offload_param") or ("cpu" if zero.get("cpu_offload_params") is True else None)
    if params and stage < 3:
        r.note("zero_optimization.offload_param", "no effect below stage 3, as in DeepSpeed")
        params = None
    offload = bool(optimizer or params)
    if offload and stage == 0:
        r.refuse("zero_optimization.offload_optimizer", "CPU offload moves a ZeRO optimizer's state and ZeRO is off "
                 "(stage 0): set zero_optimization.stage to 1 (the optimizer on the CPU), 2 or 3")
    elif offload and stage >= 2 and not (optimizer and params):
        r.note("zero_optimization.offload_" + ("optimizer" if optimizer else "param"),
               "CPU offload here keeps parameters, gradients and the optimizer step on the CPU together")
    r.set("train.zero_optimization.enabled", stage > 0)
    if stage > 0:
        r.set("train.zero_optimization.stage", stage)
    r.set("train.zero_optimization.offload", offload)


def _type_and_params(r: _Reader, ds: Mapping, name: str):
    """``(type, params)`` of DeepSpeed's ``{"type": ..., "params": {...}}`` section ``name``; other keys refused."""
    section = r.section(ds, name)
    for key in section:
        if key not in ("type", "params"):
            r.unknown(f"{name}.{key}", key, ("type", "params"))
    return str(section.get("type", "")), (r.section(section, "params") if "params" in section else {})


def _optimizer(r: _Reader, ds: Mapping) -> None:
    if "optimizer" not in ds:
        return
    kind, params = _type_and_params(r, ds, "optimizer")
    if kind.lower() not in ("adam", "adamw"):
        r.refuse(f"optimizer.type {kind or '(none)'}", "not built here: use Adam or AdamW, or leave the optimizer "
                 "section out and set optim in the config")
        return
    for key in params:
        if key not in _ADAM_PARAMS:
            r.unknown(f"optimizer.params.{key}", key, _ADAM_PARAMS)
    adam_w = params.get("adam_w_mode", True)
    r.set("optim._target_", "torch.optim.Adam" if kind.lower() == "adam" and adam_w is False else "torch.optim.AdamW")
    # DeepSpeed's FusedAdam defaults for what the section leaves out.
    r.set("optim.lr", r.number("optimizer.params.lr", params.get("lr", 1e-3), low=0))
    betas = params.get("betas", [0.9, 0.999])
    if betas == "auto":
        r.autos.append("optimizer.params.betas")
    elif (not isinstance(betas, list) or len(betas) != 2
          or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        r.refuse("optimizer.params.betas", f"{json.dumps(betas)} is not two numbers in [0, 1)")
    else:
        r.set("optim.betas", [float(b) for b in betas])
    r.set("optim.eps", r.number("optimizer.params.eps", params.get("eps", 1e-8), low=0))
    r.set("optim.weight_decay", r.number("optimizer.params.weight_decay", params.get("weight_decay", 0.0), low=0))
    if "torch_adam" in params:
        r.note("optimizer.params.torch_adam", "the optimizer is torch.optim's (fused) here")
    if params.get("bias_correction", True) is not True:
        r.refuse("optimizer.params.bias_correction", "torch's Adam always corrects its bias; drop it")
    if params.get("amsgrad", False) is not False:
        r.refuse("optimizer.params.amsgrad", "not taken here; drop it")


def _scheduler(r: _Reader, ds: Mapping) -> None:
    if "scheduler" not in ds:
        return
    kind, given = _type_and_params(r, ds, "scheduler")
    if kind not in _SCHEDULERS:
        r.refuse(f"scheduler.type {kind or '(none)'}", f"not built here: use {', '.join(_SCHEDULERS)}")
        return
    p = dict(_SCHEDULERS[kind])
    for key in given:
        if key not in p:
            r.unknown(f"scheduler.params.{key}", key, p)
        else:
            p[key] = given[key]
    where = "scheduler.params."
    warmup_type = p.pop("warmup_type")
    if warmup_type not in ("log", "linear"):
        r.refuse(where + "warmup_type", f"{json.dumps(warmup_type)}: use log or linear")
    warmup = r.number(where + "warmup_num_steps", p["warmup_num_steps"], int, low=0)
    total = p.get("total_num_steps")
    if "total_num_steps" in p:
        if total is None:
            r.refuse(where + "total_num_steps", f"missing: DeepSpeed's {kind} needs it")
            return
        total = r.number(where + "total_num_steps", total, int, low=1)
    if warmup is None or ("total_num_steps" in p and total is None):
        return
    schedule: Dict[str, Any] = {"_target_": "libai_lite.scheduler.MegatronLR"}
    if warmup != "auto":
        # DeepSpeed counts at least two warmup steps.
        schedule["warmup_iters"] = max(2, warmup)
        r.set("train.warmup_ratio", 0.0)
    if isinstance(total, int):
        if warmup != "auto" and total <= max(2, warmup):
            r.refuse(where + "total_num_steps", f"{total} must be after the warmup's {max(2, warmup)} steps")
            return
        schedule["decay_iters"] = total
    if kind == "WarmupCosineLR":
        schedule.update(decay="cosine",
                        init_lr_ratio=r.number(where + "warmup_min_ratio", p["warmup_min_ratio"], low=0),
                        min_lr_ratio=r.number(where + "cos_min_ratio", p["cos_min_ratio"], low=0))
        r.note("scheduler WarmupCosineLR", "the same cosine of the optimizer's lr here, but it stays at "
               "cos_min_ratio after total_num_steps (DeepSpeed's rises again) and the warmup is one step ahead")
    else:
        low = r.number(where + "warmup_min_lr", p["warmup_min_lr"], low=0)
        high = r.number(where + "warmup_max_lr", p["warmup_max_lr"], low=0)
        if high == "auto":  # Hugging Face fills in the run's lr
            if low not in (0, 0.0, "auto"):
                r.refuse(where + "warmup_max_lr", "\"auto\" with a warmup_min_lr other than 0: give a number")
            ratio = 0.0
        elif high is None or low is None:
            return
        else:
            if not high > 0:
                r.refuse(where + "warmup_max_lr", "must be above 0: it is the peak lr")
                return
            r.set("optim.lr", high)
            ratio = 0.0 if low == "auto" else low / high
        schedule.update(decay="linear" if kind == "WarmupDecayLR" else "constant", init_lr_ratio=ratio,
                        min_lr_ratio=ratio)
        shape = "then linear down to warmup_min_lr at total_num_steps" if kind == "WarmupDecayLR" else \
            "then constant"
        r.note(f"scheduler {kind}", f"warmup_max_lr is optim.lr; warmup from warmup_min_lr, {shape}; each step's "
               f"lr here is DeepSpeed's of the step after (its first two steps both use warmup_min_lr)")
    if warmup_type == "log":
        r.note(where + "warmup_type log", "the warmup is linear here, not log-shaped")
    if any(v is None for v in schedule.values()):
        return
    r.set("train.scheduler", {k: v for k, v in schedule.items() if v != "auto"})


def _hydra(value: Any) -> str:
    """``value`` in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_hydra(v)}" for k, v in value.items()) + "}"
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def to_overrides(run: DeepSpeedRun) -> List[str]:
    """``run``'s assignments as ``key=value`` overrides for ``tools/train_net.py`` (the schedule replaces
    ``train.scheduler`` whole; the optimizer's keys are set whatever the config's optimizer has)."""
    out = []
    for key, value in run.assignments.items():
        if key == "train.scheduler":
            out += ["~train.scheduler", f"+train.scheduler={_hydra(value)}"]
        elif key.startswith("optim.") and key.count(".") == 1:
            out.append(f"++{key}={_hydra(value)}")
        else:
            out.append(f"{key}={_hydra(value)}")
    return out
