"""A run resolved once: ``resolve_run`` turns a loaded config and the world it runs on into a frozen ``RunSpec``.

Everything a run decides from its config before building anything is decided here, in one pass. The
trainers and the memory planner read the same ``RunSpec``; builders instantiate their config section and
read every setting from the spec. ``RunSpec.cfg`` is the resolved, read-only copy that ``config.yaml``
saves; the caller's config is left unchanged.
"""
from __future__ import annotations

import copy
import inspect
import logging
import math
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from .config.instantiate import instantiate, instantiate_target
from .config.validate import check_paths
from .data.build import cap_eval_iter
from .model import max_seq_length, stage_of_layer
from .converters.activation_checkpoint import check_ac_mode
from .converters.compile import CompileOptions, compile_options
from .converters.float8 import Float8Options, float8_options
from .run_sections import (PATHS, CheckpointSettings, EvalSettings, LogSettings, LossScale, OptimStep, ProfileSettings,
                           read_sections)
from .tokenizer import pad_vocab_size
from .utils.errors import UsageError
from .utils.parallel_dims import ParallelDims

logger = logging.getLogger("libai_lite")


AMP_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def amp_dtype(amp_cfg) -> torch.dtype | None:
    """The autocast dtype ``train.amp`` asks for, or None (fp32)."""
    if not amp_cfg.get("enabled", False):
        return None
    name = str(amp_cfg.get("dtype", "bf16"))
    if name not in AMP_DTYPES:
        raise UsageError(f"train.amp.dtype={name!r} is not supported; use 'bf16' or 'fp16'")
    return AMP_DTYPES[name]


def batch_sizes(train_cfg, dp_size: int) -> tuple[int, int, int]:
    """(micro, global, accumulation) from ``train``, global = micro x dp x accumulation, whichever one is left out
    (null) filled in; UsageError when the three given do not agree."""
    micro = train_cfg.get("train_micro_batch_size")
    global_batch = train_cfg.get("global_batch_size")
    acc = train_cfg.get("num_accumulation_steps")
    if micro is None and global_batch is None:
        raise UsageError("set train.train_micro_batch_size or train.global_batch_size")

    def divide_global(by: int, what: str) -> int:
        if global_batch % by:
            raise UsageError(f"train.global_batch_size={global_batch} is not divisible by {what}; pick sizes with "
                             f"global = micro x dp x accumulation")
        return global_batch // by

    if micro is None:
        acc = acc or 1
        micro = divide_global(dp_size * acc, f"data_parallel_size({dp_size}) x num_accumulation_steps({acc})")
    elif global_batch is None:
        acc = acc or 1
        global_batch = micro * dp_size * acc
    elif acc is None:
        acc = divide_global(micro * dp_size, f"train_micro_batch_size({micro}) x data_parallel_size({dp_size})")
    if micro * dp_size * acc != global_batch:
        raise UsageError(
            f"train.global_batch_size={global_batch} != train_micro_batch_size({micro}) x "
            f"data_parallel_size({dp_size}) x "
            f"num_accumulation_steps({acc}) = {micro * dp_size * acc}; set one of them to null to have it inferred"
        )
    if micro < 1 or acc < 1:
        raise UsageError(f"batch sizes must be positive (micro {micro}, accumulation {acc})")
    return int(micro), int(global_batch), int(acc)


@dataclass(frozen=True)
class BatchSizes:
    """global = micro x data-parallel size x accumulation, each filled in (``batch_sizes``)."""

    micro_batch_size: int
    global_batch_size: int
    num_accumulation_steps: int
    test_micro_batch_size: int


@dataclass(frozen=True)
class RunSpec:
    """What a config means for one world: resolved once by ``resolve_run``, read by every builder."""

    dims: ParallelDims
    batch: BatchSizes
    # The model's vocabulary rows (the tokenizer's, padded; or a checkpoint's), None: the config's own.
    vocab_size: int | None
    # Iterations to train (train.train_epoch counted in samples when it is set), of lr warmup
    # (train.warmup_ratio of them) and batches per evaluation.
    train_iter: int
    warmup_iter: int
    eval_iter: int
    # The pipeline stage of each layer (empty without a pipeline); train.dist.pipeline_num_layers as given.
    stage_of_layer: tuple[int, ...]
    pipeline_num_layers: int | None
    amp_dtype: torch.dtype | None
    loss_scale: LossScale | None  # fp16 only
    # FSDP's (ZeRO-2/3) mixed precision: parameters gathered in the amp dtype.
    param_dtype: torch.dtype | None
    float8: Float8Options | None
    compile: CompileOptions | None
    activation_checkpoint_every: int  # 0: off
    activation_checkpoint_mode: str
    optim: OptimStep
    checkpoint: CheckpointSettings
    evaluation: EvalSettings
    log: LogSettings
    profile: ProfileSettings | None
    cfg: DictConfig
    # cfg.model on the meta device if resolving built it, reused by the start-up checks.
    meta_model: torch.nn.Module | None = field(default=None, compare=False, repr=False)

    def describe(self, device=None) -> str:
        """The layout (on ``device`` when given) and the batch arithmetic, as the start-up line states them."""
        b, d = self.batch, self.dims
        cp = f" cp={d.context_parallel_size}" if d.context_parallel_size > 1 else ""
        where = f" on {device}" if device is not None else ""
        return (f"layout pp={d.pipeline_parallel_size} {d.describe_dp()}{cp} tp={d.tensor_parallel_size}"
                f"{where}; "
                f"global batch {b.global_batch_size} = micro {b.micro_batch_size} x dp {d.data_parallel_size} x "
                f"accumulation {b.num_accumulation_steps}")


