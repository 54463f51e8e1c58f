"""Megatron-LM / Megatron-DeepSpeed / OneFlow-GPT ``pretrain_gpt.py`` command lines as this project's config.

:func:`translate_megatron_args` reads a flag string as ``pretrain_gpt.py`` does, Megatron-LM's defaults
for what is not given, and returns config assignments (``train.train_iter = 500``), the lr schedule
(``MegatronLR``: decay and warmup lengths of their own, in iterations), whether to resume, and the flags
that have no effect here (named, not dropped). The flags that shape the model (``--swiglu``,
``--normalization``, ``--position-embedding-type``, ``--disable-bias-linear``, ...) choose, among the
model families the caller passes (:class:`MegatronModel`, ``MEGATRON_MODELS`` for this repository's
projects), the one that builds that architecture, whose config the assignments apply to. Every flag that is
unknown or not taken here is reported together in one error, each with its reason. docs/migrating.md
says what maps.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

from compat.deepspeed import read_ds_config
from libai_lite.utils.errors import UsageError

from .data_flags import data_and_tokenizer
from .flags import (_ARCH, _ARCH_SWITCHES, _DECAYS, _DEFAULTS, _DIRECT, _MOE, _NO_EFFECT, _REFUSED, _SHARDING,
                    _SWITCHES, Call, _int, _num, _parse, _Problems, _Reader, _require)
from .models import MegatronModel, choose_model
from .run import MegatronRun

__all__ = ["MegatronRun", "translate_megatron_args", "render_config"]


def translate_megatron_args(text: str, models: Sequence[MegatronModel],
                            checkpoint_exists: Callable[[str], str] = lambda path: "",
                            corpus_record: Callable[[str], Optional[dict]] = lambda prefix: None) -> MegatronRun:
    """This project's run for the Megatron flags ``text``, on the family of ``models`` that builds its model.

    ``checkpoint_exists(path)`` names what ``--load path`` holds: ``"ours"``, ``"megatron"`` or ``""``
    (nothing there): a Megatron checkpoint is refused with the converting command. ``corpus_record(prefix)``
    is the tokenizer record beside ``--data-path prefix`` (or None): it names the tokenizer when no flag does,
    as OneFlow-GPT's command lines give none. Every flag not taken is reported together in one ``UsageError``.
    """
    problems = _Problems()
    given = _parse(text, problems)
    read = _Reader(given, problems)
    run = MegatronRun()
    a = run.assignments
    raw: Dict[str, Any] = {}
    for name in given:
        if name in _REFUSED:
            problems.add(name, _REFUSED[name])
        elif name in _DIRECT:
            key, convert = _DIRECT[name]
            value = read.one(name, convert)
            if value is not None:
                a[key] = value
        elif name in _ARCH:
            arg, convert = _ARCH[name]
            value = read.one(name, convert)
            if value is not None:
                raw[arg] = value
        elif name in _SWITCHES:
            read.switch(name)
            a.update(_SWITCHES[name])
        elif name in _ARCH_SWITCHES:
            read.switch(name)
            raw.update(_ARCH_SWITCHES[name])
        elif name in _NO_EFFECT:
            run.no_effect.append(f"{name} ({_NO_EFFECT[name]})")
    mlp_flags = [f for f in ("--swiglu", "--openai-gelu", "--squared-relu") if f in given]
    if len(mlp_flags) > 1:
        problems.add(mlp_flags[1], f"excludes {mlp_flags[0]} (one activation)")
    _batch_and_length(run, read)
    data_and_tokenizer(run, read, corpus_record)
    _schedule(run, read)
    _precision_and_parallel(run, read)
    _logging(run, read)
    run.model = choose_model(read, raw, models, a, run.no_effect)
    _load(run, read, checkpoint_exists)
    _deepspeed(run, read)
    for key, value in _DEFAULTS.items():
        a.setdefault(key, value)
    if problems:
        raise UsageError(problems.message())
    run.parallel_sizes = {flag: int(a[key]) for flag, key in (("tp", "train.dist.tensor_parallel_size"),
                                                              ("pp", "train.dist.pipeline_parallel_size"),
                                                              ("cp", "train.dist.context_parallel_size"))}
    return run


def _batch_and_length(run: MegatronRun, read: _Reader) -> None:
    a = run.assignments
    if _require(read, "--micro-batch-size") and "train.train_micro_batch_size" in a:
        a["train.test_micro_batch_size"] = a["train.train_micro_batch_size"]
    # OneFlow-GPT's --num-accumulation-steps: with --global-batch-size too, the run checks the three agree with
    # its data-parallel size (the launcher's, not --num-gpus-per-node's).
    acc = read.one("--num-accumulation-steps", _int)
    if acc is not None and acc < 1:
        read.problems.add("--num-accumulation-steps", f"{acc} is not a positive number of micro-batches")
        acc = None
    if "--global-batch-size" in read.given:
        a["train.num_accumulation_steps"] = acc
    else:  # Megatron's global batch: micro x data-parallel size (x OneFlow-GPT's accumulation)
        a.update({"train.global_batch_size": None, "train.num_accumulation_steps": acc or 1})
    optimizer = read.one("--optimizer", default="adam")
    if optimizer == "sgd":
        read.problems.add("--optimizer sgd", "the optimizer these flags build is AdamW; for SGD write a config with "
                          "optim = LazyCall(torch.optim.SGD)(...) (configs/common/optim.py's layout)")
    elif optimizer not in ("adam", "adamw"):
        read.problems.add(f"--optimizer {optimizer}", "use adam or adamw (both AdamW: Megatron's adam decays "
                          "weights decoupled, as AdamW)")
    samples = read.one("--train-samples", _int)
    if "--train-iters" in read.given and "--train-samples" in read.given:
        read.problems.add("--train-samples", "give --train-iters or --train-samples, not both")
    elif samples is not None:
        gbs = a.get("train.global_batch_size")
        if gbs is None:
            read.problems.add("--train-samples", "needs --global-batch-size here (iterations are counted from it)")
        else:
            a["train.train_iter"] = samples // gbs
    else:
        _require(read, "--train-iters", "--train-samples")
    _require(read, "--lr")
    if "--eval-iters" in read.given:
        iters = read.one("--eval-iters", _int)
        if iters == 0:
            a["train.evaluation.enabled"] = False
        elif iters is not None:
            a["train.evaluation.eval_iter"] = iters
    if "--eval-interval" not in read.given and "train.train_iter" in a:
        # No evaluation during training, one at the end.
        a["train.evaluation.eval_period"] = a["train.train_iter"]


def _schedule(run: MegatronRun, read: _Reader) -> None:
    """Megatron's lr schedule in iterations: ``MegatronLR`` with lengths of its own (samples / global batch)."""
    a, problems, given = run.assignments, read.problems, read.given
    samples = "--train-samples" in given
    unit, other = ("samples", "iters") if samples else ("iters", "samples")
    for kind in ("decay", "warmup"):
        if f"--lr-{kind}-{other}" in given:
            problems.add(f"--lr-{kind}-{other}", f"this run counts {unit} (--train-{unit}): give --lr-{kind}-{unit}")
    warmups = [f for f in ("--lr-warmup-fraction", f"--lr-warmup-{unit}") if f in given]
    if len(warmups) > 1:
        problems.add(warmups[1], f"give one of {' and '.join(warmups)}")
    style = read.one("--lr-decay-style", default="linear")
    if style not in _DECAYS:
        problems.add(f"--lr-decay-style {style}", f"not built here; use {', '.join(_DECAYS)}")
        style = "linear"
    lr = float(a.get("optim.lr") or 0.0)
    min_lr = read.one("--min-lr", _num, 0.0)
    init_lr = read.one("--lr-warmup-init", _num, 0.0)
    if lr and not 0 <= min_lr <= lr:
        problems.add("--min-lr", f"{min_lr} is not between 0 and --lr {lr}")
    if lr and not 0 <= init_lr <= lr:
        problems.add("--lr-warmup-init", f"{init_lr} is not between 0 and --lr {lr}")
    _decoupled(run, read, min_lr)
    schedule: Dict[str, Any] = {"decay": style, "min_lr_ratio": min_lr / lr if lr else 0.0,
                                "init_lr_ratio": init_lr / lr if lr else 0.0}
    per = 1
    if samples:
        gbs = a.get("train.global_batch_size") or 0
        per = gbs or 1
        # The decay spans the samples asked (not train_iter's whole batches), as Megatron's does.
        total = read.one("--train-samples", _int)
        decay = read.one("--lr-decay-samples", _int, total)
        schedule["decay_iters"] = decay / per if decay is not None else None
    else:
        schedule["decay_iters"] = read.one("--lr-decay-iters", _int)
    if "--lr-warmup-fraction" in given:
        schedule["warmup_fraction"] = read.one("--lr-warmup-fraction", _num)
    elif f"--lr-warmup-{unit}" in given:
        count = read.one(f"--lr-warmup-{unit}", _int)
        schedule["warmup_iters"] = count / per if count is not None else None
    decay, fraction = schedule["decay_iters"], schedule.get("warmup_fraction")
    if decay is not None and style != "constant":
        warmup = fraction * decay if fraction is not None else schedule.get("warmup_iters") or 0
        if decay <= warmup:
            problems.add(f"--lr-decay-{unit}", f"the decay must be longer than the warmup ({warmup:g} iterations)")
    run.scheduler = {k: v for k, v in schedule.items() if v is not None}
    a["train.warmup_ratio"] = 0.0


