"""Megatron-LM / Megatron-DeepSpeed / OneFlow-GPT ``pretrain_gpt.py`` command lines as this project's config.

:func:`translate_megatron_args` reads a flag string as ``pretrain_gpt.py`` does, Megatron-LM's defaults
for what is not given, and returns config assignments (``train.train_iter = 500``), the lr schedule
(``MegatronLR``: decay and warmup lengths of their own, in iterations), whether to resume, and the flags
that have no effect here (named, not dropped). The flags that shape the model (``--swiglu``,
``--normalization``, ``--position-embedding-type``, ``--disable-bias-linear``, ...) choose, among the
model families the caller passes (:class:`MegatronModel`, declared by the projects: the core names no
model), the one that builds that architecture, whose config the assignments apply to. Every flag that is
unknown or not taken here is reported together in one error, each with its reason. docs/migrating.md
says what maps.
"""
from __future__ import annotations

import difflib
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from ..utils.errors import UsageError

__all__ = ["MegatronModel", "MegatronRun", "translate_megatron_args", "render_config", "KNOWN_FLAGS"]


@dataclass(frozen=True)
class MegatronModel:
    """A model family a project offers to Megatron command lines.

    ``config``: the module of the base config the assignments apply to. ``builds``: Megatron's model
    arguments (``ARCHITECTURE``'s names) the family always has, as a value or a tuple of the values it can
    take. ``keys``: the arguments it takes from the flags, as a ``model.cfg`` key or a tuple of keys. An
    argument in neither must keep Megatron's default. ``STRUCTURE``'s arguments choose the family.
    """

    name: str
    config: str
    builds: Mapping[str, Any] = field(default_factory=dict)
    keys: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class MegatronRun:
    """What a Megatron command line asks for, in this project's terms."""

    assignments: Dict[str, Any] = field(default_factory=dict)
    scheduler: Optional[Dict[str, Any]] = None
    resume: bool = False
    no_effect: List[str] = field(default_factory=list)
    parallel_sizes: Dict[str, int] = field(default_factory=dict)
    model: Optional[MegatronModel] = None


@dataclass(frozen=True)
class Call:
    """A ``LazyCall`` an assignment holds: ``target`` as ``"module:name"`` and its arguments."""

    target: str
    kwargs: Mapping[str, Any]


# Megatron's model arguments -> the flag that sets each (for messages).
ARCHITECTURE = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads", "max_position_embeddings": "--max-position-embeddings",
    "hidden_dropout": "--hidden-dropout", "embedding_dropout": "--hidden-dropout",
    "attention_dropout": "--attention-dropout", "init_method_std": "--init-method-std",
    "layernorm_epsilon": "--norm-epsilon", "normalization": "--normalization",
    "position_embedding_type": "--position-embedding-type", "mlp": "--swiglu",
    "add_bias_linear": "--disable-bias-linear",
    "qkv_bias": "--add-qkv-bias", "share_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "num_query_groups": "--num-query-groups", "kv_channels": "--kv-channels", "rotary_base": "--rotary-base",
    "rotary_percent": "--rotary-percent", "rope_scaling": "--use-rope-scaling",
}
# The arguments that choose the model family.
STRUCTURE = ("normalization", "position_embedding_type", "mlp", "add_bias_linear")
# Megatron-LM's --use-rope-scaling constants as the rotary layers' "llama3" scaling kind (libai_lite/layers/rotary.py).
_ROPE_SCALING = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)


def _int(v: str) -> int:
    return int(float(v)) if "e" in v.lower() else int(v)


def _num(v: str) -> float:
    return float(v)


def _text(v: str) -> str:
    return v