def tokenizer_from_config(node):
    """``node.tokenizer`` (``node`` is a config's ``tokenization``) instantiated, or None when there is none
    (``tokenizer.build_tokenizer`` builds one from Megatron-LM's tokenizer names)."""
    if node is None or node.get("tokenizer") is None:
        return None
    return instantiate(node.tokenizer)


def resolve_run(cfg, dims: ParallelDims, tokenizer=None, *, vocab_rows: int | None = None, data: bool = True,
                eval_only: bool = False) -> RunSpec:
    """The ``RunSpec`` of ``cfg`` on the layout ``dims``; UsageError (one line) for what cannot run.

    The padded vocabulary of ``tokenizer`` sizes the model, unless a checkpoint's ``vocab_rows`` are given.
    With ``data`` the config's own loaders feed the run, so ``train.train_epoch`` is counted, ``eval_iter`` is
    capped to the valid split, and the splits and sequence length are checked. ``eval_only`` evaluates
    whatever ``train.evaluation.enabled`` says.
    """
    check_paths(cfg, PATHS)
    train = cfg.train
    ev = train.get("evaluation") or {}
    if data:
        _check_splits(cfg.dataloader.train, evaluates_valid=bool(ev.get("enabled", False)) and not eval_only)
    micro, global_batch, acc = batch_sizes(train, dims.data_parallel_size)
    batch = BatchSizes(micro, global_batch, acc, int(train.get("test_micro_batch_size") or micro))
    vocab = _vocab_size(cfg, tokenizer, vocab_rows)
    train_iter = int(train.get("train_iter") or 0)
    eval_iter = int(ev.get("eval_iter", 0) or 0)
    # The config's loaders feed evaluations: the valid split is read (and eval_period needed).
    evaluates = data and bool(ev.get("enabled", False) or eval_only)
    if data:
        train_iter = _iterations(cfg.dataloader.train, train, global_batch)
        if evaluates:
            eval_iter = cap_eval_iter(cfg.dataloader.train, eval_iter, batch.test_micro_batch_size *
                                      dims.data_parallel_size)
    amp = amp_dtype(train.amp)
    ac = train.get("activation_checkpoint") or {}
    compile = compile_options(train.get("compile"),
                              schedule=dims.pipeline_schedule if dims.pipeline_parallel_size > 1 else None)
    resolved = copy.deepcopy(cfg)
    with open_dict(resolved):
        if train.get("compile"):
            resolved.train.compile.enabled = compile.enabled
        # config.yaml records what ran: the sizes this world holds, not the ones asked for.
        resolved.train.dist.update(dims.sizes())
        resolved.train.train_micro_batch_size, resolved.train.global_batch_size = micro, global_batch
        resolved.train.num_accumulation_steps = acc
        resolved.train.train_iter = train_iter
        if evaluates:
            resolved.train.evaluation.eval_iter = eval_iter
        if vocab is not None:
            resolved.model.cfg.vocab_size = vocab
        model = _meta_model(resolved) if data or dims.pipeline_parallel_size > 1 else None
        if data:
            _check_sequence_length(resolved, model)
        stages = stage_of_layer(model, dims) if model is not None else ()
        if stages:
            # The assignment goes into config.yaml, so a run can be reproduced exactly.
            resolved.train.dist.stage_of_layer = list(stages)
    OmegaConf.set_readonly(resolved, True)
    sections = read_sections(cfg, trains=data and not eval_only, evaluates=evaluates, fp16=amp is torch.float16)
    return RunSpec(
        dims=dims, batch=batch, vocab_size=vocab, train_iter=train_iter,
        warmup_iter=int(train_iter * float(train.get("warmup_ratio") or 0)), eval_iter=eval_iter,
        stage_of_layer=stages, pipeline_num_layers=train.dist.get("pipeline_num_layers"), amp_dtype=amp,
        param_dtype=amp if dims.zero_stage >= 2 else None, float8=float8_options(train.get("fp8")), compile=compile,
        activation_checkpoint_every=int(ac.get("every_n_layers", 1) or 1) if ac.get("enabled", False) else 0,
        activation_checkpoint_mode=check_ac_mode(ac.get("mode", "full")), **sections, cfg=resolved,
        meta_model=model)


