"""``DefaultTrainer``: from a config and its ``Layout`` to a running training job.

The config is resolved once (``libai_lite.run_spec.resolve_run``) into ``self.spec``; every ``build_*`` method
then instantiates its section of the resolved config it is given, takes its settings from the spec, and returns
what it builds, so a subclass that overrides any one of them (LiBai's extension point) still trains.
"""
from __future__ import annotations

import copy
import logging
import os

import torch
from omegaconf import OmegaConf, open_dict

from ..checkpoint import Checkpointer, resolve_resume
from ..checkpoint.dcp_io import resolve_async_save
from ..checkpoint.integrity import check_checkpoint_shapes
from ..checkpoint.trainer_state import (RngState, TrainerState, check_model_unchanged, plain_model_config,
                                        resume_position)
from ..config import LazyConfig, instantiate
from ..config.instantiate import instantiate_with
from ..data.build import check_data_tokenizer, megatron_consumed_valid_samples, megatron_valid_samples
from ..evaluation.runner import eval_context, evaluate_splits, run_evaluator
from ..layers.moe import router_bias_after_optimizer_step
from ..model import max_seq_length, sample_throughput
from ..converters.compile import check_compile, uses_cuda_graphs
from ..converters.float8 import check_float8, float8_after_optimizer_step
from ..parallel.parallelize import ParallelModel, check_model_layout, check_sample_layout, parallelize_model
from ..planning import startup_estimate
from ..run_spec import RunSpec, resolve_run, tokenizer_from_config
from ..utils.distributed import Layout, broadcast_object, flight_recorder_dir
from ..utils.errors import UsageError, write_error
from ..utils.flops import device_peak_flops
from ..utils.logger import attach_log_file
from ..utils.process import OutputDirLock, shield_workers_from_stop_signals, stop_requested
from . import hooks
from .amp import build_loss_scaler
from .profiler import ProfilerHook
from .run_folder import check_output_dir_writable, refuse_existing_run
from .straggler import StragglerWatch
from .trainer import Trainer
from .wandb_writer import build_wandb_writer

logger = logging.getLogger("libai_lite")