# flag -> (config key, converter): the one-to-one flags outside the model.
_DIRECT: Dict[str, tuple] = {
    "--micro-batch-size": ("train.train_micro_batch_size", _int),
    "--global-batch-size": ("train.global_batch_size", _int),
    "--lr": ("optim.lr", _num),
    "--train-iters": ("train.train_iter", _int),
    "--weight-decay": ("optim.weight_decay", _num),
    "--adam-eps": ("optim.eps", _num),
    "--save": ("train.output_dir", _text),
    "--save-interval": ("train.checkpointer.period", _int),
    "--eval-interval": ("train.evaluation.eval_period", _int),
    "--tensor-model-parallel-size": ("train.dist.tensor_parallel_size", _int),
    "--pipeline-model-parallel-size": ("train.dist.pipeline_parallel_size", _int),
    "--context-parallel-size": ("train.dist.context_parallel_size", _int),
    "--log-interval": ("train.log_period", _int),
    "--seed": ("train.seed", _int),
    "--make-vocab-size-divisible-by": ("tokenization.make_vocab_size_divisible_by", _int),
    "--num-workers": ("dataloader.train.num_workers", _int),
    "--data-cache-path": ("dataloader.train.cache_dir", _text),
    "--initial-loss-scale": ("train.amp.initial_scale", _num),
    "--loss-scale-window": ("train.amp.growth_interval", _int),
}
# flag -> (model argument, converter).
_ARCH: Dict[str, tuple] = {
    "--num-layers": ("num_layers", _int),
    "--hidden-size": ("hidden_size", _int),
    "--ffn-hidden-size": ("ffn_hidden_size", _int),
    "--num-attention-heads": ("num_attention_heads", _int),
    "--max-position-embeddings": ("max_position_embeddings", _int),
    "--hidden-dropout": ("hidden_dropout", _num),
    "--attention-dropout": ("attention_dropout", _num),
    "--init-method-std": ("init_method_std", _num),
    "--layernorm-epsilon": ("layernorm_epsilon", _num),
    "--norm-epsilon": ("layernorm_epsilon", _num),
    "--normalization": ("normalization", _text),
    "--position-embedding-type": ("position_embedding_type", _text),
    "--num-query-groups": ("num_query_groups", _int),
    "--kv-channels": ("kv_channels", _int),
    "--rotary-base": ("rotary_base", _num),
    "--rotary-percent": ("rotary_percent", _num),
    "--rope-scaling-factor": ("rope_scaling_factor", _num),
}
# Switches (no value) -> config assignments.
_SWITCHES: Dict[str, Dict[str, Any]] = {
    "--fp16": {"train.amp.enabled": True, "train.amp.dtype": "fp16"},
    "--bf16": {"train.amp.enabled": True, "train.amp.dtype": "bf16"},
    "--checkpoint-activations": {"train.activation_checkpoint.enabled": True,
                                 "train.activation_checkpoint.mode": "full"},
    "--recompute-activations": {"train.activation_checkpoint.enabled": True,
                                "train.activation_checkpoint.mode": "selective"},
    "--sequence-parallel": {"train.dist.sequence_parallel": True},
    "--use-distributed-optimizer": {"train.zero_optimization.enabled": True, "train.zero_optimization.stage": 1},
    "--use-torch-fsdp2": {"train.zero_optimization.enabled": True, "train.zero_optimization.stage": 3},
    "--eod-mask-loss": {"dataloader.train.eod_mask_loss": True},
    "--reset-position-ids": {"dataloader.train.reset_position_ids": True},
    "--reset-attention-mask": {"dataloader.train.reset_attention_mask": True},
    "--async-save": {"train.checkpointer.async_save": True},
}
# Switches -> model arguments.
_ARCH_SWITCHES: Dict[str, Dict[str, Any]] = {
    "--swiglu": {"mlp": "swiglu"},
    "--openai-gelu": {"mlp": "gelu_tanh"},
    "--squared-relu": {"mlp": "squared_relu"},
    "--disable-bias-linear": {"add_bias_linear": False},
    "--add-qkv-bias": {"add_qkv_bias": True},
    "--untie-embeddings-and-output-weights": {"share_embeddings_and_output_weights": False},
    "--group-query-attention": {"group_query_attention": True},
    "--use-rotary-position-embeddings": {"position_embedding_type": "rope"},
    "--use-rope-scaling": {"use_rope_scaling": True},
    "--apply-layernorm-1p": {"layernorm_zero_centered_gamma": True},
}
_FUSION = "kernel fusion is torch.compile's here (train.compile)"
_OVERLAP = "communication and its overlap are FSDP2's and DTensor's here"
_LOGGED = "the log and metrics.json show loss, lr, samples/s, tokens/s, MFU and the gradient norm"
_STOP = "stop a run with a signal (SIGTERM): it saves a checkpoint first"
_DELAYED = "delayed scaling's setting: torchao scales each tensor from its current amax here"
# Flags accepted and named at start-up: kernels, overlap, backends and logging chosen otherwise here.
_NO_EFFECT: Dict[str, str] = {
    "--use-mcore-models": "one implementation of each model here",
    "--use-legacy-models": "one implementation of each model here",
    "--transformer-impl": "layers are PyTorch's here (SDPA/FlexAttention, torch.compile)",
    "--attention-backend": "attention is SDPA (flash where it can) or FlexAttention here",
    "--use-flash-attn": "SDPA picks flash attention where it can",
    "--overlap-grad-reduce": _OVERLAP,
    "--overlap-param-gather": _OVERLAP,
    "--overlap-param-gather-with-optimizer-step": _OVERLAP,
    "--tp-comm-overlap": _OVERLAP,
    "--use-nccl-ub": _OVERLAP,
    "--no-async-tensor-model-parallel-allreduce": "collectives are DTensor's",
    "--manual-gc": "Python's garbage collector runs as usual",
    "--manual-gc-interval": "Python's garbage collector runs as usual",
    "--empty-unused-memory-level": "PyTorch's caching allocator keeps its blocks",
    "--use-precision-aware-optimizer": "the optimizer is torch.optim's on the master weights",
    "--init-model-with-meta-device": "models are built on the meta device and materialised per rank here",
    "--cross-entropy-loss-fusion": "the LM head and loss are fused by model.cfg.fused_cross_entropy (on by default)",
    "--cross-entropy-fusion-impl": "the LM head and loss are fused by model.cfg.fused_cross_entropy (on by default)",
    "--grad-reduce-in-bf16": "gradients are reduced in the master weights' dtype",
    "--accumulate-allreduce-grads-in-fp32": "gradients are reduced in the master weights' dtype",
    "--distributed-backend": "torch.distributed picks nccl on GPUs, gloo on the CPU",
    "--DDP-impl": "data parallelism is FSDP2/DDP from train.dist and train.zero_optimization",
    "--no-masked-softmax-fusion": _FUSION,
    "--no-bias-gelu-fusion": _FUSION,
    "--no-bias-swiglu-fusion": _FUSION,
    "--no-bias-dropout-fusion": _FUSION,
    "--no-rope-fusion": _FUSION,
    "--no-persist-layer-norm": _FUSION,
    "--no-gradient-accumulation-fusion": _FUSION,
    "--apply-query-key-layer-scaling": "an fp16 overflow guard; softmax runs in fp32 here",
    "--no-query-key-layer-scaling": "an fp16 overflow guard; softmax runs in fp32 here",
    "--attention-softmax-in-fp32": "softmax runs in fp32 here",
    "--tensorboard-dir": "TensorBoard event files go to --save (train.output_dir)",
    "--tensorboard-log-interval": "TensorBoard events follow --log-interval",
    "--tensorboard-queue-size": "TensorBoard events are flushed every logged step",
    "--log-throughput": _LOGGED,
    "--log-params-norm": _LOGGED,
    "--log-num-zeros-in-grad": _LOGGED,
    "--log-timers-to-tensorboard": _LOGGED,
    "--log-validation-ppl-to-tensorboard": _LOGGED,
    "--log-memory-to-tensorboard": _LOGGED,
    "--log-world-size-to-tensorboard": _LOGGED,
    "--log-loss-scale-to-tensorboard": _LOGGED,
    "--timing-log-level": _LOGGED,
    "--logging-level": "the log is INFO on rank 0",
    "--exit-interval": _STOP,
    "--exit-duration-in-mins": _STOP,
    "--exit-signal-handler": _STOP,
    "--data-impl": "only Megatron's mmap format is read",
    "--mmap-bin-files": ".bin files are always memory-mapped here",
    "--no-mmap-bin-files": ".bin files are always memory-mapped here",
    "--num-dataset-builder-threads": "one process builds the dataset indices and caches them",
    "--no-create-attention-mask-in-dataloader": "causal masks are made inside attention here",
    "--vocab-size": "the vocabulary is the tokenizer's, padded by --make-vocab-size-divisible-by",
    "--tiktoken-pattern": "only Megatron-LM's TikTokenizer reads it",
    "--ckpt-format": "checkpoints are torch.distributed.checkpoint (DCP) directories here, any format asked",
    "--use-dist-ckpt": "checkpoints are torch.distributed.checkpoint (DCP) directories here",
    "--auto-detect-ckpt-format": "checkpoints are torch.distributed.checkpoint (DCP) directories here",
    "--ckpt-fully-parallel-save": "every rank writes its own shards here",
    "--ckpt-fully-parallel-load": "every rank reads its own shards here",
    "--deepspeed": "ZeRO is train.zero_optimization here",
    "--deepspeed_config": "ZeRO is train.zero_optimization here",
    "--deepspeed-activation-checkpointing": "activation checkpointing follows --checkpoint-activations",
    "--partition-activations": "checkpointed activations stay on their rank",
    "--checkpoint-num-layers": "train.activation_checkpoint.every_n_layers chooses the layers",
    "--no-pipeline-parallel": "pipeline parallelism is train.dist.pipeline_parallel_size",
    "--hysteresis": "the loss scale halves at the first overflow",
    "--use-checkpoint-lr-scheduler": "the schedule is this run's config; a resume keeps its position",
    "--use-checkpoint-opt_param-scheduler": "the schedule is this run's config; a resume keeps its position",
    "--override-opt_param-scheduler": "the schedule is this run's config; a resume keeps its position",
    "--override-lr-scheduler": "the schedule is this run's config; a resume keeps its position",
    "--no-check-for-nan-in-loss-and-grad": "a non-finite loss stops the run here (train.max_skipped_nonfinite)",
    "--check-for-nan-in-loss-and-grad": "a non-finite loss stops the run here (train.max_skipped_nonfinite)",
    "--fp8-amax-history-len": _DELAYED,
    "--fp8-amax-compute-algo": _DELAYED,
    "--fp8-margin": _DELAYED,
    "--fp8-interval": _DELAYED,
    "--fp8-param-gather": "under ZeRO-2/3 the tensorwise recipe all-gathers weights in float8 by itself",
    "--use-pytorch-profiler": "the trace is torch.profiler's either way (output_dir/profile/)",
    "--profile-ranks": "every rank writes its own trace",
    "--memory-snapshot-path": "memory snapshots go to output_dir/profile/",
    "--wandb-save-dir": "Weights & Biases writes under output_dir/wandb",
}
_MOE = "a mixture of experts: write a config with model.cfg.moe (README 'Mixture of experts')"
_DECOUPLED = ("the embedding and output layer cannot take an lr schedule of their own here (one schedule for "
              "every parameter): drop it")