def _decoupled(run: MegatronRun, read: _Reader, min_lr: float) -> None:
    """--decoupled-lr / --decoupled-min-lr: the embedding and output layer's own peak and floor lr; the floor
    defaults to --min-lr, as in Megatron (optim.params.decoupled_min_lr=None would mean the schedule's ratio)."""
    peak, floor = read.one("--decoupled-lr", _num), read.one("--decoupled-min-lr", _num)
    if peak is None:
        if floor is not None:
            run.no_effect.append("--decoupled-min-lr (without --decoupled-lr, as in Megatron)")
        return
    floor = min_lr if floor is None else floor
    if not 0 <= floor <= peak:
        read.problems.add("--decoupled-min-lr", f"{floor} is not between 0 and --decoupled-lr {peak}")
    run.assignments["optim.params.decoupled_lr"] = peak
    run.assignments["optim.params.decoupled_min_lr"] = floor


def _precision_and_parallel(run: MegatronRun, read: _Reader) -> None:
    a, problems, given = run.assignments, read.problems, read.given
    if "--fp16" in given and "--bf16" in given:
        problems.add("--bf16", "excludes --fp16 (one mixed precision)")
    if "--fp16" in given and "train.amp.initial_scale" not in a:
        a["train.amp.initial_scale"] = 2.0 ** 32  # Megatron's --initial-loss-scale
    if "--loss-scale" in given:
        scale = read.one("--loss-scale", _num)
        if scale is not None:
            a["train.amp.initial_scale"] = scale
            run.no_effect.append("--loss-scale (the scale here is dynamic: it starts there)")
    clip = read.one("--clip-grad", _num)
    if clip is not None:
        a["optim.params.clip_grad_max_norm"] = clip if clip > 0 else None
    betas = [read.one("--adam-beta1", _num, 0.9), read.one("--adam-beta2", _num, 0.999)]
    if "--adam-beta1" in given or "--adam-beta2" in given:
        a["optim.betas"] = betas
    _fp8(run, read)
    if "--recompute-granularity" in given:
        mode = read.one("--recompute-granularity")
        if mode not in ("full", "selective"):
            problems.add(f"--recompute-granularity {mode}", "use full or selective")
        else:
            a.update({"train.activation_checkpoint.enabled": True, "train.activation_checkpoint.mode": mode})
    method = read.one("--recompute-method")
    layers = read.one("--recompute-num-layers", _int, 1)
    if method is None and "--recompute-num-layers" in given:
        run.no_effect.append("--recompute-num-layers (no effect without --recompute-method)")
    elif method is not None and (method != "uniform" or layers != 1):
        problems.add(f"--recompute-method {method}", "here each layer is recomputed on its own: --recompute-method "
                     "uniform --recompute-num-layers 1, or train.activation_checkpoint.every_n_layers in a config")
    if "--zero-stage" in given:
        stage = read.one("--zero-stage", _int, 0)
        a.update({"train.zero_optimization.enabled": stage > 0, "train.zero_optimization.stage": max(stage, 1)})
    if read.switch("--cpu-optimizer"):
        a["train.zero_optimization.offload"] = True
    if read.switch("--use-megatron-fsdp"):
        strategy = read.one("--data-parallel-sharding-strategy", default="optim_grads_params")
        if strategy not in _SHARDING:
            problems.add(f"--data-parallel-sharding-strategy {strategy}", f"use one of {', '.join(_SHARDING)}")
        else:
            stage = _SHARDING[strategy]
            a.update({"train.zero_optimization.enabled": stage > 0, "train.zero_optimization.stage": max(stage, 1)})
    elif "--data-parallel-sharding-strategy" in given:
        run.no_effect.append("--data-parallel-sharding-strategy (Megatron FSDP's: no effect without "
                             "--use-megatron-fsdp)")
    virtual = read.one("--virtual-pipeline-model-parallel-size", _int)
    if virtual is not None and virtual > 1:
        a.update({"train.dist.virtual_pipeline_size": virtual, "train.dist.pipeline_schedule": "interleaved_1f1b"})
    experts = read.one("--expert-model-parallel-size", _int)
    if experts is not None and experts != 1:
        problems.add("--expert-model-parallel-size", _MOE)
    minutes = read.one("--distributed-timeout-minutes", _num)
    if minutes is not None:
        a["train.dist.timeout"] = minutes * 60
    if read.switch("--calculate-per-token-loss"):
        if "--eod-mask-loss" in given:
            problems.add("--calculate-per-token-loss", "the loss here is each micro-batch's token mean, averaged: "
                         "with --eod-mask-loss micro-batches count different tokens and the two differ; drop one")
        else:
            run.no_effect.append("--calculate-per-token-loss (every micro-batch counts the same tokens without "
                                 "--eod-mask-loss, so the loss is the same per-token mean)")


