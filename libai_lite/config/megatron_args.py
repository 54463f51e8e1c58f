"""Megatron-LM / Megatron-DeepSpeed / OneFlow-GPT ``pretrain_gpt.py`` command-line flags as this project's config.

:func:`translate_megatron_args` turns a flag string into config assignments (``model.cfg.hidden_layers =
24``), a learning-rate schedule, whether to resume, and the flags that have no effect here (named, not
silently dropped). An unknown flag is refused in one line with the nearest known one. Most flags map
one to one; the rules: ``--fp16``/``--bf16`` set ``train.amp``; ``--lr-decay-style`` and ``--min-lr``
pick ``WarmupDecayLR(decay, min_lr_ratio=min_lr/lr)`` (warmup from 0, as Megatron's); ``--save DIR`` is
``train.output_dir``; ``--load`` the same directory resumes (``--resume``), another of this project's
checkpoints gives ``train.load_weight``; ``--seq-length`` is the sample length and
``--max-position-embeddings`` the position table (``model.cfg.max_seq_length``). The caller names the
base config these assignments apply to (``tools/from_megatron.py``: the GPT project's).
"""
from __future__ import annotations

import difflib
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from ..utils.errors import UsageError

__all__ = ["MegatronRun", "translate_megatron_args", "render_config", "KNOWN_FLAGS"]


@dataclass
class MegatronRun:
    """What a Megatron command line asks for, in this project's terms."""

    assignments: Dict[str, Any] = field(default_factory=dict)
    scheduler: Optional[Dict[str, Any]] = None
    resume: bool = False
    no_effect: List[str] = field(default_factory=list)
    parallel_sizes: Dict[str, int] = field(default_factory=dict)


def _int(v: str) -> int:
    return int(float(v)) if "e" in v.lower() else int(v)


def _num(v: str) -> float:
    return float(v)


