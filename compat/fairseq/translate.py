"""fairseq-train command lines (the ``language_modeling`` task, ``transformer_lm`` models) as this project's
config.

:func:`translate_fairseq_args` reads a command line as fairseq-train does, with fairseq's defaults for what
is not given, and returns config assignments, the lr schedule (``compat.fairseq.schedule.FairseqLR``), the
data-bin it trains on, and the flags with no effect here, named. The model is ``projects/GPT``: fairseq's
``transformer_lm`` architectures are pre-LayerNorm (``base_lm_architecture`` forces it) with biases, a
final norm and, given ``--share-decoder-input-output-embed``, a tied head, as GPT here; what still differs
(sinusoidal positions, the sqrt(dim) embedding scale) is named in one start-up line.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from libai_lite.utils.errors import UsageError

from .data import check_data_bin
from .flags import ARCH, DIRECT, NO_EFFECT, REFUSED, Problems, Reader, _int, _num, _one_of_list, betas, parse
from .schedule import SCHEDULES

__all__ = ["FairseqRun", "translate_fairseq_args", "render_config", "ARCHS"]

# fairseq's transformer_lm architectures (fairseq/models/transformer_lm.py): layers, dim, ffn, heads, dropout,
# attention dropout, activation.
ARCHS: Dict[str, tuple] = {
    "transformer_lm": (6, 512, 2048, 8, 0.1, 0.0, "relu"),
    "transformer_lm_big": (12, 1024, 4096, 16, 0.1, 0.0, "relu"),
    "transformer_lm_gpt": (12, 768, 3072, 12, 0.1, 0.1, "gelu"),
    "transformer_lm_gpt2_tiny": (2, 64, 64, 1, 0.1, 0.1, "gelu"),
    "transformer_lm_gpt2_small": (24, 1024, 4096, 16, 0.1, 0.1, "gelu"),
    "transformer_lm_gpt2_medium": (36, 1280, 5120, 20, 0.1, 0.1, "gelu"),
    "transformer_lm_gpt2_big": (48, 1600, 6400, 25, 0.1, 0.1, "gelu"),
}
# fairseq's "gelu" is the exact (erf) one, "gelu_accurate" the tanh approximation.
_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_accurate": "gelu_tanh"}
_DDP = {"fully_sharded": 3, "c10d": 0, "pytorch_ddp": 0, "legacy_ddp": 0, "no_c10d": 0}
# fairseq's defaults for what the flags leave out (fairseq/dataclass/configs.py).
_DEFAULTS = {
    "train.seed": 1, "train.log_period": 100, "train.output_dir": "checkpoints", "train.checkpointer.period": 0,
    "train.checkpointer.max_to_keep": None, "dataloader.train.num_workers": 1, "optim.eps": 1e-8,
    "optim.betas": [0.9, 0.999], "optim.weight_decay": 0.0, "optim.params.weight_decay_norm": 0.0,
    "optim.params.weight_decay_bias": 0.0, "optim.params.clip_grad_max_norm": None, "train.amp.enabled": False,
    "train.zero_optimization.enabled": False, "train.activation_checkpoint.enabled": False,
}


@dataclass
class FairseqRun:
    """What a fairseq-train command line asks for, in this project's terms."""

    assignments: Dict[str, Any] = field(default_factory=dict)
    scheduler: Dict[str, Any] = field(default_factory=dict)
    data: Optional[str] = None
    no_effect: List[str] = field(default_factory=list)
    differs: List[str] = field(default_factory=list)


def translate_fairseq_args(text: str, world_size: int = 1) -> FairseqRun:
    """This project's run for the fairseq-train command line ``text`` (``world_size``: the processes it runs on,
    for fairseq's default loss-scale window). Every flag not taken is reported together in one ``UsageError``."""
    problems = Problems()
    positional, given = parse(text, problems)
    read = Reader(given, problems)
    run = FairseqRun()
    a = run.assignments
    for name in given:
        if name in REFUSED:
            problems.add(name, REFUSED[name])
        elif name in DIRECT:
            key, convert = DIRECT[name]
            value = read.one(name, convert)
            if value is not None:
                a[key] = value
        elif name in NO_EFFECT:
            run.no_effect.append(f"{name} ({NO_EFFECT[name]})")
    if len(positional) != 1:
        problems.add(" ".join(positional) or "DATA", "fairseq-train takes one data directory (fairseq-preprocess's "
                     "--destdir) before the flags" if positional else "missing: the data-bin directory")
    elif ":" in positional[0]:
        problems.add(positional[0], "fairseq's data shards (DIR1:DIR2, one an epoch) are not read here: train on one "
                     "data-bin (fairseq-preprocess the shards into one --destdir)")
    else:
        run.data = positional[0]
        problem = check_data_bin(run.data)
        if problem:
            problems.add(f"data-bin {run.data}", problem)
    _task(run, read)
    _optimizer(run, read)
    _schedule(run, read)
    _precision_and_parallel(run, read, world_size)
    _model(run, read)
    for key, value in _DEFAULTS.items():
        a.setdefault(key, value)
    if problems:
        raise UsageError(problems.message())
    return run