_RAMPUP = "the global batch size is fixed for a run here: drop it (the run uses --global-batch-size from the start)"
_WEIGHTS_ONLY = ("a resume restores model, optimizer and data position together here; for the weights only, "
                 "--load a directory other than --save")
# Flags refused with the reason (and what to do instead).
_REFUSED: Dict[str, str] = {
    "--decoupled-lr": _DECOUPLED,
    "--decoupled-min-lr": _DECOUPLED,
    "--rampup-batch-size": _RAMPUP,
    "--step-batch-size-schedule": _RAMPUP,
    "--mock-data": "no synthetic data here: preprocess a corpus with tools/preprocess_data.py and pass --data-path",
    "--num-experts": _MOE,
    "--num-layers-per-virtual-pipeline-stage": "give --virtual-pipeline-model-parallel-size instead",
    "--no-position-embedding": "no project here builds a model without positions",
    "--no-load-optim": _WEIGHTS_ONLY,
    "--finetune": _WEIGHTS_ONLY,
    "--train-data-path": "one --data-path is split by --split here; write a config for data per split",
    "--valid-data-path": "one --data-path is split by --split here; write a config for data per split",
    "--test-data-path": "one --data-path is split by --split here; write a config for data per split",
}
# Flags with a rule of their own (handled in translate_megatron_args).
_RULES = ("--seq-length", "--lr-decay-style", "--min-lr", "--lr-decay-iters", "--lr-decay-samples",
          "--lr-warmup-fraction", "--lr-warmup-iters", "--lr-warmup-samples", "--lr-warmup-init", "--train-samples",
          "--load", "--data-path", "--split", "--adam-beta1", "--adam-beta2", "--clip-grad", "--loss-scale",
          "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--zero-stage",
          "--cpu-optimizer", "--eval-iters", "--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file",
          "--fp8-format", "--fp8-recipe", "--profile", "--profile-step-start", "--profile-step-end",
          "--record-memory-history", "--calculate-per-token-loss", "--distributed-timeout-minutes",
          "--virtual-pipeline-model-parallel-size", "--expert-model-parallel-size", "--use-megatron-fsdp",
          "--data-parallel-sharding-strategy", "--wandb-project", "--wandb-exp-name")