# flag -> (config key, converter): the one-to-one flags.
_DIRECT: Dict[str, tuple] = {
    "--num-layers": ("model.cfg.hidden_layers", _int),
    "--hidden-size": ("model.cfg.hidden_size", _int),
    "--ffn-hidden-size": ("model.cfg.ffn_hidden_size", _int),
    "--num-attention-heads": ("model.cfg.num_attention_heads", _int),
    "--max-position-embeddings": ("model.cfg.max_seq_length", _int),
    "--micro-batch-size": ("train.train_micro_batch_size", _int),
    "--global-batch-size": ("train.global_batch_size", _int),
    "--lr": ("optim.lr", _num),
    "--train-iters": ("train.train_iter", _int),
    "--weight-decay": ("optim.weight_decay", _num),
    "--clip-grad": ("optim.params.clip_grad_max_norm", _num),
    "--adam-eps": ("optim.eps", _num),
    "--split": ("dataloader.train.splits_string", str),
    "--vocab-file": ("tokenization.tokenizer.vocab_file", str),
    "--merge-file": ("tokenization.tokenizer.merges_file", str),
    "--save": ("train.output_dir", str),
    "--save-interval": ("train.checkpointer.period", _int),
    "--eval-interval": ("train.evaluation.eval_period", _int),
    "--eval-iters": ("train.evaluation.eval_iter", _int),
    "--tensor-model-parallel-size": ("train.dist.tensor_parallel_size", _int),
    "--pipeline-model-parallel-size": ("train.dist.pipeline_parallel_size", _int),
    "--log-interval": ("train.log_period", _int),
    "--seed": ("train.seed", _int),
    "--attention-dropout": ("model.cfg.attention_dropout_prob", _num),
    "--init-method-std": ("model.cfg.initializer_range", _num),
    "--layernorm-epsilon": ("model.cfg.layernorm_epsilon", _num),
    "--make-vocab-size-divisible-by": ("tokenization.make_vocab_size_divisible_by", _int),
    "--num-workers": ("dataloader.train.num_workers", _int),
    "--initial-loss-scale": ("train.amp.initial_scale", _num),
    "--loss-scale": ("train.amp.initial_scale", _num),
    "--loss-scale-window": ("train.amp.growth_interval", _int),
}
# Switches (no value) -> assignments.
_SWITCHES: Dict[str, Dict[str, Any]] = {
    "--fp16": {"train.amp.enabled": True, "train.amp.dtype": "fp16"},
    "--bf16": {"train.amp.enabled": True, "train.amp.dtype": "bf16"},
    "--checkpoint-activations": {"train.activation_checkpoint.enabled": True,
                                 "train.activation_checkpoint.mode": "full"},
    "--recompute-activations": {"train.activation_checkpoint.enabled": True,
                                "train.activation_checkpoint.mode": "selective"},
    "--sequence-parallel": {"train.dist.sequence_parallel": True},
    "--use-distributed-optimizer": {"train.zero_optimization.enabled": True, "train.zero_optimization.stage": 1},
    "--eod-mask-loss": {"dataloader.train.eod_mask_loss": True},
    "--reset-position-ids": {"dataloader.train.reset_position_ids": True},
    "--reset-attention-mask": {"dataloader.train.reset_attention_mask": True},
}
# Flags accepted and named at start-up: kernels, backends and logging chosen otherwise here.
_NO_EFFECT: Dict[str, str] = {
    "--distributed-backend": "torch.distributed picks nccl on GPUs, gloo on the CPU",
    "--DDP-impl": "data parallelism is FSDP2/DDP from train.dist and train.zero_optimization",
    "--no-masked-softmax-fusion": "attention is SDPA/FlexAttention",
    "--no-bias-gelu-fusion": "fusion is torch.compile's (train.compile)",
    "--no-bias-dropout-fusion": "fusion is torch.compile's (train.compile)",
    "--no-gradient-accumulation-fusion": "fusion is torch.compile's (train.compile)",
    "--use-flash-attn": "SDPA picks flash attention where it can",
    "--apply-query-key-layer-scaling": "an fp16 overflow guard; softmax runs in fp32 here",
    "--tensorboard-dir": "TensorBoard events go to train.output_dir",
    "--log-params-norm": "the log shows the gradient norm",
    "--log-num-zeros-in-grad": "not logged here",
    "--log-timers-to-tensorboard": "timings go to metrics.json",
    "--log-validation-ppl-to-tensorboard": "validation perplexity goes to metrics.json",
    "--exit-interval": "stop with a signal: the run saves a checkpoint first",
    "--data-impl": "only Megatron's mmap format is read",
    "--tokenizer-type": "GPT2BPETokenizer is the GPT project's tokenizer",
    "--deepspeed": "ZeRO is train.zero_optimization here",
    "--deepspeed_config": "ZeRO is train.zero_optimization here",
    "--deepspeed-activation-checkpointing": "activation checkpointing follows --checkpoint-activations",
    "--partition-activations": "checkpointed activations stay on their rank",
    "--checkpoint-num-layers": "train.activation_checkpoint.every_n_layers chooses the layers",
    "--no-pipeline-parallel": "pipeline parallelism is train.dist.pipeline_parallel_size",
    "--hysteresis": "the loss scale halves at the first overflow",
    "--attention-softmax-in-fp32": "softmax runs in fp32 here",
    "--no-query-key-layer-scaling": "an fp16 overflow guard; softmax runs in fp32 here",
    "--accumulate-allreduce-grads-in-fp32": "gradients are reduced in their own dtype (fp32 master weights)",
    "--use-checkpoint-lr-scheduler": "the schedule is this run's config; a resume keeps its position",
    "--override-opt_param-scheduler": "the schedule is this run's config; a resume keeps its position",
    "--override-lr-scheduler": "the schedule is this run's config; a resume keeps its position",
    "--no-async-tensor-model-parallel-allreduce": "collectives are DTensor's",
}
# Flags of other model families: refused with where they are built here.
_REFUSED: Dict[str, str] = {
    "--swiglu": "a Llama-style model: use projects/Llama's configs",
    "--use-rotary-position-embeddings": "a Llama-style model: use projects/Llama's configs",
    "--position-embedding-type": "a Llama-style model (rope): use projects/Llama's configs",
    "--normalization": "a Llama-style model (RMSNorm): use projects/Llama's configs",
    "--disable-bias-linear": "a Llama-style model: use projects/Llama's configs",
    "--group-query-attention": "a Llama-style model: use projects/Llama's configs",
    "--num-query-groups": "a Llama-style model: use projects/Llama's configs",
    "--untie-embeddings-and-output-weights": "the GPT project ties its LM head to the embedding",
    "--num-layers-per-virtual-pipeline-stage": "set train.dist.virtual_pipeline_size and pipeline_schedule instead",
    "--num-experts": "write a config with model.cfg.moe (README 'Mixture of experts')",
}
# Flags with a rule of their own (handled in translate_megatron_args).
_RULES = ("--seq-length", "--lr-decay-style", "--min-lr", "--lr-decay-iters", "--lr-warmup-fraction",
          "--lr-warmup-iters", "--load", "--data-path", "--adam-beta1", "--adam-beta2", "--hidden-dropout",
          "--recompute-granularity", "--zero-stage", "--cpu-optimizer")