class DefaultTrainer:
    """Builds tokenizer, data, model, optimizer, scheduler, checkpointer, trainer and hooks from ``cfg``, then trains.

    Subclass and override a ``build_*`` method to change one piece, LiBai style.
    """

    def __init__(self, cfg, layout: Layout, resume: bool = False, eval_only: bool = False, verify: bool = True,
                 run_dir: str | None = None, replace_run: bool = False):
        """``run_dir`` is the run whose ``last_checkpoint`` ``resume`` reads, by default ``train.output_dir``.
        With ``verify`` False checkpoints load without checking their files against their manifest. A training
        that does not resume is refused where ``train.output_dir`` already holds a run, unless ``replace_run``
        (``--fast-dev-run``'s folder of its own, which each check starts over)."""
        self.cfg, self.layout, self.eval_only, self.verify = cfg, layout, eval_only, verify
        self.replace_run = replace_run
        self.tokenizer = self.build_tokenizer(cfg)
        # config.yaml keeps the layout asked for: a rerun on another process count derives its own.
        self._asked_dist = copy.deepcopy(cfg.train.get("dist"))
        self.spec = self.resolve(cfg)
        cfg = self.cfg = self.spec.cfg
        self.output_dir = self.spec.checkpoint.output_dir
        self._model_record = plain_model_config(cfg.model.get("cfg"))  # what a checkpoint says it trained
        # Refuse before writing anything; the loaders need the resumed data position.
        self.resume_path = self.check_start(cfg, resume, run_dir or self.output_dir)
        train_iter = None if eval_only else self.spec.train_iter
        self.consumed_samples, self.start_iter = resume_position(self.resume_path, train_iter)
        self.train_loader, self.valid_loader, self.test_loader = self.build_loaders(cfg)
        self.check_data(self.train_loader, self.valid_loader, self.test_loader)
        self.model = self.build_model(cfg)
        self.optimizer = self.build_optimizer(cfg, self.model)
        self.scheduler = self.build_lr_scheduler(cfg, self.optimizer)
        self.grad_scaler = self.build_grad_scaler(cfg)
        self.checkpointer = self.build_checkpointer(cfg, self.model, self.optimizer)
        self.load_checkpoint()
        self._setup_output()
        self.trainer = self.build_trainer(cfg, self.model, self.train_loader, self.optimizer, self.scheduler,
                                          self.grad_scaler)
        # An evaluation runs no training step: no metrics.json, event file or W&B run of its own.
        self.trainer.register_hooks([] if eval_only else self.build_hooks())

    # ------------------------------------------------------------ checks
    def check_start(self, cfg, resume: bool, run_dir: str) -> str | None:
        """Refuse, before anything is written, a layout, output directory or checkpoint that cannot work;
        returns the checkpoint ``resume`` continues from, None to start from scratch."""
        if not (resume or self.eval_only or self.replace_run):
            self.refuse_existing_run(self.output_dir)
        meta_model = self.spec.meta_model if self.spec.meta_model is not None else self.build_meta_model(cfg)
        self.check_layout(cfg, meta_model)
        resume_path = resolve_resume(run_dir) if resume else None
        if resume and resume_path is None:
            logger.warning(f"--resume given but {run_dir} has no last_checkpoint: starting from scratch")
        self.precheck_output_dir(self.output_dir)
        if resume_path or self.spec.checkpoint.load_weight:
            check_checkpoint_shapes(resume_path or self.spec.checkpoint.load_weight, meta_model.state_dict(),
                                    vocab_ids=getattr(self.tokenizer, "vocab_size", None),
                                    model_config=cfg.model.get("cfg"), verify=self.verify,
                                    rebuild=self.model_shapes_with)
        if resume_path is not None:  # after the shapes, whose refusal names the tensor that differs
            check_model_unchanged(resume_path, cfg.model.get("cfg"), cfg.train.get("resume_model_changes") or ())
        return resume_path

    # The output folder's checks (run_folder): static, so tools and tests call them without a trainer.
    refuse_existing_run = staticmethod(refuse_existing_run)
    precheck_output_dir = staticmethod(check_output_dir_writable)

    def check_layout(self, cfg, model: torch.nn.Module) -> None:
        """Refuse, before any work, parallel settings the model (built on ``meta``) or the world cannot take."""
        from ..parallel.data_parallel import validate_zero_config
        from ..parallel.tensor_parallel import check_declared_splits, check_sequence_parallel_split

        layout, spec = self.layout, self.spec
        validate_zero_config(layout.zero_stage, layout.offload, spec.param_dtype)
        # Whatever the model's config keys: every dimension its layers declare split must divide.
        check_declared_splits(model, layout.tensor_parallel_size, cfg.model.get("cfg"))
        given, expected = spec.pipeline_num_layers, getattr(model, "pipeline_num_layers", None)
        if layout.pipeline_parallel_size > 1 and given is not None and expected is not None and int(given) != expected:
            raise UsageError(f"train.dist.pipeline_num_layers={given} but the model has {expected} layers to place; "
                             f"set it to {expected} or leave it unset (null) to derive it")
        check_model_layout(model, layout, spec.batch.num_accumulation_steps)
        check_float8(spec.float8, layout.device, layout.tensor_parallel_size)
        check_compile(spec.compile, spec.batch.num_accumulation_steps, replica_size=layout.replica_size,
                      pipeline_parallel_size=layout.pipeline_parallel_size, offload=layout.offload)
        if layout.sequence_parallel and max_seq_length(model) is not None:
            check_sequence_parallel_split(max_seq_length(model), layout.tensor_parallel_size, "the model's sequences")

    def check_data(self, train_loader, *loaders) -> None:
        """Before the loaders' workers start, shield them from the job's stop signals (the trainer's to handle);
        refuse samples the sequence or context-parallel split cannot cut; log the memory planner's estimate."""
        for loader in (train_loader, *loaders):
            shield_workers_from_stop_signals(loader)
        dataset = getattr(train_loader, "dataset", None)
        if dataset:
            self.check_sample_splits(dataset)
        if self.spec.log.memory_estimate and self.layout.rank == 0 and dataset is not None:
            # What the planner expects this run to need per rank (tools/estimate_memory.py explains it).
            logger.info(startup_estimate(self.spec, self.layout.device.type, dataset[0]))

    def check_sample_splits(self, dataset) -> None:
        """Refuse samples the sequence- or context-parallel split cannot cut (``check_sample_layout``)."""
        check_sample_layout(dataset[0], self.layout)

    # ------------------------------------------------------------ building
    def build_meta_model(self, cfg) -> torch.nn.Module:
        """``cfg.model`` on the meta device (no memory, no init): what the checks ask the model."""
        with torch.device("meta"):
            return instantiate(cfg.model)

    def model_shapes_with(self, changes: dict) -> dict:
        """The state-dict shapes of the model with ``changes`` to ``model.cfg`` (built on ``meta``): a refused
        checkpoint's shapes tell which key differs."""
        model_cfg = copy.deepcopy(self.cfg.model)
        OmegaConf.set_readonly(model_cfg, False)
        with open_dict(model_cfg):
            model_cfg.cfg.update(changes)
        with torch.device("meta"):
            return {k: tuple(v.shape) for k, v in instantiate(model_cfg).state_dict().items()}

    def build_tokenizer(self, cfg):
        """``tokenization.tokenizer`` instantiated (None without one); its padded size becomes the model's vocabulary
        when the config is resolved."""
        return tokenizer_from_config(cfg)

    def resolve(self, cfg) -> RunSpec:
        """``cfg`` resolved for this layout and tokenizer (``resolve_run``), with the start-up line that states it."""
        spec = resolve_run(cfg, self.layout.dims, self.tokenizer, eval_only=self.eval_only)
        if self.tokenizer is not None:
            logger.info(f"Tokenizer with {self.tokenizer.vocab_size} ids; vocab padded to {spec.vocab_size}")
        logger.info(f"Rank {self.layout.rank} of {self.layout.world_size}; {spec.describe(self.layout.device)}")
        return spec

    def build_loaders(self, cfg):
        """Train/valid/test loaders sized for the run's iterations and evaluations (``self.spec``)."""
        spec, loader_cfg = self.spec, cfg.dataloader.train
        check_data_tokenizer(loader_cfg.get("data_prefix"), self.tokenizer, loader_cfg.get("eod_token_id"))
        global_batch, micro, test_micro = (spec.batch.global_batch_size, spec.batch.micro_batch_size,
                                   spec.batch.test_micro_batch_size)
        valid_samples = test_samples = 0
        if spec.evaluation.enabled or self.eval_only:
            # A pipeline schedule evaluates num_accumulation_steps batches at once: whole schedules.
            group = spec.batch.num_accumulation_steps if self.layout.pipeline_parallel_size > 1 else 1
            eval_batches = -(-spec.eval_iter // group) * group
            read = eval_batches * test_micro * self.layout.data_parallel_size
            # Sized as Megatron-LM sizes them, so each evaluation reads the samples Megatron's would.
            valid_samples = megatron_valid_samples(spec.train_iter, spec.evaluation.period, spec.eval_iter,
                                                   global_batch, read)
            test_samples = max(read, spec.eval_iter * global_batch)
        extra = {}
        if self.tokenizer is not None and "eod_token_id" in loader_cfg and loader_cfg.eod_token_id is None:
            # Packed-document options need the end-of-document id: the run's tokenizer knows it.
            extra["eod_token_id"] = self.tokenizer.eod_id
        return instantiate_with(
            loader_cfg,
            **extra,
            train_valid_test_num_samples=[spec.train_iter * global_batch, valid_samples, test_samples],
            micro_batch_size=micro,
            eval_micro_batch_size=test_micro,
            consumed_samples=self.consumed_samples,
            data_parallel_rank=self.layout.dp_rank,
            data_parallel_size=self.layout.data_parallel_size,
            vocab_size=self.tokenizer.vocab_size if self.tokenizer is not None else None,
        )

    def build_model(self, cfg) -> ParallelModel:
        """``cfg.model`` on this rank's device, parallelized as the layout and the spec say (``parallelize_model``)."""
        spec = self.spec
        model = instantiate(cfg.model).to(self.layout.device)
        logger.info(f"Model {type(model).__name__} with {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
                    f"parameters")
        return parallelize_model(model, self.layout, spec.batch.num_accumulation_steps,
                                 activation_checkpoint_every=spec.activation_checkpoint_every,
                                 activation_checkpoint_mode=spec.activation_checkpoint_mode, compile=spec.compile,
                                 param_dtype=spec.param_dtype, float8=spec.float8,
                                 stage_of_layer=spec.stage_of_layer)

    def build_optimizer(self, cfg, model: ParallelModel):
        """``cfg.optim`` for each model part, with ``optim.params.model`` set to it (LiBai's convention).

        A rank holding several pipeline stages gets one optimizer per stage in an ``OptimizersContainer``.
        ZeRO-1 wraps each in a ``ZeroRedundancyOptimizer``; with offload, also at dp=1, that keeps and steps its
        shard in host memory.
        """
        from ..optim import build_optimizer
        from ..optim.container import OptimizersContainer
        from ..parallel.data_parallel import zero1_from

        optimizers = []
        for part in model.parts:
            opt = build_optimizer(cfg.optim, part)
            offload = self.layout.zero_stage == 1 and self.layout.offload
            if self.layout.zero_stage == 1 and (self.layout.replica_size > 1 or offload):
                # Over dp x cp, the group the gradients are reduced over.
                opt = zero1_from(opt, self.layout.replica_group, offload=offload)
            float8_after_optimizer_step(opt, part)  # ZeRO-2/3 float8 all-gather: the weights' scales at once
            # sigmoid_bias routers: the loads of the global batch (every dp x cp rank's tokens) move the biases.
            router_bias_after_optimizer_step(opt, part, self.layout.replica_group)
            optimizers.append(opt)
        return optimizers[0] if len(optimizers) == 1 else OptimizersContainer(optimizers)

    def build_lr_scheduler(self, cfg, optimizer):
        """Instantiate ``train.scheduler`` with the spec's ``max_iter`` and ``warmup_iter`` filled in."""
        from ..scheduler.lr_scheduler import check_group_floors

        return check_group_floors(instantiate_with(cfg.train.scheduler, optimizer=optimizer,
                                                   max_iter=self.spec.train_iter, warmup_iter=self.spec.warmup_iter))

    def build_grad_scaler(self, cfg):
        """fp16's loss scaler (None for fp32 and bf16)."""
        scale = self.spec.loss_scale
        if scale is None:
            return None
        return build_loss_scaler(self.layout.device, scale.initial_scale, scale.growth_interval)

    def build_checkpointer(self, cfg, model: ParallelModel, optimizer) -> Checkpointer:
        """DCP checkpoints of the model parts and optimizer in ``train.output_dir``."""
        settings = self.spec.checkpoint
        states = {"rng": RngState(), "trainer": TrainerState(self.trainer_state, self._restore_trainer_state)}
        return Checkpointer(model.parts, optimizer, settings.output_dir, states=states,
                            max_to_keep=settings.max_to_keep, aliases=model.checkpoint_aliases,
                            tied_copies=model.tied_copies,
                            async_save=resolve_async_save(settings.async_save, self.layout.device),
                            vocab_ids=getattr(self.tokenizer, "vocab_size", None),
                            model_config=cfg.model.get("cfg"), verify=self.verify)

    def load_checkpoint(self) -> None:
        """The ``--resume`` checkpoint (the trainer's state comes back through its ``TrainerState``), else the
        weights of ``train.load_weight``; ``--eval-only`` needs one of them."""
        if self.resume_path is not None:
            self.checkpointer.load(self.resume_path)
            logger.info(f"Resumed from {self.resume_path} at iteration {self.start_iter}, "
                        f"{self.consumed_samples} samples consumed")
        elif self.spec.checkpoint.load_weight:
            self.checkpointer.load(self.spec.checkpoint.load_weight, weights_only=True)
            logger.info(f"Loaded weights from {self.spec.checkpoint.load_weight}")
        elif self.eval_only:
            raise UsageError("--eval-only needs weights: set train.load_weight=CHECKPOINT_DIR or add --resume")

    def build_trainer(self, cfg, model: ParallelModel, train_loader, optimizer, scheduler, grad_scaler) -> Trainer:
        """The step runner: eager, or through the pipeline schedule when the model is pipelined."""
        from ..parallel.tensor_parallel import loss_parallel_context

        step, tp = self.spec.optim, self.layout.tensor_parallel_size > 1
        return Trainer(
            model.module, train_loader, optimizer, scheduler, model.metrics,
            num_accumulation_steps=self.spec.batch.num_accumulation_steps, device=self.layout.device,
            amp_dtype=self.spec.amp_dtype, grad_scaler=grad_scaler, clip_grad_max_norm=step.clip_grad_max_norm,
            clip_grad_norm_type=step.clip_grad_norm_type, max_skipped_nonfinite=step.max_skipped_nonfinite,
            min_loss_scale=self.spec.loss_scale.min_loss_scale if self.spec.loss_scale is not None else None,
            loss_context=lambda: loss_parallel_context(tp),
            pipeline=model.pipeline,
            context_parallel=model.context_parallel,
            cuda_graphs=uses_cuda_graphs(self.spec.compile) and self.layout.device.type == "cuda",
        )

    def build_hooks(self):
        """The trainer's hooks, in the order ``hooks.hooks_in_order`` gives (and explains)."""
        spec = self.spec
        periodic = hooks.PeriodicCheckpointer(self.checkpointer, spec.checkpoint.period)
        evaluation = best = None
        ev = spec.evaluation
        if ev.enabled and self.valid_loader is not None:
            evaluation = hooks.EvalHook(ev.period, self.evaluate, save_best=periodic.save if ev.metric else None,
                                        metric=ev.metric, mode=ev.mode)
            best = hooks.BestCheckpointer(evaluation)
        dataset = getattr(self.train_loader, "dataset", None)
        tokens, flops = sample_throughput(self.model.source, dataset[0]) if dataset else (None, None)
        writer = hooks.PeriodicWriter(
            output_dir=self.output_dir, period=spec.log.period, global_batch_size=spec.batch.global_batch_size,
            tokens_per_sample=tokens, flops_per_sample=flops,
            peak_flops=device_peak_flops(self.layout.device, spec.amp_dtype is not None, spec.log.peak_tflops),
            consumed_fn=lambda: self.consumed_samples_at(self.trainer.next_iter), layout=self.layout,
            metrics=self.model.metrics,
            wandb=build_wandb_writer(spec.log.wandb, self.output_dir, resume=self.resume_path is not None),
            stragglers=StragglerWatch.for_run(spec.log, self.layout),
        )
        profiler = ProfilerHook(self.output_dir, self.layout.device, spec.profile) if spec.profile else None
        return hooks.hooks_in_order(hooks.IterationTimer(), writer, periodic, hooks.SignalCheckpointer(periodic),
                                    evaluation=evaluation, best=best, profiler=profiler)

    # --------------------------------------------------------------- state
    def consumed_samples_at(self, iteration: int) -> int:
        """Samples consumed once `iteration` steps of this run (counted from 0) are done."""
        return self.consumed_samples + (iteration - self.start_iter) * self.spec.batch.global_batch_size

    def trainer_state(self) -> dict:
        """What ``trainer_state.json`` holds for a checkpoint taken now (``TrainerState``)."""
        # The last iteration done, not trainer.iter, which is already max_iter at the end of a run.
        done = self.trainer.next_iter
        state = {
            "iteration": done - 1,
            "consumed_samples": self.consumed_samples_at(done),
            "global_batch_size": self.spec.batch.global_batch_size,
            "data_parallel_size": self.layout.data_parallel_size,
            "scheduler": self.scheduler.state_dict(),
            "model_config": self._model_record,
        }
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def _restore_trainer_state(self, state: dict) -> None:
        """A resumed checkpoint's trainer state: the schedule, loss scale (the position was read before the loaders)."""
        from ..scheduler.lr_scheduler import restore_scheduler

        changed = restore_scheduler(self.scheduler, state["scheduler"])
        if changed:
            what = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
            logger.info(f"lr schedule rebuilt from this run's config ({what}): the lr continues along the new schedule")
        if self.grad_scaler is not None and "grad_scaler" in state:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        if state.get("data_parallel_size") not in (None, self.layout.data_parallel_size):
            logger.warning(f"data_parallel_size changed from {state['data_parallel_size']} to "
                           f"{self.layout.data_parallel_size}: the data position is kept as {self.consumed_samples} "
                           f"consumed samples, so every sample is seen once")

    def _setup_output(self) -> None:
        refused = None
        if self.layout.rank == 0:
            # Before anything is written there: a second run in the directory is refused untouched.
            try:
                os.makedirs(self.output_dir, exist_ok=True)  # writable: check_output_dir_writable said so
                OutputDirLock(self.output_dir).acquire()
            except UsageError as e:
                refused = str(e)
            except OSError as e:
                refused = str(write_error(self.output_dir, e))
        # Every rank learns the outcome, so none waits for a rank 0 that gave up.
        refused = broadcast_object(refused)
        if refused:
            raise UsageError(refused)
        if flight_recorder_dir():  # once the run owns its folder; every rank, as nodes may not share one
            os.makedirs(flight_recorder_dir(), exist_ok=True)
        path = os.path.join(self.output_dir, "log.txt")
        try:
            attach_log_file(self.output_dir, self.layout.rank)
            if self.layout.rank == 0:
                self.checkpointer.remove_partial()
                path = os.path.join(self.output_dir, "config.yaml")
                # Interpolations are resolved so config.yaml shows the values this run used.
                resolved = OmegaConf.create(OmegaConf.to_container(self.cfg, resolve=True),
                                            flags={"allow_objects": True})
                # What the launch decided is recorded, not required: the asked layout, and the global batch with
                # its accumulation left to be derived on the rerun's data-parallel size.
                with open_dict(resolved):
                    resolved.train.dist = OmegaConf.to_container(self._asked_dist, resolve=True) \
                        if OmegaConf.is_config(self._asked_dist) else self._asked_dist
                    resolved.train.num_accumulation_steps = None
                LazyConfig.save(resolved, path, header=self.launch_record())
                logger.info(f"Full config saved to {path}")
        except OSError as e:
            raise write_error(path, e) from e

    def launch_record(self) -> str:
        """The layout and batch this launch resolved, as config.yaml's header says it."""
        lay, b = self.layout, self.spec.batch
        return (f"Launched on {lay.world_size} process(es): layout pp={lay.pipeline_parallel_size} "
                f"{lay.dims.describe_dp()} tp={lay.tensor_parallel_size} cp={lay.context_parallel_size}, global batch "
                f"{b.global_batch_size} = micro {b.micro_batch_size} x dp {lay.data_parallel_size} x accumulation "
                f"{b.num_accumulation_steps}.\nA rerun from this file derives its own layout (train.dist keeps what was "
                f"asked) and accumulation (the global batch is kept).")

    # ---------------------------------------------------------------- run
    def eval_context(self):
        """What evaluators get from this run (``libai_lite.evaluation.runner.eval_context``)."""
        return eval_context(self.cfg, self.layout, self.model, self.tokenizer, self.trainer)

    def _inference(self, loader, evaluator, eval_iter: int | None = None) -> dict:
        """`evaluator` over at most `eval_iter` batches of `loader` (all when None), or over its own data."""
        return run_evaluator(evaluator, self.model, loader, self.eval_context(), eval_iter)

    def evaluate(self) -> dict:
        """Run `train.evaluation.evaluator`: on the valid split for `eval_iter` batches, or on its own data.

        As in Megatron-LM, the k-th evaluation of a run, resumed runs included, starts at valid sample
        ``k * eval_iter * global_batch_size``.
        """
        sampler = getattr(self.valid_loader, "batch_sampler", None)
        if hasattr(sampler, "seek"):
            # Megatron would have evaluated iter // eval_period times before this one.
            period = self.spec.evaluation.period
            before = self.trainer.iter // period if period > 0 else 0
            start = megatron_consumed_valid_samples(before, self.spec.eval_iter, self.spec.batch.global_batch_size)
            if start >= sampler.total_samples:
                # A capped split shorter than the run's evaluations need wraps around.
                logger.warning(f"the valid split holds {sampler.total_samples} samples, too few for evaluation "
                               f"{before} to start at sample {start}; it starts at {start % sampler.total_samples}")
                start %= sampler.total_samples
            sampler.seek(start)
            logger.info(f"Evaluating valid window {before}: samples from {start} on")
        return self._inference(self.valid_loader, instantiate(self.cfg.train.evaluation.evaluator), self.spec.eval_iter)

    def test(self) -> dict:
        """`--eval-only`: the evaluator on the valid and test splits and each `dataloader.test` loader."""
        eval_iter = self.spec.eval_iter
        splits = [("valid", self.valid_loader, eval_iter), ("test", self.test_loader, eval_iter)]
        return evaluate_splits(self.cfg, self.model, splits, self.eval_context())

    def train(self) -> int | None:
        """Train from `start_iter` to `train.train_iter`; return the stop signal that ended it early (every rank
        the same) or arrived during its last evaluation or save (that rank's), None for a run left alone."""
        max_iter = self.spec.train_iter
        logger.info(f"Starting training from iteration {self.start_iter} to {max_iter}")
        self.trainer.train(self.start_iter, max_iter)
        return self.trainer.stop_signal or stop_requested()