# Switches among the rules.
_RULE_SWITCHES = ("--cpu-optimizer", "--profile", "--record-memory-history", "--calculate-per-token-loss",
                  "--use-megatron-fsdp")
KNOWN_FLAGS = sorted(set(_DIRECT) | set(_ARCH) | set(_SWITCHES) | set(_ARCH_SWITCHES) | set(_NO_EFFECT)
                     | set(_RULES) | set(_REFUSED))
_DECAYS = ("cosine", "linear", "constant")
_TOKENIZERS = {
    "GPT2BPETokenizer": "libai_lite.tokenizer:GPT2Tokenizer",
    "HuggingFaceTokenizer": "libai_lite.tokenizer:HuggingFaceTokenizer",
    "SentencePieceTokenizer": "libai_lite.tokenizer:SentencePieceTokenizer",
    "BertWordPieceLowerCase": "libai_lite.tokenizer:BertTokenizer",
    "BertWordPieceCase": "libai_lite.tokenizer:BertTokenizer",
}
_SHARDING = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
# Megatron-LM's defaults for what the flags do not give (pretrain_gpt.py's arguments).
_DEFAULTS = {
    "optim.weight_decay": 0.01, "optim.betas": [0.9, 0.999], "optim.eps": 1e-8,
    "optim.params.clip_grad_max_norm": 1.0, "train.seed": 1234, "train.log_period": 100,
    "dataloader.train.num_workers": 2, "tokenization.make_vocab_size_divisible_by": 128,
    "dataloader.train.splits_string": "969,30,1", "train.evaluation.eval_iter": 100,
    "train.checkpointer.period": 0, "train.amp.enabled": False, "train.activation_checkpoint.enabled": False,
    "train.zero_optimization.enabled": False, "train.dist.tensor_parallel_size": 1,
    "train.dist.pipeline_parallel_size": 1, "train.dist.context_parallel_size": 1,
}


