"""`default_setup` and `DefaultTrainer`: from a resolved config to a running training job."""
from __future__ import annotations

import inspect
import logging
import math
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf, open_dict

from ..checkpoint import Checkpointer, resolve_resume
from ..config import LazyConfig, instantiate, try_get_key
from ..evaluation import inference_on_dataset, inference_on_pipeline
from ..tokenizer import pad_vocab_size
from ..utils.distributed import get_dist, setup_dist
from ..utils.errors import UsageError
from ..utils.flops import device_peak_flops
from ..utils.logger import attach_log_file, setup_logger
from . import hooks
from .trainer import EagerTrainer, PipelineTrainer

logger = logging.getLogger("libai_lite")

_AMP_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def instantiate_with(node, **kwargs):
    """Instantiate a LazyCall node with some arguments supplied at run time (objects a config can't hold).

    The node stays attached to its config, so `${...}` interpolations still resolve.
    """
    # Run-time arguments may replace nested LazyCalls (optim.params), which must not be built
    # here; they are taken out for the call and put back so the saved config is unchanged.
    stashed = {k: node[k] for k in kwargs if k in node}
    with open_dict(node):
        for key in stashed:
            del node[key]
        node._partial_ = True
    try:
        fn = instantiate(node)
    finally:
        with open_dict(node):
            del node["_partial_"]
            for key, value in stashed.items():
                node[key] = value
    return fn(**kwargs)


def instantiate_target(node):
    """The class or function a LazyCall node would call, without calling it."""
    from ..config import locate

    target = node._target_
    return locate(target) if isinstance(target, str) else target


def resolve_batch_sizes(train_cfg, dp_size: int) -> None:
    """Make global = micro x dp x accumulation hold, filling in whichever one is left out."""
    micro = train_cfg.get("train_micro_batch_size")
    glob = train_cfg.get("global_batch_size")
    acc = train_cfg.get("num_accumulation_steps")
    if micro is None and glob is None:
        raise UsageError("set train.train_micro_batch_size or train.global_batch_size")
    if micro is None:
        acc = acc or 1
        if glob % (dp_size * acc):
            raise UsageError(
                f"train.global_batch_size={glob} is not divisible by data_parallel_size({dp_size}) x "
                f"num_accumulation_steps({acc}); pick sizes with global = micro x dp x accumulation"
            )
        micro = glob // (dp_size * acc)
    elif glob is None:
        acc = acc or 1
        glob = micro * dp_size * acc
    elif acc is None:
        if glob % (micro * dp_size):
            raise UsageError(
                f"train.global_batch_size={glob} is not divisible by train_micro_batch_size({micro}) x "
                f"data_parallel_size({dp_size}); pick sizes with global = micro x dp x accumulation"
            )
        acc = glob // (micro * dp_size)
    if micro * dp_size * acc != glob:
        raise UsageError(
            f"train.global_batch_size={glob} != train_micro_batch_size({micro}) x data_parallel_size({dp_size}) x "
            f"num_accumulation_steps({acc}) = {micro * dp_size * acc}; set one of them to null to have it inferred"
        )
    if micro < 1 or acc < 1:
        raise UsageError(f"batch sizes must be positive (micro {micro}, accumulation {acc})")
    train_cfg.train_micro_batch_size = int(micro)
    train_cfg.global_batch_size = int(glob)
    train_cfg.num_accumulation_steps = int(acc)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def model_pipeline_layers(cfg) -> int | None:
    """Layers a pipeline places for `cfg.model`: hidden_layers, or both stacks of a T5 (None if unknown)."""
    num_layers = try_get_key(cfg, "model.cfg.hidden_layers", default=None)
    # Encoder-decoder models pipeline both stacks: their layer_idx runs over 2 x hidden_layers.
    if num_layers is not None and try_get_key(cfg, "model.cfg.model_type", default=None) in ("t5", "mt5"):
        return 2 * int(num_layers)
    return None if num_layers is None else int(num_layers)


def default_setup(cfg, args) -> None:
    """Mesh, seeds, logger and batch sizes for a run; nothing is written to disk yet.

    `DefaultTrainer` creates the output directory (and writes `config.yaml`) only once every
    input has been checked, so a run refused for bad input leaves no trace.
    """
    if getattr(args, "fast_dev_run", False):
        cfg.train.train_epoch = 0
        cfg.train.train_iter = 20
        cfg.train.log_period = 1
        cfg.train.evaluation.eval_period = 10
        cfg.train.evaluation.eval_iter = 2
        cfg.train.checkpointer.period = 10
    num_layers = model_pipeline_layers(cfg)
    with open_dict(cfg):
        if cfg.train.dist.get("pipeline_num_layers") is None and num_layers is not None:
            cfg.train.dist.pipeline_num_layers = int(num_layers)
    ctx = setup_dist(cfg.train.dist, cfg.train.dist.get("pipeline_num_layers"))
    with open_dict(cfg):
        cfg.train.dist.data_parallel_size = ctx.data_parallel_size
    setup_logger(ctx.rank)
    resolve_batch_sizes(cfg.train, ctx.data_parallel_size)
    # Every rank seeds alike so model init is identical; data order comes from the sampler.
    _seed_all(int(cfg.train.seed))
    logger.info(f"Rank {ctx.rank} of {ctx.world_size}; layout pp={ctx.pipeline_parallel_size} "
                f"dp={ctx.data_parallel_size} tp={ctx.tensor_parallel_size} on {ctx.device}")
    logger.info(f"Command line: {' '.join(sys.argv)}")
    logger.info(f"torch {torch.__version__}, {torch.get_num_threads()} threads")


class SyncedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose "found inf" flags are summed over a process group.

    torch's own ``ShardedGradScaler`` does the same but keeps the flag as a ``[1]`` tensor, which
    the fused AdamW kernel (our default optimizer) refuses ("output with shape [] doesn't match
    the broadcast shape [1]"); this keeps GradScaler's ``[]`` flags and reduces them in place.
    """

    def __init__(self, device: str, process_group=None, **kwargs):
        super().__init__(device, **kwargs)
        self.process_group = process_group

    def _sync(self, found_inf_per_device: dict) -> dict:
        for found_inf in found_inf_per_device.values():
            dist.all_reduce(found_inf, group=self.process_group)
        return found_inf_per_device

    def unscale_(self, optimizer) -> None:
        """Unscale this rank's gradients, then agree with every rank on whether any overflowed."""
        super().unscale_(optimizer)
        if self._enabled:
            self._sync(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"])

    def _check_inf_per_device(self, optimizer):
        # step() without unscale_() (fused optimizers) checks through here.
        return self._sync(super()._check_inf_per_device(optimizer))


def build_loss_scaler(device: torch.device, initial_scale: float, growth_interval: int):
    """fp16 dynamic loss scaling whose overflow check agrees on every rank.

    ``torch.amp.GradScaler`` decides from the gradients a rank holds. Ranks hold different
    gradients under ZeRO-2/3, tensor parallelism and expert parallelism (an expert lives on one
    rank), so one rank could skip a step another takes, and the replicas would drift apart for
    good. In a multi-process job the "found inf" flag is therefore summed over all ranks before
    the step (``SyncedGradScaler``, one scalar all-reduce per step).
    """
    kwargs = dict(init_scale=initial_scale, growth_interval=growth_interval)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return SyncedGradScaler(device.type, process_group=dist.group.WORLD, **kwargs)
    return torch.amp.GradScaler(device.type, **kwargs)


class DefaultTrainer:
    """Builds tokenizer, data, model, optimizer, scheduler and hooks from `cfg`, then trains.

    Subclass and override a `build_*` method to change one piece, LiBai style.
    """

    def __init__(self, cfg, resume: bool = False, eval_only: bool = False):
        self.cfg = cfg
        self.eval_only = eval_only
        ctx = get_dist()
        self.ctx = ctx
        self.output_dir = cfg.train.output_dir
        self.tokenizer = self.build_tokenizer(cfg)
        self.check_layout(cfg)
        self.resume_path = resolve_resume(self.output_dir) if resume else None
        if resume and self.resume_path is None:
            logger.warning(f"--resume given but {self.output_dir} has no last_checkpoint: starting from scratch")
        self.precheck_output_dir(self.output_dir)
        self.precheck_checkpoint(cfg, self.resume_path or cfg.train.get("load_weight"))
        trainer_state = self._peek_trainer_state(self.resume_path)
        self.consumed_samples = int(trainer_state.get("consumed_samples", 0))
        start_iter = int(trainer_state.get("iteration", -1)) + 1
        self.train_loader, self.valid_loader, self.test_loader = self.build_loaders(cfg)
        self.model = self.build_model(cfg)
        self.optimizer = self.build_optimizer(cfg, self.model)
        self.scheduler = self.build_lr_scheduler(cfg, self.optimizer)
        self.grad_scaler = self.build_grad_scaler(cfg)
        from ..parallel.pipeline import pipeline_module, pipeline_spec, tied_checkpoint_aliases

        self.checkpointer = Checkpointer(
            self.model_parts, self.optimizer, self.output_dir, max_to_keep=cfg.train.checkpointer.get("max_to_keep"),
            aliases=tied_checkpoint_aliases(self.model_parts[0], pipeline_spec(pipeline_module(self.raw_model)))
            if self.stepper is not None else None,
        )
        if self.resume_path is not None:
            self.checkpointer.load(self.resume_path)
            self._restore_trainer_state(trainer_state)
            logger.info(f"Resumed from {self.resume_path} at iteration {start_iter}, "
                        f"{self.consumed_samples} samples consumed")
        elif cfg.train.get("load_weight"):
            self.checkpointer.load(cfg.train.load_weight, weights_only=True)
            logger.info(f"Loaded weights from {cfg.train.load_weight}")
        elif eval_only:
            raise UsageError("--eval-only needs weights: set train.load_weight=CHECKPOINT_DIR or add --resume")
        self.start_iter = start_iter
        self._setup_output()
        self.trainer = self.build_trainer()
        self.trainer.register_hooks(self.build_hooks())

    # ------------------------------------------------------------ building
    @staticmethod
    def precheck_output_dir(output_dir: str) -> None:
        """Refuse an output directory that cannot be created or written, before anything is written anywhere."""
        path = os.path.abspath(output_dir)
        while not os.path.exists(path):
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
        if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
            what = "is a file" if os.path.exists(path) and not os.path.isdir(path) else "is not writable"
            raise UsageError(f"train.output_dir={output_dir} is not writable ({path} {what}); choose another directory")

    def precheck_checkpoint(self, cfg, path) -> None:
        """Refuse an unreadable checkpoint, or one of another model shape, before data or weights are touched.

        The model is built on the meta device (no memory, no init), so a wrong ``--resume`` or
        ``train.load_weight`` costs a second, and nothing (index caches, output dir) is written.
        """
        if not path:
            return
        from ..checkpoint.checkpointer import check_checkpoint_shapes

        with torch.device("meta"):
            model = instantiate(cfg.model)
        check_checkpoint_shapes(path, model.state_dict())

    def build_tokenizer(self, cfg):
        """Instantiate the tokenizer and set `model.cfg.vocab_size` to its padded size."""
        tok_cfg = cfg.get("tokenization")
        if tok_cfg is None or tok_cfg.get("tokenizer") is None:
            return None
        tokenizer = instantiate(tok_cfg.tokenizer)
        padded = pad_vocab_size(
            tokenizer.vocab_size, tok_cfg.get("make_vocab_size_divisible_by", 128), self.ctx.tensor_parallel_size
        )
        with open_dict(cfg):
            cfg.model.cfg.vocab_size = padded
        logger.info(f"Tokenizer with {tokenizer.vocab_size} ids; vocab padded to {padded}")
        return tokenizer

    def _eval_samples(self, cfg) -> int:
        ev = cfg.train.evaluation
        if not ev.get("enabled", False) and not self.eval_only:
            return 0
        return int(ev.eval_iter) * int(cfg.train.test_micro_batch_size) * self.ctx.data_parallel_size

    def build_loaders(self, cfg):
        """Train/valid/test loaders sized for the run; also resolves `train.train_iter` from `train_epoch`."""
        glob = cfg.train.global_batch_size
        loader_cfg = cfg.dataloader.train
        if cfg.train.get("train_epoch", 0):
            samples_per_epoch = self._train_samples_per_epoch(cfg)
            by_epoch = math.ceil(cfg.train.train_epoch * samples_per_epoch / glob)
            cfg.train.train_iter = max(int(cfg.train.train_iter or 0), by_epoch)
            logger.info(f"train.train_epoch={cfg.train.train_epoch}: {samples_per_epoch} samples per epoch, "
                        f"train.train_iter set to {cfg.train.train_iter}")
        if not cfg.train.train_iter or cfg.train.train_iter < 1:
            raise UsageError("set train.train_iter (or train.train_epoch) to a positive number of iterations")
        num_samples = [int(cfg.train.train_iter) * glob, self._eval_samples(cfg), self._eval_samples(cfg)]
        loaders = instantiate_with(
            loader_cfg,
            train_valid_test_num_samples=num_samples,
            micro_batch_size=int(cfg.train.train_micro_batch_size),
            eval_micro_batch_size=int(cfg.train.test_micro_batch_size),
            consumed_samples=self.consumed_samples,
            data_parallel_rank=self.ctx.dp_rank,
            data_parallel_size=self.ctx.data_parallel_size,
            vocab_size=self.tokenizer.vocab_size if self.tokenizer is not None else None,
        )
        return loaders

    def _train_samples_per_epoch(self, cfg) -> int:
        c = cfg.dataloader.train
        if "seq_length" in c:
            from ..data.build import train_samples_per_epoch

            return train_samples_per_epoch(c.data_prefix, c.get("splits_string", "949,50,1"), int(c.seq_length))
        from ..data.t5_dataset import t5_train_samples_per_epoch

        return t5_train_samples_per_epoch(c.data_prefix, c.get("splits_string", "949,50,1"), int(c.max_seq_length),
                                          float(c.get("masked_lm_prob", 0.15)), float(c.get("mean_span_length", 3.0)))

    def flops_per_sample(self, cfg) -> float | None:
        """Training FLOPs of one sample (forward and backward) from the model's own count, if it has one."""
        if not hasattr(self.raw_model, "flops_per_token"):
            return None
        c = cfg.dataloader.train
        if "seq_length" in c:
            return float(self.raw_model.flops_per_token(int(c.seq_length))) * int(c.seq_length)
        enc = int(c.max_seq_length)
        dec = self.tokens_per_sample(cfg) - enc
        # The T5 models count per encoder token, with the decoder's length given separately.
        return float(self.raw_model.flops_per_token(enc, decoder_seq_length=dec)) * enc

    @staticmethod
    def tokens_per_sample(cfg) -> int:
        """Tokens one sample feeds the model: the GPT sequence, or T5's encoder plus decoder lengths."""
        c = cfg.dataloader.train
        if "seq_length" in c:
            return int(c.seq_length)
        dec = c.get("max_seq_length_dec")
        if dec is None:
            from ..data.t5_dataset import random_spans_helper

            dec = random_spans_helper(int(c.max_seq_length), float(c.get("masked_lm_prob", 0.15)),
                                      float(c.get("mean_span_length", 3.0)))[1]
        return int(c.max_seq_length) + int(dec)

    def check_layout(self, cfg) -> None:
        """Refuse, before any work, parallel settings the model or the world cannot take."""
        from ..parallel.data_parallel import validate_zero_config
        from ..parallel.tensor_parallel import check_tensor_parallel

        check_tensor_parallel(cfg.model.cfg, self.ctx.tensor_parallel_size, bool(cfg.train.dist.get("sequence_parallel")),
                              self.tokens_per_sample(cfg) if "seq_length" in cfg.dataloader.train else None)
        validate_zero_config(self.zero_stage(cfg), self.offload(cfg), self.fsdp_param_dtype(cfg))
        from ..parallel.expert_parallel import check_moe_layout, moe_config

        check_moe_layout(moe_config(cfg.model.cfg), self.ctx.data_parallel_size, self.ctx.tensor_parallel_size,
                         self.zero_stage(cfg), bool(cfg.train.dist.get("sequence_parallel")))
        pp = self.ctx.pipeline_parallel_size
        if pp > 1:
            from ..parallel.pipeline import check_schedule

            expected = model_pipeline_layers(cfg)
            given = cfg.train.dist.get("pipeline_num_layers")
            if expected is not None and given is not None and int(given) != expected:
                raise UsageError(f"train.dist.pipeline_num_layers={given} but the model has {expected} layers to place "
                                 f"(T5 counts both stacks: 2 x model.cfg.hidden_layers); set it to {expected} or "
                                 f"leave it unset (null) to derive it")
            num_stages, stage_of_layer = self.pipeline_layout(cfg)
            check_schedule(str(cfg.train.dist.get("pipeline_schedule", "1f1b")), num_stages, pp,
                           int(cfg.train.num_accumulation_steps))
            if self.zero_stage(cfg) == 1 and self.ctx.data_parallel_size > 1:
                raise UsageError("ZeRO stage 1 (DDP + ZeroRedundancyOptimizer) cannot run under pipeline parallelism; "
                                 "use train.zero_optimization.stage=2, which also shards optimizer state")
            if cfg.train.amp.get("enabled") and str(cfg.train.amp.get("dtype", "bf16")) in ("fp16", "float16"):
                raise UsageError("fp16 loss scaling is not supported with pipeline parallelism yet; "
                                 "use train.amp.dtype=bf16")
            if not hasattr(instantiate_target(cfg.model), "pipeline_module"):
                raise UsageError(f"{cfg.model._target_} does not support pipeline parallelism (no pipeline_module()); "
                                 f"set train.dist.pipeline_parallel_size=1")
            with open_dict(cfg):
                # The resolved assignment goes into config.yaml, so a run can be reproduced exactly.
                cfg.train.dist.stage_of_layer = stage_of_layer

    @staticmethod
    def zero_stage(cfg) -> int:
        z = cfg.train.zero_optimization
        return int(z.get("stage", 1)) if z.get("enabled", False) else 0

    @staticmethod
    def offload(cfg) -> bool:
        return bool(cfg.train.zero_optimization.get("offload", False))

    def fsdp_param_dtype(self, cfg):
        """Under FSDP (ZeRO-2/3) mixed precision is FSDP's policy: parameters gathered in the amp dtype."""
        amp = cfg.train.amp
        if self.zero_stage(cfg) < 2 or not amp.get("enabled", False):
            return None
        return _AMP_DTYPES.get(str(amp.get("dtype", "bf16")))

    def build_model(self, cfg):
        """Instantiate `cfg.model` on this rank's device and parallelize it as `train.dist` says.

        Order (torchtitan's): pipeline split, then on each stage tensor parallel, activation
        checkpointing and data parallel / ZeRO. Returns the module the trainer calls (a view
        with the unsplit model's parameter names under pipeline parallelism, whose steps go
        through `self.stepper`); `self.model_parts` holds the unwrapped module(s) whose
        parameters this rank trains and checkpoints.
        """
        model = instantiate(cfg.model).to(self.ctx.device)
        n = sum(p.numel() for p in model.parameters())
        logger.info(f"Model {type(model).__name__} with {n / 1e6:.2f}M parameters")
        self.raw_model = model
        # FLOPs are counted on the whole model, before a pipeline split takes pieces away.
        self._flops_per_sample = self.flops_per_sample(cfg)
        self.stepper = None
        if self.ctx.pipeline_parallel_size == 1:
            self.model_parts = [model]
            return self.parallelize(model, cfg)
        return self.build_pipeline(model, cfg)

    def pipeline_layout(self, cfg) -> tuple[int, list[int]]:
        """(number of stages, stage of each layer) for `train.dist`'s pipeline settings."""
        from ..utils.distributed import layer_stages

        d = cfg.train.dist
        num_stages = self.ctx.pipeline_parallel_size * int(d.get("virtual_pipeline_size", 1) or 1)
        return num_stages, layer_stages(int(d.pipeline_num_layers), num_stages, d.get("custom_pipeline_stage_id"))

    def build_pipeline(self, model, cfg):
        """Cut `model` into this rank's pipeline stages, parallelize each, and build the schedule."""
        from ..parallel import pipeline as pl

        ctx = self.ctx
        num_stages, stage_of_layer = self.pipeline_layout(cfg)
        ids = pl.local_stage_ids(ctx.pp_rank, ctx.pipeline_parallel_size, num_stages // ctx.pipeline_parallel_size)
        stages, models = pl.build_stage_modules(model, ids, num_stages, stage_of_layer)
        wrapped = [self.parallelize(stage, cfg) for stage in stages]
        # new_group is collective: every rank sees the same spec, so all skip it together for an untied model.
        tied_group = pl.build_tied_weight_group(ctx.mesh) if pl.pipeline_spec(pl.pipeline_module(model)).tied else None
        view = pl.pipeline_model_view(models)
        self.model_parts = [view]
        self.stepper = pl.PipelineStepper(
            wrapped, ids, num_stages, ctx.group("pp"), ctx.device, str(cfg.train.dist.get("pipeline_schedule", "1f1b")),
            int(cfg.train.num_accumulation_steps), model.pipeline_loss_fn, tied_group,
            batch_fn=getattr(model, "pipeline_batch", None), metrics_fn=getattr(model, "pipeline_metrics", None),
            metric_names=getattr(model, "pipeline_metric_names", ()),
        )
        logger.info(f"Pipeline stages {ids} of {num_stages} on this rank; stage of each layer: {stage_of_layer}")
        return view

    def parallelize(self, module, cfg):
        """Expert, tensor parallel, activation checkpointing and data parallel for one model part."""
        from ..parallel.activation_checkpoint import apply_activation_checkpointing
        from ..parallel.data_parallel import apply_data_parallel
        from ..parallel.expert_parallel import apply_expert_parallel, build_expert_mesh, moe_config
        from ..parallel.tensor_parallel import apply_tensor_parallel

        ctx = self.ctx
        moe, expert_mesh = moe_config(cfg.model.cfg), None
        if moe is not None and moe.ep_size > 1:
            # First, so later steps only touch this rank's experts.
            mesh = build_expert_mesh(ctx.mesh, moe.ep_size)
            apply_expert_parallel(module, mesh)
            expert_mesh = mesh["edp"]
        tp = ctx.tensor_parallel_size
        if tp > 1:
            apply_tensor_parallel(module, ctx.mesh["tp"], bool(cfg.train.dist.get("sequence_parallel")))
        ac = cfg.train.activation_checkpoint
        if ac.get("enabled", False):
            apply_activation_checkpointing(module, int(ac.get("every_n_layers", 1) or 1))
        return apply_data_parallel(module, ctx.mesh["dp"], self.zero_stage(cfg), offload=self.offload(cfg),
                                   param_dtype=self.fsdp_param_dtype(cfg), tp_enabled=tp > 1,
                                   pipeline=ctx.pipeline_parallel_size > 1, expert_mesh=expert_mesh)

    def build_optimizer(self, cfg, model):
        """`cfg.optim` for each model part, with `optim.params.model` set to it (LiBai's convention).

        ZeRO-1 shards the optimizer state over the data-parallel group; a rank holding several
        pipeline stages gets one optimizer per stage behind one `OptimizersContainer`.
        """
        from ..optim.container import OptimizersContainer
        from ..parallel.data_parallel import build_zero1_optimizer

        optimizers = []
        for part in self.model_parts:
            params = instantiate_with(cfg.optim.params, model=part)
            opt = instantiate_with(cfg.optim, params=params)
            if self.zero_stage(cfg) == 1 and self.ctx.data_parallel_size > 1:
                # `defaults` can hold entries the constructor does not take (AdamW's decoupled_weight_decay).
                accepted = inspect.signature(type(opt).__init__).parameters
                kwargs = {k: v for k, v in opt.defaults.items() if k in accepted}
                opt = build_zero1_optimizer(type(opt), opt.param_groups, self.ctx.group("dp"), **kwargs)
            optimizers.append(opt)
        return optimizers[0] if len(optimizers) == 1 else OptimizersContainer(optimizers)

    def build_lr_scheduler(self, cfg, optimizer):
        """Instantiate `train.scheduler` with `max_iter` and `warmup_iter` filled in."""
        sched_cfg = cfg.train.scheduler
        warmup_iter = int(cfg.train.train_iter * float(cfg.train.get("warmup_ratio", 0) or 0))
        return instantiate_with(sched_cfg, optimizer=optimizer, max_iter=int(cfg.train.train_iter), warmup_iter=warmup_iter)

    def build_grad_scaler(self, cfg):
        amp = cfg.train.amp
        if not amp.get("enabled", False):
            self.amp_dtype = None
            return None
        name = str(amp.get("dtype", "bf16"))
        if name not in _AMP_DTYPES:
            raise UsageError(f"train.amp.dtype={name!r} is not supported; use 'bf16' or 'fp16'")
        self.amp_dtype = _AMP_DTYPES[name]
        if self.amp_dtype is not torch.float16:
            return None
        return build_loss_scaler(self.ctx.device, float(amp.get("initial_scale", 2.0**16)),
                                 int(amp.get("growth_interval", 1000)))

    def build_trainer(self):
        optim = self.cfg.optim.get("params", {})
        from ..parallel.tensor_parallel import loss_parallel_context

        tp = self.ctx.tensor_parallel_size > 1
        cls, extra = EagerTrainer, {}
        if self.stepper is not None:
            cls, extra = PipelineTrainer, {"stepper": self.stepper}
        return cls(
            self.model,
            self.train_loader,
            self.optimizer,
            self.scheduler,
            num_accumulation_steps=int(self.cfg.train.num_accumulation_steps),
            device=self.ctx.device,
            amp_dtype=self.amp_dtype,
            grad_scaler=self.grad_scaler,
            clip_grad_max_norm=optim.get("clip_grad_max_norm"),
            clip_grad_norm_type=float(optim.get("clip_grad_norm_type") or 2.0),
            max_skipped_nonfinite=int(self.cfg.train.get("max_skipped_nonfinite", 0) or 0),
            loss_context=lambda: loss_parallel_context(tp),
            params=[p for part in self.model_parts for p in part.parameters()],
            pp_mesh=self.ctx.mesh["pp"] if self.ctx.pipeline_parallel_size > 1 else None,
            **extra,
        )

    def build_hooks(self):
        cfg = self.cfg
        periodic = hooks.PeriodicCheckpointer(self.checkpointer, cfg.train.checkpointer.period, self.trainer_state)
        out = [hooks.IterationTimer(), periodic]
        ev = cfg.train.evaluation
        if ev.get("enabled", False) and self.valid_loader is not None:
            eval_hook = hooks.EvalHook(ev.eval_period, self.evaluate)
            out.append(eval_hook)
            if ev.get("eval_metric"):
                out.append(hooks.BestCheckpointer(eval_hook, self.checkpointer, self.trainer_state,
                                                  ev.eval_metric, ev.get("eval_mode", "min")))
        seq = self.tokens_per_sample(cfg)
        flops = self._flops_per_sample
        out.append(
            hooks.PeriodicWriter(
                self.output_dir,
                cfg.train.log_period,
                cfg.train.global_batch_size,
                seq,
                flops,
                device_peak_flops(self.ctx.device, self.amp_dtype is not None),
                lambda: self.consumed_samples_at(self.trainer.iter + 1),
            )
        )
        # Last, so the step a signal interrupts is fully logged before the checkpoint and stop.
        out.append(hooks.SignalCheckpointer(periodic))
        return out

    # --------------------------------------------------------------- state
    def consumed_samples_at(self, iteration: int) -> int:
        """Samples consumed once `iteration` steps of this run (counted from 0) are done."""
        return self._consumed_at_start + (iteration - self.start_iter) * int(self.cfg.train.global_batch_size)

    def trainer_state(self) -> dict:
        it = self.trainer.iter
        state = {
            "iteration": it,
            "consumed_samples": self.consumed_samples_at(it + 1),
            "global_batch_size": int(self.cfg.train.global_batch_size),
            "data_parallel_size": self.ctx.data_parallel_size,
            "scheduler": self.scheduler.state_dict(),
        }
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    @staticmethod
    def _peek_trainer_state(path) -> dict:
        if path is None:
            return {}
        import json

        with open(os.path.join(path, "trainer_state.json")) as f:
            return json.load(f)

    def _restore_trainer_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        if self.grad_scaler is not None and "grad_scaler" in state:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        if state.get("data_parallel_size") not in (None, self.ctx.data_parallel_size):
            logger.warning(
                f"data_parallel_size changed from {state['data_parallel_size']} to {self.ctx.data_parallel_size}: "
                f"the data position is kept as {self.consumed_samples} consumed samples, so every sample is seen once"
            )

    def _setup_output(self) -> None:
        self._consumed_at_start = self.consumed_samples
        if self.ctx.rank == 0:
            try:
                os.makedirs(self.output_dir, exist_ok=True)
                probe = os.path.join(self.output_dir, ".write_test")
                with open(probe, "w"):
                    pass
                os.remove(probe)
            except OSError as e:
                raise UsageError(
                    f"train.output_dir={self.output_dir} is not writable ({e.strerror}); choose another directory"
                ) from e
        from ..utils.distributed import barrier

        barrier()
        attach_log_file(self.output_dir, self.ctx.rank)
        if self.ctx.rank == 0:
            self.checkpointer.remove_partial()
            path = os.path.join(self.output_dir, "config.yaml")
            # Interpolations are resolved so config.yaml shows the values this run used.
            resolved = OmegaConf.create(OmegaConf.to_container(self.cfg, resolve=True), flags={"allow_objects": True})
            LazyConfig.save(resolved, path)
            logger.info(f"Full config saved to {path}")

    # ---------------------------------------------------------------- run
    def evaluate(self) -> dict:
        """Run `train.evaluation.evaluator`: on the valid split for `eval_iter` batches, or on its own data."""
        ev = self.cfg.train.evaluation
        evaluator = instantiate(ev.evaluator)
        return self._inference(self.valid_loader, evaluator, int(ev.eval_iter))

    def eval_context(self):
        """What an evaluator that brings its own data (`evaluate_model`, e.g. LAMBADA) gets from this run."""
        from ..evaluation.model_evaluator import EvalContext

        cfg = self.cfg
        max_len = try_get_key(cfg, "model.cfg.max_seq_length", default=None) or \
            try_get_key(cfg, "dataloader.train.seq_length", default=None)
        return EvalContext(
            tokenizer=self.tokenizer, device=self.ctx.device, dp_rank=self.ctx.dp_rank,
            dp_size=self.ctx.data_parallel_size, dp_group=self.ctx.group("dp"),
            tensor_parallel_size=self.ctx.tensor_parallel_size, micro_batch_size=int(cfg.train.test_micro_batch_size),
            max_seq_length=int(max_len) if max_len else None, autocast=self.trainer.autocast,
            loss_context=self.trainer.loss_context, pipeline=self.stepper is not None,
        )

    def _inference(self, loader, evaluator, eval_iter: int | None) -> dict:
        """`evaluator` over at most `eval_iter` batches of `loader` (all when None), or over its own data."""
        from ..evaluation.model_evaluator import brings_own_data

        if brings_own_data(evaluator):
            return evaluator.evaluate_model(self.model, self.eval_context())
        if self.stepper is not None:
            eval_iter = len(loader) if eval_iter is None else eval_iter
            return inference_on_pipeline(self.stepper, loader, evaluator, eval_iter,
                                         int(self.cfg.train.num_accumulation_steps), self.trainer.autocast,
                                         self.trainer.loss_context)
        return inference_on_dataset(self.model, loader, evaluator, eval_iter, self.trainer.autocast,
                                    self.trainer.loss_context)

    def test(self) -> dict:
        """`--eval-only`: the evaluator on the valid and test splits and each `dataloader.test` loader.

        An evaluator that brings its own data (LAMBADA) runs once instead.
        """
        from ..evaluation.model_evaluator import brings_own_data

        ev = self.cfg.train.evaluation
        evaluator = instantiate(ev.evaluator)
        if brings_own_data(evaluator):
            results = self._inference(None, evaluator, None)
        else:
            results = {}
            splits = [("valid", self.valid_loader, int(ev.eval_iter)), ("test", self.test_loader, int(ev.eval_iter))]
            for split, loader, eval_iter in splits + self.build_test_loaders(self.cfg):
                if loader is None:
                    continue
                res = self._inference(loader, instantiate(ev.evaluator), eval_iter)
                results.update({f"{split}/{k}": v for k, v in res.items()})
        logger.info("Evaluation results: " + "  ".join(f"{k}: {v:.4f}" for k, v in results.items()))
        return results

    def build_test_loaders(self, cfg) -> list:
        """`(name, loader, None)` for each LazyCall in `dataloader.test` (LiBai's key), evaluated whole.

        The builder gets whichever of this run's tokenizer, sequence length, batch size and
        data-parallel layout it takes as arguments and the config leaves unset
        (`libai_lite.data.jsonl_dataset.build_ppl_eval_loader` takes them all).
        """
        nodes = cfg.dataloader.get("test")
        if not nodes:
            return []
        if "_target_" in nodes:
            nodes = [nodes]
        seq = try_get_key(cfg, "dataloader.train.seq_length", default=None) or \
            try_get_key(cfg, "model.cfg.max_seq_length", default=None)
        runtime = {
            "tokenizer": self.tokenizer,
            "seq_length": seq,
            "micro_batch_size": int(cfg.train.test_micro_batch_size),
            "data_parallel_rank": self.ctx.dp_rank,
            "data_parallel_size": self.ctx.data_parallel_size,
            "vocab_size": self.tokenizer.vocab_size if self.tokenizer is not None else None,
            # A pipeline schedule evaluates num_accumulation_steps micro-batches at once.
            "batches_multiple_of": int(cfg.train.num_accumulation_steps) if self.stepper is not None else 1,
        }
        out = []
        for i, node in enumerate(nodes):
            accepted = inspect.signature(instantiate_target(node)).parameters
            kwargs = {k: v for k, v in runtime.items() if k in accepted and node.get(k) is None}
            name = os.path.splitext(os.path.basename(str(node.get("data_path") or node.get("data_prefix") or "")))[0]
            out.append((name or f"test{i}", instantiate_with(node, **kwargs), None))
        return out

    def train(self) -> None:
        """Train from `start_iter` to `train.train_iter`."""
        max_iter = int(self.cfg.train.train_iter)
        logger.info(f"Starting training from iteration {self.start_iter} to {max_iter}")
        self.trainer.train(self.start_iter, max_iter)


def _user_error_types():
    from ..config import ConfigKeyError, ConfigLoadError, ConfigTypeError, InstantiationError
    from ..data.indexed_dataset import IndexedDatasetError

    # InstantiationError: a config-built object refused its arguments (its message names the
    # target, the key path and the original error), which is a config problem the user fixes.
    return (UsageError, ConfigKeyError, ConfigLoadError, ConfigTypeError, IndexedDatasetError, FileNotFoundError,
            FloatingPointError, InstantiationError)


def _instantiation_error():
    from ..config import InstantiationError

    return InstantiationError


def _find_user_error(exc: BaseException | None):
    """The most specific user error in `exc`'s cause chain (an InstantiationError only if nothing better)."""
    types = _user_error_types()
    found = []
    while exc is not None and len(found) < 10:
        if isinstance(exc, types):
            found.append(exc)
        exc = exc.__cause__
    specific = [e for e in found if not isinstance(e, _instantiation_error())]
    return specific[0] if specific else (found[0] if found else None)


def user_error_message(exc: BaseException) -> str | None:
    """The one ``error: ...`` line for a user-fixable error anywhere in ``exc``'s cause chain, else None.

    Shared by every command-line tool so bad input reads the same everywhere.
    """
    e = _find_user_error(exc)
    if e is None:
        return None
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    if isinstance(e, FileNotFoundError) and e.filename and str(e.filename) not in msg:
        msg = f"{msg}: {e.filename}"
    if isinstance(e, _instantiation_error()):
        msg += " (LIBAI_LITE_TRACEBACK=1 shows the traceback)"
    return f"error: {msg}"


def report_cli_error(exc: Exception) -> int:
    """For a command-line tool's ``except`` block: print the one ``error:`` line and return 1, or re-raise.

    A user error is printed by global rank 0 (every rank hits the same one); a collective timeout
    by every rank that gave up (it is rank-local), which then exits at once rather than wait for
    the stuck rank in the process group's teardown. Anything else, or ``LIBAI_LITE_TRACEBACK=1``,
    re-raises with the traceback.
    """
    if os.environ.get("LIBAI_LITE_TRACEBACK"):
        raise exc
    from ..utils.distributed import describe_collective_timeout, is_collective_timeout

    if _find_user_error(exc) is None and is_collective_timeout(exc):
        print(f"error: {describe_collective_timeout(exc)}", file=sys.stderr, flush=True)
        os._exit(1)
    line = user_error_message(exc)
    if line is None:
        raise exc
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, file=sys.stderr, flush=True)
    return 1


def launch(args) -> int:
    """What `tools/train_net.py` runs: load, override, set up, then train or evaluate.

    Bad input ends the process with one `error:` line on stderr and exit status 1; a job restarted
    by torchrun (MAX_RESTARTS) resumes from its last checkpoint on its own.
    """
    from ..utils.distributed import destroy

    try:
        cfg = LazyConfig.load(args.config_file)
        cfg = LazyConfig.apply_overrides(cfg, args.opts)
        resume = args.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        default_setup(cfg, args)
        trainer = DefaultTrainer(cfg, resume=resume, eval_only=args.eval_only)
        if args.eval_only:
            trainer.test()
        else:
            trainer.train()
        return 0
    except Exception as e:  # noqa: BLE001 - user errors arrive wrapped by instantiate; find them
        return report_cli_error(e)
    finally:
        destroy()