def _fp8(run: MegatronRun, read: _Reader) -> None:
    """``--fp8-format``/``--fp8-recipe`` as torchao's float8 (``train.fp8``)."""
    a, problems = run.assignments, read.problems
    fmt, recipe = read.one("--fp8-format"), read.one("--fp8-recipe")
    if fmt is None:
        if recipe is not None:
            run.no_effect.append("--fp8-recipe (no effect without --fp8-format, as in Megatron-LM)")
        return
    if fmt not in ("hybrid", "e4m3"):
        problems.add(f"--fp8-format {fmt}", "use hybrid or e4m3")
        return
    if recipe not in (None, "delayed", "tensorwise"):
        problems.add(f"--fp8-recipe {recipe}", "torchao's float8 here scales per tensor or per row "
                     "(train.fp8.recipe tensorwise or rowwise), not per block")
        return
    if recipe in (None, "delayed"):
        run.no_effect.append("--fp8-recipe delayed (Megatron-LM's default: delayed scaling is not built; each "
                             "tensor is scaled from its current amax here)")
    a.update({"train.fp8.enabled": True, "train.fp8.recipe": "tensorwise" if fmt == "hybrid" else "rowwise"})
    if fmt == "e4m3":
        run.no_effect.append("--fp8-format e4m3 (torchao's all-e4m3 recipe is rowwise: a scale per row, "
                             "not per tensor)")