class _Problems(list):
    """The flags refused so far, as ``(flag, reason)``; reported together in one error, in command-line order
    (``position``: each flag's place on it; what is missing comes last)."""

    def __init__(self):
        super().__init__()
        self.position: Dict[str, int] = {}

    def add(self, flag: str, reason: str) -> None:
        self.append((flag, reason))

    def message(self) -> str:
        ordered = sorted(self, key=lambda p: self.position.get(p[0].split(" ")[0], len(self.position)))
        count = f"{len(self)} problems" if len(self) > 1 else "a problem"
        return f"{count} with the Megatron flags, each with its reason: " + "; ".join(
            f"{flag} ({reason})" for flag, reason in ordered)


def _unknown(name: str, problems: _Problems) -> None:
    if name.startswith("--moe-"):
        problems.add(name, _MOE)
        return
    near = difflib.get_close_matches(name, KNOWN_FLAGS, n=1, cutoff=0.85)
    problems.add(name, "not known here" + (f"; did you mean {near[0]}?" if near else ""))


def _parse(text: str, problems: _Problems) -> Dict[str, List[str]]:
    """flag -> its values (a repeated flag: the last, as argparse keeps); unknown flags go to ``problems``."""
    try:
        tokens = shlex.split(text.replace("\\\n", " "))
    except ValueError as e:
        raise UsageError(f"Megatron arguments cannot be split into words ({e}): check their quotes") from None
    given: Dict[str, List[str]] = {}
    current: Optional[List[str]] = None
    for token in tokens:
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            problems.position.setdefault(name, len(problems.position))
            if name not in KNOWN_FLAGS:
                _unknown(name, problems)
                current = []  # its values are skipped with it
                continue
            current = given[name] = [value] if eq else []
        elif current is None:
            problems.add(repr(token), "Megatron arguments must start with a --flag")
            current = []
        else:
            current.append(token)
    return given