KNOWN_FLAGS = sorted(set(_DIRECT) | set(_SWITCHES) | set(_NO_EFFECT) | set(_RULES) | set(_REFUSED))
_DECAY = {"cosine": "cosine", "linear": "linear", "constant": "constant", "inverse-square-root": None}


def _parse(text: str) -> List[tuple]:
    tokens = shlex.split(text.replace("\\\n", " "))
    flags: List[tuple] = []
    for token in tokens:
        if token.startswith("--"):
            name, _, value = token.partition("=")
            if name not in KNOWN_FLAGS:
                near = difflib.get_close_matches(name, KNOWN_FLAGS, n=1, cutoff=0.6)
                hint = f"; did you mean {near[0]}?" if near else "; docs/migrating.md lists the flags taken"
                raise UsageError(f"Megatron flag {name} is not known here{hint}")
            flags.append((name, [value] if value else []))
        elif not flags:
            raise UsageError(f"Megatron arguments must start with a --flag, got {token!r}")
        else:
            flags[-1][1].append(token)
    return flags


def _one(name: str, values: List[str], convert: Callable = str) -> Any:
    if len(values) != 1:
        raise UsageError(f"Megatron flag {name} takes one value, got {len(values)}: {' '.join(values) or 'none'}")
    try:
        return convert(values[0])
    except ValueError:
        raise UsageError(f"Megatron flag {name} {values[0]}: not a number") from None


def translate_megatron_args(text: str, checkpoint_exists: Callable[[str], str] = lambda path: "") -> MegatronRun:
    """This project's run for Megatron flags ``text``.

    ``checkpoint_exists(path)`` names what ``--load path`` holds: ``"ours"``, ``"megatron"`` or ``""``
    (nothing there): a Megatron checkpoint is refused with the converting command.
    """
    run = MegatronRun()
    given = dict(_parse(text))
    a = run.assignments
    for name, values in given.items():
        if name in _REFUSED:
            raise UsageError(f"Megatron flag {name} is not built from a command line here: {_REFUSED[name]}")
        if name in _DIRECT:
            key, convert = _DIRECT[name]
            a[key] = _one(name, values, convert)
        elif name in _SWITCHES:
            if values:
                raise UsageError(f"Megatron flag {name} takes no value, got {' '.join(values)}")
            a.update(_SWITCHES[name])
        elif name in _NO_EFFECT:
            run.no_effect.append(f"{name} ({_NO_EFFECT[name]})")
    if "--tokenizer-type" in given and given["--tokenizer-type"] != ["GPT2BPETokenizer"]:
        raise UsageError(f"--tokenizer-type {' '.join(given['--tokenizer-type'])}: Megatron command lines are taken "
                         f"for GPT-2 BPE here; write a config for other tokenizers (docs/migrating.md)")
    if "--hidden-size" in given and "--ffn-hidden-size" not in given:
        a["model.cfg.ffn_hidden_size"] = 4 * a["model.cfg.hidden_size"]  # Megatron's default
    if "--seq-length" in given:
        seq = _one("--seq-length", given["--seq-length"], _int)
        a.setdefault("model.cfg.max_seq_length", seq)
        if seq != a["model.cfg.max_seq_length"]:
            a["dataloader.train.seq_length"] = seq
    if "--global-batch-size" in given:
        a["train.num_accumulation_steps"] = None
    if "--hidden-dropout" in given:
        p = _one("--hidden-dropout", given["--hidden-dropout"], _num)
        a["model.cfg.output_dropout_prob"] = a["model.cfg.embedding_dropout_prob"] = p
    betas = [_one(f, given[f], _num) if f in given else d for f, d in (("--adam-beta1", 0.9), ("--adam-beta2", 0.999))]
    if "--adam-beta1" in given or "--adam-beta2" in given:
        a["optim.betas"] = betas
    if "--recompute-granularity" in given:
        mode = _one("--recompute-granularity", given["--recompute-granularity"])
        if mode not in ("full", "selective"):
            raise UsageError(f"--recompute-granularity {mode}: use full or selective")
        a.update({"train.activation_checkpoint.enabled": True, "train.activation_checkpoint.mode": mode})
    if "--zero-stage" in given:
        stage = _one("--zero-stage", given["--zero-stage"], _int)
        a.update({"train.zero_optimization.enabled": stage > 0, "train.zero_optimization.stage": max(stage, 1)})
    if "--cpu-optimizer" in given:
        a["train.zero_optimization.offload"] = True
    if "--data-path" in given:
        paths = given["--data-path"]
        a["dataloader.train.data_prefix"] = paths[0] if len(paths) == 1 else [
            _num(p) if i % 2 == 0 else p for i, p in enumerate(paths)]
    _schedule(run, given)
    if "--load" in given:
        load = _one("--load", given["--load"])
        kind = checkpoint_exists(load)
        if kind == "megatron":
            raise UsageError(f"--load {load} is a Megatron-LM checkpoint: convert it first with python "
                             f"tools/convert_checkpoint.py --from megatron --input {load} --output DIR, "
                             f"then --load DIR")
        if load == a.get("train.output_dir"):
            run.resume = True
        elif kind == "ours":
            a["train.load_weight"] = load
            run.no_effect.append(f"--load {load} (another directory than --save: its weights only, as "
                                 f"train.load_weight; resume a run in its own --save directory)")
    for key, flag in (("train.dist.tensor_parallel_size", "tp"), ("train.dist.pipeline_parallel_size", "pp")):
        run.parallel_sizes[flag] = int(a.get(key, 1))
    return run