def _logging(run: MegatronRun, read: _Reader) -> None:
    """``--profile*`` as ``train.profile`` (Megatron's steps [start, end)); ``--wandb-*`` as ``train.wandb``."""
    a, given = run.assignments, read.given
    start = read.one("--profile-step-start", _int, 10)
    end = read.one("--profile-step-end", _int, 12)
    if read.switch("--profile"):
        if end <= start:
            read.problems.add("--profile-step-end", f"{end} must be after --profile-step-start {start}")
        else:
            a.update({"train.profile.enabled": True, "train.profile.wait": max(start - 1, 0),
                      "train.profile.warmup": 1 if start > 0 else 0, "train.profile.active": end - start,
                      "train.profile.repeat": 1})
        if read.switch("--record-memory-history"):
            a["train.profile.memory_snapshot"] = True
    else:
        for flag in ("--profile-step-start", "--profile-step-end", "--record-memory-history"):
            if flag in given:
                run.no_effect.append(f"{flag} (no effect without --profile)")
    project = read.one("--wandb-project")
    if project:
        a.update({"train.wandb.enabled": True, "train.wandb.project": project})
        run.no_effect.append("--wandb-project (the run is written offline under output_dir/wandb: wandb sync "
                             "uploads it; train.wandb.mode=online streams it)")
        name = read.one("--wandb-exp-name")
        if name:
            a["train.wandb.name"] = name
    elif "--wandb-exp-name" in given:
        run.no_effect.append("--wandb-exp-name (no effect without --wandb-project)")