def _vocab_size(cfg, tokenizer, vocab_rows: int | None) -> int | None:
    """The model's vocabulary rows: a checkpoint's ``vocab_rows``, else the tokenizer's ids padded to
    ``tokenization.make_vocab_size_divisible_by`` (as Megatron-LM and LiBai size it), replacing
    ``model.cfg.vocab_size`` with one line where that differs. A ``model.cfg.vocab_size`` smaller than the
    tokenizer is refused: its ids would not fit the model."""
    vocab = given = None
    if tokenizer is not None:
        multiple = cfg.tokenization.get("make_vocab_size_divisible_by", 128)
        vocab = pad_vocab_size(tokenizer.vocab_size, multiple)
        given = (cfg.model.get("cfg") or {}).get("vocab_size")
        if not isinstance(given, int) or isinstance(given, bool):
            given = None
        if given is not None and given < tokenizer.vocab_size:
            raise UsageError(f"model.cfg.vocab_size={given} is smaller than the tokenizer's {tokenizer.vocab_size} "
                             f"ids, which would not fit the model's vocabulary; drop model.cfg.vocab_size={given} "
                             f"(the run sizes the vocabulary from the tokenizer: {vocab} rows) or set "
                             f"tokenization.tokenizer to one of at most {given} ids")
    if vocab_rows is not None and vocab_rows != vocab:
        logger.info(f"Model vocabulary set to the checkpoint's {vocab_rows} rows")
        return vocab_rows
    if given is not None and given != vocab:
        logger.info(f"model.cfg.vocab_size={given} replaced by {vocab}: the tokenizer's {tokenizer.vocab_size} ids "
                    f"padded to a multiple of tokenization.make_vocab_size_divisible_by={multiple}")
    return vocab


def _iterations(loader_cfg, train, global_batch: int) -> int:
    """``train.train_iter``, or the iterations ``train.train_epoch`` epochs take when that is more."""
    train_iter = int(train.get("train_iter") or 0)
    if train.get("train_epoch", 0):
        count = getattr(instantiate_target(loader_cfg), "samples_per_epoch", None)
        if not callable(count):
            raise UsageError(f"{loader_cfg._target_} cannot count an epoch (it has no samples_per_epoch); "
                             f"set train.train_iter instead of train.train_epoch")
        accepted = inspect.signature(count).parameters
        per_epoch = int(count(**{k: v for k, v in loader_cfg.items() if k in accepted}))
        train_iter = max(train_iter, math.ceil(train.train_epoch * per_epoch / global_batch))
        logger.info(f"train.train_epoch={train.train_epoch}: {per_epoch} samples per epoch, "
                    f"train.train_iter set to {train_iter}")
    if train_iter < 1:
        raise UsageError("set train.train_iter (or train.train_epoch) to a positive number of iterations")
    return train_iter


def _meta_model(cfg) -> torch.nn.Module:
    """``cfg.model`` on the meta device: what resolution asks the model (no memory, no init)."""
    with torch.device("meta"):
        return instantiate(cfg.model)


def _check_splits(loader_cfg, evaluates_valid: bool) -> None:
    """Splits that give no split a share (``0,0,0``) are refused as such, and so is a valid split given no share
    while training evaluates on it (``1,0,0``: it is never built, so no evaluation would run); other bad strings
    are the data builder's."""
    text = loader_cfg.get("splits_string")
    parts = text.replace("/", ",").split(",") if isinstance(text, str) else text
    try:
        shares = [float(str(p).strip()) for p in parts]
    except (TypeError, ValueError):
        return
    if shares and all(share == 0 for share in shares):
        raise UsageError(f"dataloader.train.splits_string={text!r} gives every split a share of 0, so there are no "
                         f"documents to train on; give the train split a positive share, e.g. '949,50,1'")
    if evaluates_valid and 1 <= len(shares) <= 3 and (shares + [0.0])[1] == 0:
        raise UsageError(f"dataloader.train.splits_string={text!r} gives the valid split a share of 0, so "
                         f"train.evaluation.enabled=True would never evaluate; give the valid split a share, e.g. "
                         f"'949,50,1', or set train.evaluation.enabled=False")


def _check_sequence_length(cfg, model: torch.nn.Module) -> None:
    """The data's samples (``dataloader.train.seq_length`` tokens) must fit the model's positions
    (``max_seq_length`` of the model protocol), or the first step would fail on them."""
    seq, longest = cfg.dataloader.train.get("seq_length"), max_seq_length(model)
    if longest is None or not isinstance(seq, int) or isinstance(seq, bool) or seq <= longest:
        return
    model_cfg = cfg.model.get("cfg") or {}
    key = "model.cfg.max_seq_length" if "max_seq_length" in model_cfg else f"{type(model).__name__}.max_seq_length"
    raise UsageError(f"dataloader.train.seq_length={seq} is longer than the {longest} positions the model takes "
                     f"({key}={longest}); set dataloader.train.seq_length to at most {longest}, or train a model with "
                     f"{key} >= {seq}")

