"""Megatron-LM ``pretrain_gpt.py`` flags (and OneFlow-GPT's ``oneflow_gpt.training``'s): what each means here,
and the reader of a command line.

OneFlow-GPT's and Megatron-DeepSpeed's names for Megatron's flags are read as those (``_ALIASES``). Each flag
is taken one to one (``_DIRECT``, ``_SWITCHES``; ``_ARCH``, ``_ARCH_SWITCHES`` for the model's arguments), by a
rule of its own (``_RULES``, in ``translate``), accepted with no effect (``_NO_EFFECT``, named at start-up) or refused with
what to do instead (``_REFUSED``). A problem found while reading is collected (``_Problems``), so every flag
not taken is reported together in one error.
"""
from __future__ import annotations

import difflib
import shlex
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional

from libai_lite.utils.errors import UsageError

__all__ = ["Call", "KNOWN_FLAGS"]


@dataclass(frozen=True)
class Call:
    """A ``LazyCall`` an assignment holds: ``target`` as ``"module:name"`` and its arguments."""

    target: str
    kwargs: Mapping[str, Any]


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
    "--tiktoken-pattern": "only Megatron-LM's TikTokenizer reads it",
    "--ckpt-format": "checkpoints are torch.distributed.checkpoint (DCP) directories here, any format asked",
    "--use-dist-ckpt": "checkpoints are torch.distributed.checkpoint (DCP) directories here",
    "--auto-detect-ckpt-format": "checkpoints are torch.distributed.checkpoint (DCP) directories here",
    "--ckpt-fully-parallel-save": "every rank writes its own shards here",
    "--ckpt-fully-parallel-load": "every rank reads its own shards here",
    "--deepspeed": "the --deepspeed_config file says what DeepSpeed does",
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
    # OneFlow-GPT's own flags.
    "--num-gpus-per-node": "the launcher takes it: NPROC of bash tools/train.sh FILE --megatron-args FLAGS NPROC",
    "--num-nodes": "the launcher takes it: NODE=n for bash tools/train.sh",
    "--node-ips": "the launcher takes it: ADDR (node 0's address) and NODE_RANK for bash tools/train.sh",
    "--ctrl-port": "the launcher takes it: PORT for bash tools/train.sh",
    "--use-rdma": "NCCL uses InfiniBand/RDMA by itself where the nodes have it",
    "--multihead-attention-fusion": "attention is fused by default here (SDPA)",
    "--no-scale-tril-softmax-dropout-fusion": _FUSION,
    "--log": "the log goes to --save (train.output_dir/log.txt)",
    "--metric-print-format": _LOGGED,
    "--profile-transformer-layer": "--profile traces whole steps with torch.profiler here",
    "--use-external-dataset": "the data are Megatron's .bin/.idx here either way",
    "--save-last": "the end of a run is always saved here (model_final)",
    # Megatron-DeepSpeed's ZeRO and activation-checkpointing tuning: torch's FSDP2 and checkpointing choose these.
    "--zero-reduce-scatter": "gradients are reduce-scattered under ZeRO-2/3 by FSDP2 itself",
    "--zero-contigious-gradients": "FSDP2 keeps each shard's gradients contiguous by itself",
    "--zero-reduce-bucket-size": "FSDP2 reduces a layer's gradients at once (no bucket size)",
    "--zero-allgather-bucket-size": "FSDP2 gathers a layer's parameters at once (no bucket size)",
    "--contigious-checkpointing": "checkpointed activations are not copied into one buffer here",
    "--checkpoint-in-cpu": "checkpointed activations stay on the device (train.zero_optimization.offload moves "
                           "optimizer state and, at stage 2/3, parameters)",
    "--synchronize-each-layer": "layers are not synchronized one by one here",
}
_MOE = "a mixture of experts: write a config with model.cfg.moe (README 'Mixture of experts')"
_RAMPUP = "the global batch size is fixed for a run here: drop it (the run uses --global-batch-size from the start)"
_WEIGHTS_ONLY = ("a resume restores model, optimizer and data position together here; for the weights only, "
                 "--load a directory other than --save")
# Flags refused with the reason (and what to do instead).
_REFUSED: Dict[str, str] = {
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
    "--save-init": "no checkpoint of the initial weights is written here: drop it",
}
# OneFlow-GPT's flag -> Megatron's flag of the same meaning (--max-seq-length: another name of OneFlow-GPT's
# --seq-length some of its command lines use).
_ALIASES: Dict[str, str] = {
    # OneFlow-GPT's names.
    "--learning-rate": "--lr", "--dataset": "--data-path", "--max-seq-length": "--seq-length",
    # Megatron-DeepSpeed's (Megatron-LM 1.x's): --batch-size was per GPU, --warmup a fraction of the iterations.
    "--model-parallel-size": "--tensor-model-parallel-size", "--batch-size": "--micro-batch-size",
    "--gas": "--num-accumulation-steps", "--warmup": "--lr-warmup-fraction",
}
# Flags with a rule of their own (handled in translate_megatron_args).
_RULES = ("--seq-length", "--lr-decay-style", "--min-lr", "--lr-decay-iters", "--lr-decay-samples",
          "--lr-warmup-fraction", "--lr-warmup-iters", "--lr-warmup-samples", "--lr-warmup-init", "--decoupled-lr",
          "--decoupled-min-lr", "--train-samples",
          "--load", "--data-path", "--split", "--adam-beta1", "--adam-beta2", "--clip-grad", "--loss-scale",
          "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--zero-stage",
          "--cpu-optimizer", "--eval-iters", "--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file",
          "--fp8-format", "--fp8-recipe", "--profile", "--profile-step-start", "--profile-step-end",
          "--record-memory-history", "--calculate-per-token-loss", "--distributed-timeout-minutes",
          "--virtual-pipeline-model-parallel-size", "--expert-model-parallel-size", "--use-megatron-fsdp",
          "--data-parallel-sharding-strategy", "--wandb-project", "--wandb-exp-name", "--optimizer",
          "--num-accumulation-steps", "--vocab-size", "--deepspeed_config", "--deepspeed-config")
# Switches among the rules.
_RULE_SWITCHES = ("--cpu-optimizer", "--profile", "--record-memory-history", "--calculate-per-token-loss",
                  "--use-megatron-fsdp")
KNOWN_FLAGS = sorted(set(_DIRECT) | set(_ARCH) | set(_SWITCHES) | set(_ARCH_SWITCHES) | set(_NO_EFFECT)
                     | set(_RULES) | set(_REFUSED) | set(_ALIASES))
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
    spelled: Dict[str, str] = {}  # flag -> how it was first written (itself or an alias)
    current: Optional[List[str]] = None
    for token in tokens:
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            problems.position.setdefault(name, len(problems.position))
            if name not in KNOWN_FLAGS:
                _unknown(name, problems)
                current = []  # its values are skipped with it
                continue
            canonical = _ALIASES.get(name, name)
            first = spelled.setdefault(canonical, name)
            if first != name:
                problems.add(name, f"means the same as {first}, given too: give one")
            problems.position.setdefault(canonical, problems.position[name])
            name = canonical
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


def _require(read: _Reader, *names: str) -> bool:
    """Whether one of ``names`` is given; else a problem, as pretrain_gpt.py refuses it too."""
    if any(n in read.given for n in names):
        return True
    read.problems.add(" or ".join(names), "missing: pretrain_gpt.py needs it too")
    return False