def _task(run: FairseqRun, read: Reader) -> None:
    a, problems = run.assignments, read.problems
    task = read.one("--task", default="translation")
    if task != "language_modeling":
        problems.add(f"--task {task}", "only language_modeling is built here (fairseq-train's default is "
                     "translation): give --task language_modeling")
    criterion = read.one("--criterion", default="cross_entropy")
    if criterion != "cross_entropy":
        problems.add(f"--criterion {criterion}", "the loss here is cross entropy: give --criterion cross_entropy")
    mode = read.one("--sample-break-mode", default="none")
    if mode != "none":
        problems.add(f"--sample-break-mode {mode}", "samples here are blocks of the concatenated documents, as "
                     "fairseq's none; for blocks that do not cross a document use none with "
                     "dataloader.train.reset_attention_mask=True")
    seq = read.one("--tokens-per-sample", _int, 1024)
    a["model.cfg.max_seq_length"] = seq
    micro = read.one("--batch-size", _int, read.one("--max-sentences", _int))
    tokens = read.one("--max-tokens", _int)
    if tokens is not None and seq:
        by_tokens = tokens // seq
        if by_tokens < 1:
            problems.add("--max-tokens", f"{tokens} holds no block of --tokens-per-sample {seq}")
        elif micro is None or by_tokens < micro:
            micro = by_tokens
        run.no_effect.append(f"--max-tokens ({tokens} tokens: {micro} blocks of {seq} per batch here)")
    if micro is None:
        problems.add("--batch-size or --max-tokens", "missing: fairseq-train needs one too")
    else:
        a["train.train_micro_batch_size"] = a["train.test_micro_batch_size"] = micro
    freq = read.one("--update-freq", _one_of_list, 1)
    a.update({"train.num_accumulation_steps": int(freq), "train.global_batch_size": None})
    if "--max-update" not in read.given:
        problems.add("--max-update", "missing: a run here is counted in updates (fairseq's default 0 runs until "
                     "--max-epoch)")
    keep = read.one("--keep-interval-updates", _int)
    if keep is not None:
        a["train.checkpointer.max_to_keep"] = keep if keep > 0 else None
    if read.one("--no-save"):
        a["train.checkpointer.period"] = 0
        run.no_effect.append("--no-save (no periodic checkpoints; the end of a run is still saved here)")
    # fairseq validates on the data-bin's valid split each epoch; the train split is read whole here.
    a.update({"dataloader.train.splits_string": "1,0,0", "train.evaluation.enabled": False,
              "train.warmup_ratio": 0.0, "tokenization.make_vocab_size_divisible_by": 8})


def _optimizer(run: FairseqRun, read: Reader) -> None:
    a, problems = run.assignments, read.problems
    optimizer = read.one("--optimizer")
    if optimizer is None:
        problems.add("--optimizer", "missing: fairseq-train needs it too; give --optimizer adam")
    elif optimizer != "adam":
        problems.add(f"--optimizer {optimizer}", "the optimizer here is AdamW, fairseq's adam (whose weight "
                     "decay is decoupled): give --optimizer adam")
    lr = read.one("--lr", _one_of_list, 0.25)
    a["optim.lr"] = lr
    if "--adam-betas" in read.given:
        pair = read.one("--adam-betas", betas)
        if pair is not None:
            a["optim.betas"] = pair
    wd = read.one("--weight-decay", _num, read.one("--wd", _num))
    if wd is not None:
        # fairseq's adam decays every parameter, biases and norms too.
        a.update({"optim.weight_decay": wd, "optim.params.weight_decay_norm": wd,
                  "optim.params.weight_decay_bias": wd})
    clip = read.one("--clip-norm", _num)
    if clip is not None:
        a["optim.params.clip_grad_max_norm"] = clip if clip > 0 else None