def _schedule(run: MegatronRun, given: dict) -> None:
    a = run.assignments
    if not any(f in given for f in ("--lr-decay-style", "--min-lr", "--lr-warmup-fraction", "--lr-warmup-iters",
                                    "--lr-decay-iters")):
        return
    style = _one("--lr-decay-style", given.get("--lr-decay-style", ["linear"]))
    if _DECAY.get(style) is None:
        raise UsageError(f"--lr-decay-style {style}: use cosine, linear or constant here")
    if "--lr-decay-iters" in given:
        decay = _one("--lr-decay-iters", given["--lr-decay-iters"], _int)
        if decay != a.get("train.train_iter", decay):
            raise UsageError(f"--lr-decay-iters {decay} differs from --train-iters {a['train.train_iter']}: the lr "
                             f"schedule here decays over the whole run; drop --lr-decay-iters or make them equal")
    lr = float(a.get("optim.lr", 0) or 0)
    min_lr = _one("--min-lr", given["--min-lr"], _num) if "--min-lr" in given else 0.0
    if min_lr and not lr:
        raise UsageError("--min-lr needs --lr (the floor is a fraction of it here)")
    run.scheduler = {"decay": style, "min_lr_ratio": min_lr / lr if lr else 0.0, "warmup_factor": 0.0,
                     "warmup_method": "linear"}
    if "--lr-warmup-fraction" in given:
        a["train.warmup_ratio"] = _one("--lr-warmup-fraction", given["--lr-warmup-fraction"], _num)
    elif "--lr-warmup-iters" in given:
        iters = _one("--lr-warmup-iters", given["--lr-warmup-iters"], _int)
        if "train.train_iter" not in a:
            raise UsageError("--lr-warmup-iters needs --train-iters (warmup is a fraction of the run here)")
        a["train.warmup_ratio"] = iters / a["train.train_iter"]
    else:
        a["train.warmup_ratio"] = 0.0


def render_config(run: MegatronRun, base_module: str, flags: str) -> str:
    """A config file that runs ``run``: the base config's sections with the assignments applied."""
    lines = [f'"""Made by tools/from_megatron.py from the Megatron flags:', "", f"    {flags.strip()}", '"""',
             "from libai_lite.config import LazyCall",
             "from libai_lite.scheduler.lr_scheduler import WarmupDecayLR",
             f"from {base_module} import dataloader, model, optim, tokenization, train", ""]
    for key, value in run.assignments.items():
        lines.append(f"{key} = {value!r}")
    if run.scheduler is not None:
        args = ", ".join(f"{k}={v!r}" for k, v in run.scheduler.items())
        lines.append(f"train.scheduler = LazyCall(WarmupDecayLR)({args})")
    return "\n".join(lines) + "\n"