_DS_BATCH = {"train.global_batch_size": "--global-batch-size", "train.train_micro_batch_size": "--micro-batch-size"}


def _deepspeed(run: MegatronRun, read: _Reader) -> None:
    """Megatron-DeepSpeed's ``--deepspeed_config FILE``: the engine does what the file says (precision, loss
    scale, ZeRO, clipping, batch, and its lr schedule over Megatron's), the optimizer is Megatron's (the
    client's, as DeepSpeed takes it), the log follows --log-interval."""
    flag = "--deepspeed_config" if "--deepspeed_config" in read.given else "--deepspeed-config"
    path = read.one(flag)
    if path is None:
        return
    try:
        ds = read_ds_config(path, engine_defaults=False)
    except UsageError as e:
        read.problems.add(f"{flag} {path}", str(e))
        return
    a, optimizer = run.assignments, False
    for key, value in ds.assignments.items():
        if key in _DS_BATCH and _DS_BATCH[key] in read.given and a.get(key) != value:
            read.problems.add(f"{flag} {path}", f"its {key} {value} differs from {_DS_BATCH[key]} {a.get(key)}; "
                              f"DeepSpeed needs them equal: fix one")
        elif key == "train.scheduler":
            run.scheduler = {k: v for k, v in value.items() if k != "_target_"}
        elif key.startswith("optim.") and not key.startswith("optim.params."):
            optimizer = True
        elif key == "train.log_period" and key in a:
            continue
        else:
            if key in a and a[key] != value:
                run.no_effect.append(f"the flags' {key}={a[key]} ({flag} {path} gives {value}: DeepSpeed's engine "
                                     f"does what its file says)")
            a[key] = value
    if optimizer:
        run.no_effect.append(f"{flag} optimizer (the optimizer is Megatron's, from --lr and --adam-*, as "
                             f"DeepSpeed takes the client's)")
    run.no_effect.extend(f"{flag} {note}" for note in ds.notes)


def _load(run: MegatronRun, read: _Reader, checkpoint_exists: Callable[[str], str]) -> None:
    a = run.assignments
    load = read.one("--load")
    if load is None:
        return
    kind = checkpoint_exists(load)
    if kind == "megatron":
        read.problems.add(f"--load {load}", f"a Megatron-LM checkpoint: convert it first with python "
                          f"tools/convert_checkpoint.py --from megatron --input {load} --output DIR, then --load DIR")
    elif load == a.get("train.output_dir"):
        run.resume = True
    elif kind == "ours":
        a["train.load_weight"] = load
        run.no_effect.append(f"--load {load} (another directory than --save: its weights only, as "
                             f"train.load_weight; resume a run in its own --save directory)")


def _render(value: Any, imports: Dict[str, str]) -> str:
    if isinstance(value, Call):
        module, name = value.target.split(":")
        imports[name] = module
        return f"LazyCall({name})({', '.join(f'{k}={v!r}' for k, v in value.kwargs.items())})"
    return repr(value)


def render_config(run: MegatronRun, flags: str) -> str:
    """A config file that runs ``run``: its model family's base config with the assignments applied."""
    if run.model is None:
        raise UsageError("no model family was chosen for these Megatron flags")
    imports: Dict[str, str] = {"MegatronLR": "libai_lite.scheduler"}
    body = [f"{key} = {_render(value, imports)}" for key, value in run.assignments.items()]
    if run.scheduler is not None:
        args = ", ".join(f"{k}={v!r}" for k, v in run.scheduler.items())
        body.append(f"train.scheduler = LazyCall(MegatronLR)({args})")
    lines = [f'"""Made by tools/from_megatron.py from the Megatron flags:', "", f"    {flags.strip()}", '"""',
             "from libai_lite.config import LazyCall"]
    lines += [f"from {module} import {name}" for name, module in sorted(imports.items())]
    lines += [f"from {run.model.config} import dataloader, model, optim, tokenization, train", ""]
    return "\n".join(lines + body) + "\n"