def _schedule(run: FairseqRun, read: Reader) -> None:
    a, problems = run.assignments, read.problems
    kind = read.one("--lr-scheduler", default="fixed")
    if kind not in SCHEDULES:
        problems.add(f"--lr-scheduler {kind}", f"not built here; use {', '.join(SCHEDULES)}")
        return
    lr = a.get("optim.lr") or 0.0
    iters = a.get("train.train_iter") or 0
    s = {"kind": kind, "lr": lr, "warmup_updates": read.one("--warmup-updates", _int,
                                                            4000 if kind == "inverse_sqrt" else 0)}
    options = {"polynomial_decay": ("--end-learning-rate", "--power", "--total-num-update"),
               "inverse_sqrt": ("--warmup-init-lr",), "cosine": ("--warmup-init-lr", "--min-lr",
                                                                 "--lr-period-updates"), "fixed": ()}[kind]
    for flag in ("--end-learning-rate", "--power", "--total-num-update", "--warmup-init-lr", "--min-lr",
                 "--lr-period-updates"):
        if flag in read.given and flag not in options:
            run.no_effect.append(f"{flag} (not read by --lr-scheduler {kind}, as in fairseq)")
        elif flag in read.given:
            s[flag[2:].replace("-", "_")] = read.one(flag, _num)
    w = s["warmup_updates"]
    if kind == "polynomial_decay":
        total = s.get("total_num_update", iters)
        s["total_num_update"] = total
        if total is not None and total <= w:
            problems.add("--total-num-update", f"{total:g} must be after --warmup-updates {w}")
        run.differs.append(f"--lr-scheduler polynomial_decay's first update trains at lr 0 here, at lr/"
                           f"--warmup-updates ({lr / w:g}) in fairseq; every later update at fairseq's lr"
                           if w > 0 else "")
    elif kind == "inverse_sqrt" and w <= 0:
        problems.add("--warmup-updates", "inverse_sqrt divides by it (fairseq fails on 0 too): give at least 1")
    elif kind == "cosine":
        period = s.get("lr_period_updates", -1)
        if period > 0 and w + period < iters:
            problems.add("--lr-period-updates", f"{period:g} restarts the cosine before --max-update {iters}; no "
                         f"restarts here: drop it (one period: --max-update minus --warmup-updates)")
    run.differs = [d for d in run.differs if d]
    run.scheduler = s


def _precision_and_parallel(run: FairseqRun, read: Reader, world_size: int) -> None:
    a, problems, given = run.assignments, read.problems, read.given
    half = [f for f in ("--fp16", "--memory-efficient-fp16") if f in given]
    brain = [f for f in ("--bf16", "--memory-efficient-bf16") if f in given]
    if half and brain:
        problems.add(brain[0], f"excludes {half[0]} (one mixed precision)")
    elif half:
        read.one(half[0])
        a.update({"train.amp.enabled": True, "train.amp.dtype": "fp16"})
        a.setdefault("train.amp.initial_scale", 128.0)  # fairseq's --fp16-init-scale
        # fairseq's default window: 2**14 updates over the world size and --update-freq.
        a.setdefault("train.amp.growth_interval",
                     max(int(2 ** 14 / max(world_size, 1) / a.get("train.num_accumulation_steps", 1)), 1))
    elif brain:
        read.one(brain[0])
        a.update({"train.amp.enabled": True, "train.amp.dtype": "bf16"})
    backend = read.one("--ddp-backend", default="pytorch_ddp")
    if backend not in _DDP:
        problems.add(f"--ddp-backend {backend}", f"use one of {', '.join(_DDP)} (fully_sharded: ZeRO-3; the others: "
                     f"DDP)")
    elif _DDP[backend]:
        a.update({"train.zero_optimization.enabled": True, "train.zero_optimization.stage": 3})
    elif backend != "pytorch_ddp":
        run.no_effect.append(f"--ddp-backend {backend} (data parallelism is PyTorch's DDP here)")
    if read.one("--checkpoint-activations"):
        a.update({"train.activation_checkpoint.enabled": True, "train.activation_checkpoint.mode": "full"})