class _Reader:
    """Values of the given flags, converted; a bad value is a problem, not an exception."""

    def __init__(self, given: Dict[str, List[str]], problems: _Problems):
        self.given, self.problems = given, problems

    def one(self, name: str, convert: Callable = _text, default: Any = None) -> Any:
        if name not in self.given:
            return default
        values = self.given[name]
        if len(values) != 1:
            self.problems.add(name, f"takes one value, got {len(values)}: {' '.join(values) or 'none'}")
            return default
        try:
            return convert(values[0])
        except ValueError:
            self.problems.add(name, f"{values[0]!r} is not a number")
            return default

    def switch(self, name: str) -> bool:
        if name not in self.given:
            return False
        if self.given[name]:
            self.problems.add(name, f"takes no value, got {' '.join(self.given[name])}")
        return True


def translate_megatron_args(text: str, models: Sequence[MegatronModel],
                            checkpoint_exists: Callable[[str], str] = lambda path: "") -> MegatronRun:
    """This project's run for the Megatron flags ``text``, on the family of ``models`` that builds its model.

    ``checkpoint_exists(path)`` names what ``--load path`` holds: ``"ours"``, ``"megatron"`` or ``""``
    (nothing there): a Megatron checkpoint is refused with the converting command. Every flag not taken
    is reported together in one ``UsageError``.
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
    _data(run, read)
    _schedule(run, read)
    _precision_and_parallel(run, read)
    _logging(run, read)
    _model(run, read, raw, models)
    _load(run, read, checkpoint_exists)
    for key, value in _DEFAULTS.items():
        a.setdefault(key, value)
    if problems:
        raise UsageError(problems.message())
    run.parallel_sizes = {flag: int(a[key]) for flag, key in (("tp", "train.dist.tensor_parallel_size"),
                                                              ("pp", "train.dist.pipeline_parallel_size"),
                                                              ("cp", "train.dist.context_parallel_size"))}
    return run


def _require(read: _Reader, *names: str) -> bool:
    """Whether one of ``names`` is given; else a problem, as pretrain_gpt.py refuses it too."""
    if any(n in read.given for n in names):
        return True
    read.problems.add(" or ".join(names), "missing: pretrain_gpt.py needs it too")
    return False


def _batch_and_length(run: MegatronRun, read: _Reader) -> None:
    a = run.assignments
    if _require(read, "--micro-batch-size") and "train.train_micro_batch_size" in a:
        a["train.test_micro_batch_size"] = a["train.train_micro_batch_size"]
    if "--global-batch-size" in read.given:
        a["train.num_accumulation_steps"] = None
    else:  # Megatron's global batch: micro x data-parallel size
        a.update({"train.global_batch_size": None, "train.num_accumulation_steps": 1})
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


def _data(run: MegatronRun, read: _Reader) -> None:
    a, problems = run.assignments, read.problems
    if _require(read, "--data-path"):
        paths = read.given["--data-path"]
        if len(paths) == 1:
            a["dataloader.train.data_prefix"] = paths[0]
        elif len(paths) % 2 == 0:
            try:
                a["dataloader.train.data_prefix"] = [_num(p) if i % 2 == 0 else p for i, p in enumerate(paths)]
            except ValueError:
                problems.add("--data-path", "several paths take a weight each: W1 PREFIX1 W2 PREFIX2 ...")
        else:
            problems.add("--data-path", "several paths take a weight each: W1 PREFIX1 W2 PREFIX2 ...")
    if "--split" in read.given:
        a["dataloader.train.splits_string"] = "".join(read.given["--split"]).strip("'\"").replace(" ", "")
    kind = read.one("--tokenizer-type")
    if kind is None and "--vocab-file" in read.given and "--merge-file" in read.given:
        kind = "GPT2BPETokenizer"
    if kind is None:
        _require(read, "--tokenizer-type")
        return
    if kind not in _TOKENIZERS:
        fix = ("no synthetic data here: preprocess a corpus with tools/preprocess_data.py and pass --data-path"
               if kind == "NullTokenizer" else
               f"not built here; the tokenizers taken are {', '.join(_TOKENIZERS)} (HuggingFaceTokenizer reads the "
               f"model's tokenizer.json from --tokenizer-model DIR)")
        problems.add(f"--tokenizer-type {kind}", fix)
        return
    if kind == "GPT2BPETokenizer":
        args = {"vocab_file": ("--vocab-file", "vocab_file"), "merges_file": ("--merge-file", "merges_file")}
    elif kind.startswith("Bert"):
        args = {"vocab_file": ("--vocab-file", "vocab_file")}
    elif kind == "HuggingFaceTokenizer":
        args = {"path": ("--tokenizer-model", "path")}
    else:
        args = {"model_file": ("--tokenizer-model", "model_file")}
    kwargs = {}
    for arg, (flag, _) in args.items():
        value = read.one(flag)
        if value is None:
            problems.add(flag, f"missing: --tokenizer-type {kind} reads it")
        kwargs[arg] = value
    if kind.startswith("Bert"):
        kwargs["do_lower_case"] = kind == "BertWordPieceLowerCase"
    a["tokenization.tokenizer"] = Call(_TOKENIZERS[kind], kwargs)


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


def _architecture(raw: Dict[str, Any], read: _Reader) -> tuple:
    """(Megatron's model arguments, their defaults): what pretrain_gpt.py builds from the flags."""
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads"):
        _require(read, flag)
    if "max_position_embeddings" not in raw:
        _require(read, "--max-position-embeddings", "--seq-length")
    hidden, heads = raw.get("hidden_size", 0), raw.get("num_attention_heads", 0)
    mlp = raw.get("mlp", "gelu")
    if mlp == "swiglu":
        ffn = int((4 * hidden * 2 / 3) / 64) * 64  # Megatron's size for two projections in
    else:
        ffn = 4 * hidden
    defaults = {
        "ffn_hidden_size": ffn, "hidden_dropout": 0.1, "attention_dropout": 0.1, "init_method_std": 0.02,
        "layernorm_epsilon": 1e-5, "normalization": "LayerNorm", "position_embedding_type": "learned_absolute",
        "mlp": "gelu", "add_bias_linear": True, "share_embeddings_and_output_weights": True,
        "num_query_groups": heads, "kv_channels": hidden // heads if heads else 0, "rotary_base": 10000.0,
        "rotary_percent": 1.0, "rope_scaling": None,
    }
    arch = {k: raw[k] for k in ARCHITECTURE if k in raw}
    for key, value in defaults.items():
        arch.setdefault(key, value)
    arch["embedding_dropout"] = arch["hidden_dropout"]  # Megatron drops out after the embeddings with it too
    defaults["embedding_dropout"] = defaults["hidden_dropout"]
    arch["qkv_bias"] = bool(arch["add_bias_linear"] or raw.get("add_qkv_bias", False))
    defaults["qkv_bias"] = defaults["add_bias_linear"]
    # Megatron takes --num-query-groups only with --group-query-attention.
    if raw.get("group_query_attention"):
        arch["num_query_groups"] = raw.get("num_query_groups", 1)
    else:
        arch["num_query_groups"] = heads
    if raw.get("use_rope_scaling"):
        arch["rope_scaling"] = dict(_ROPE_SCALING, factor=raw.get("rope_scaling_factor", 8.0))
    return arch, defaults


def _accepts(build: Any, value: Any) -> bool:
    return value in build if isinstance(build, tuple) else value == build


def _mismatches(model: MegatronModel, arch: Dict[str, Any]) -> List[str]:
    return [s for s in STRUCTURE if s not in model.builds or not _accepts(model.builds[s], arch[s])]


def _describe(values: Mapping[str, Any]) -> str:
    def one(s):
        v = values.get(s)
        if s == "add_bias_linear":
            return "linear biases" if v else "no linear biases"
        v = "/".join(map(str, v)) if isinstance(v, tuple) else v
        return {"position_embedding_type": f"{v} positions", "mlp": f"{v} MLP"}.get(s, str(v))
    return ", ".join(one(s) for s in STRUCTURE)


def _flag_for(s: str, build: Any) -> str:
    """The flags that ask for ``build`` of structure argument ``s``."""
    value = build[0] if isinstance(build, tuple) else build
    if s == "mlp":
        return "--swiglu" if value == "swiglu" else "no --swiglu/--squared-relu"
    if s == "add_bias_linear":
        return "no --disable-bias-linear" if value else "--disable-bias-linear"
    return f"{ARCHITECTURE[s]} {value}"


def _model(run: MegatronRun, read: _Reader, raw: Dict[str, Any], models: Sequence[MegatronModel]) -> None:
    """Choose the family that builds the model the flags describe and set its keys."""
    seq = read.one("--seq-length", _int)
    if seq is not None:
        raw.setdefault("max_position_embeddings", seq)
        if seq > raw["max_position_embeddings"]:
            read.problems.add("--seq-length", f"{seq} exceeds --max-position-embeddings "
                                              f"{raw['max_position_embeddings']}")
        elif seq != raw["max_position_embeddings"]:
            run.assignments["dataloader.train.seq_length"] = seq
    arch, defaults = _architecture(raw, read)
    if "num_query_groups" in raw and not raw.get("group_query_attention"):
        run.no_effect.append("--num-query-groups (no effect without --group-query-attention, as in Megatron-LM)")
    if raw.get("layernorm_zero_centered_gamma"):
        run.no_effect.append("--apply-layernorm-1p (norm weights are stored as g here, not g - 1: the same model "
                             "and the same updates, as norm weights take no weight decay)")
    fits = [m for m in models if not _mismatches(m, arch)]
    if not fits:
        offers = "; ".join(f"{m.name} builds {_describe(m.builds)} ("
                           f"{', '.join(_flag_for(s, m.builds.get(s)) for s in _mismatches(m, arch))})"
                           for m in sorted(models, key=lambda m: len(_mismatches(m, arch))))
        read.problems.add("the model", f"{_describe(arch)} is built by no project here: {offers or 'none offered'}")
        return
    model = run.model = fits[0]
    a = run.assignments
    for arg, value in arch.items():
        if arg in model.keys:
            keys = model.keys[arg]
            for key in (keys if isinstance(keys, tuple) else (keys,)):
                a[f"model.cfg.{key}"] = value
        if arg in model.builds and not _accepts(model.builds[arg], value):
            read.problems.add(ARCHITECTURE[arg], f"{value!r} for Megatron's {arg}: {model.name} builds "
                              f"{model.builds[arg]!r}")
        elif arg not in model.keys and arg not in model.builds and value != defaults.get(arg, value):
            read.problems.add(ARCHITECTURE[arg], f"{value!r}: {model.name} has no setting for it (it builds "
                              f"Megatron's default, {defaults[arg]!r})")


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