def _model(run: FairseqRun, read: Reader) -> None:
    a, problems = run.assignments, read.problems
    arch = read.one("--arch")
    if arch is None:
        problems.add("--arch", "missing: fairseq-train needs it too; e.g. --arch transformer_lm_gpt")
        return
    if arch not in ARCHS:
        near = "transformer_lm_gpt" if arch.startswith(("gpt", "transformer_lm")) else "transformer_lm"
        problems.add(f"--arch {arch}", f"not built here; the architectures taken are {', '.join(ARCHS)} "
                     f"(nearest: {near})")
        return
    raw: Dict[str, Any] = {}
    for flag, (arg, convert) in ARCH.items():
        value = read.one(flag, convert)
        if value is not None:
            raw[arg] = value
    layers, dim, ffn, heads, dropout, attn, act = ARCHS[arch]
    dim = raw.get("decoder_embed_dim", dim)
    for arg in ("decoder_input_dim", "decoder_output_dim"):
        if raw.get(arg, dim) != dim:
            problems.add(f"--{arg.replace('_', '-')}", f"{raw[arg]}: projects/GPT's layers are all "
                         f"--decoder-embed-dim {dim} wide")
    act = raw.get("activation_fn", act)
    if act not in _ACTIVATIONS:
        problems.add(f"--activation-fn {act}", f"use one of {', '.join(_ACTIVATIONS)}")
    if raw.get("activation_dropout", 0.0):
        problems.add("--activation-dropout", "projects/GPT drops out nothing inside the MLP: give 0")
    seq = a.get("model.cfg.max_seq_length")
    positions = raw.get("max_target_positions", seq)
    if seq and positions < seq:
        problems.add("--max-target-positions", f"{positions} is under --tokens-per-sample {seq}")
    elif seq and positions > seq:
        run.no_effect.append(f"--max-target-positions (the position table is --tokens-per-sample {seq} long here)")
    if not read.one("--share-decoder-input-output-embed"):
        problems.add("--share-decoder-input-output-embed", "missing: " + _UNTIED_REASON)
    dropout = raw.get("dropout", dropout)
    a.update({"model.cfg.hidden_layers": raw.get("decoder_layers", layers), "model.cfg.hidden_size": dim,
              "model.cfg.ffn_hidden_size": raw.get("decoder_ffn_embed_dim", ffn),
              "model.cfg.num_attention_heads": raw.get("decoder_attention_heads", heads),
              "model.cfg.embedding_dropout_prob": dropout, "model.cfg.output_dropout_prob": dropout,
              "model.cfg.attention_dropout_prob": raw.get("attention_dropout", attn),
              "model.cfg.activation": _ACTIVATIONS.get(act, "gelu")})
    if read.one("--decoder-normalize-before"):
        run.no_effect.append("--decoder-normalize-before (transformer_lm is pre-LayerNorm in fairseq too)")
    if not read.one("--decoder-learned-pos"):
        run.differs.append("positions are learned here, sinusoidal in fairseq (--decoder-learned-pos matches)")
    if not read.one("--no-scale-embedding"):
        run.differs.append("token embeddings are not scaled by sqrt(--decoder-embed-dim) here, as fairseq does "
                           "(--no-scale-embedding matches)")
    run.differs.append("weights start from GPT-2's normal(0, 0.02) here, fairseq's Xavier-uniform linear layers "
                       "and normal(0, dim^-1/2) embeddings")


_UNTIED_REASON = ("projects/GPT ties the output layer to the input embedding, fairseq's transformer_lm leaves "
                  "them untied by default: add --share-decoder-input-output-embed")


def render_config(run: FairseqRun, flags: str, data_prefix: str) -> str:
    """A config file that runs ``run`` on ``data_prefix`` (the data-bin's train split, prepared) with projects/GPT."""
    body = [f"{key} = {value!r}" for key, value in run.assignments.items()]
    body.append(f"dataloader.train.data_prefix = {data_prefix!r}")
    body.append(f"tokenization.tokenizer = LazyCall(FairseqDictionary)(dict_file={run.data + '/dict.txt'!r})")
    args = ", ".join(f"{k}={v!r}" for k, v in run.scheduler.items())
    body.append(f"train.scheduler = LazyCall(FairseqLR)({args})")
    lines = ['"""Made by tools/from_fairseq.py from the fairseq-train command line:', "", f"    {flags.strip()}",
             '"""', "from libai_lite.config import LazyCall", "from compat.fairseq.data import FairseqDictionary",
             "from compat.fairseq.schedule import FairseqLR",
             "from projects.GPT.configs.gpt2_pretrain import dataloader, model, optim, tokenization, train", ""]
    return "\n".join(lines + body) + "\n"
