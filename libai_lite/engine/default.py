"""``DefaultTrainer``: from a config and its ``Layout`` to a running training job.

The steps it shares with evaluation (resolving, the start-up checks, the loaders, the model, the output folder)
are ``BuiltRun``'s (``engine/built_run.py``); this adds the optimizer, lr schedule, loss scaler, step runner and
hooks. Override any ``build_*`` method to change one piece, LiBai style: it gets the config node it builds and
finds every derived setting in ``self.spec``.
"""
from __future__ import annotations

import logging

from ..checkpoint.trainer_state import RngState, TrainerState, plain_model_config, resume_position
from ..config import instantiate
from ..config.instantiate import instantiate_with
from ..converters.compile import uses_cuda_graphs
from ..converters.float8 import float8_after_optimizer_step
from ..data.build import megatron_consumed_valid_samples
from ..layers.moe import router_bias_after_optimizer_step
from ..model import sample_throughput
from ..parallel.parallelize import ParallelModel
from ..utils.distributed import Layout
from ..utils.flops import device_peak_flops
from ..utils.process import stop_requested
from . import hooks
from .amp import build_loss_scaler
from .built_run import BuiltRun
from .profiler import ProfilerHook
from .run_folder import refuse_existing_run
from .straggler import StragglerWatch
from .trainer import Trainer
from .wandb_writer import build_wandb_writer

logger = logging.getLogger("libai_lite")


class DefaultTrainer(BuiltRun):
    """Builds tokenizer, data, model, optimizer, scheduler, checkpointer, trainer and hooks from ``cfg``, then trains.

    Subclass and override a ``build_*`` method to change one piece, LiBai style.
    """

    def __init__(self, cfg, layout: Layout, resume: bool = False, verify: bool = True, run_dir: str | None = None,
                 replace_run: bool = False):
        """``run_dir`` is the run whose ``last_checkpoint`` ``resume`` reads, by default ``train.output_dir``.
        With ``verify`` False checkpoints load without checking their files against their manifest. A training
        that does not resume is refused where ``train.output_dir`` already holds a run, unless ``replace_run``
        (``--fast-dev-run``'s folder of its own, which each check starts over)."""
        super().__init__(cfg, layout, verify)
        cfg = self.cfg
        self._model_record = plain_model_config(cfg.model.get("cfg"))  # what a checkpoint says it trained
        if not (resume or replace_run):
            self.refuse_existing_run(self.output_dir)
        # Refuse before writing anything; the loaders need the resumed data position.
        self.resume_path = self.check_start(resume, run_dir or self.output_dir)
        self.consumed_samples, self.start_iter = resume_position(self.resume_path, self.spec.train_iter)
        self.train_loader, self.valid_loader, self.test_loader = self.build_loaders(cfg.dataloader.train)
        self.check_data(self.train_loader, self.valid_loader, self.test_loader)
        self.model = self.build_model(cfg.model)
        self.optimizer = self.build_optimizer(cfg.optim, self.model)
        self.scheduler = self.build_lr_scheduler(cfg.train.scheduler, self.optimizer)
        self.grad_scaler = self.build_grad_scaler()
        self.checkpointer = self.build_checkpointer(self.model, self.optimizer)
        self.load_checkpoint()
        self._setup_output()
        self.trainer = self.build_trainer(self.model, self.train_loader, self.optimizer, self.scheduler,
                                          self.grad_scaler)
        self.trainer.register_hooks(self.build_hooks())

    # A training that does not resume starts in a folder that holds no run (run_folder).
    refuse_existing_run = staticmethod(refuse_existing_run)

    # ------------------------------------------------------------ building
    def build_optimizer(self, node, model: ParallelModel):
        """``node`` (the config's ``optim``) for each model part, with ``optim.params.model`` set to it (LiBai's
        convention).

        A rank holding several pipeline stages gets one optimizer per stage in an ``OptimizersContainer``.
        ZeRO-1 wraps each in a ``ZeroRedundancyOptimizer``; with offload, also at dp=1, that keeps and steps its
        shard in host memory.
        """
        from ..optim import build_optimizer
        from ..optim.container import OptimizersContainer
        from ..parallel.data_parallel import zero1_from

        optimizers = []
        for part in model.parts:
            opt = build_optimizer(node, part)
            offload = self.layout.zero_stage == 1 and self.layout.offload
            if self.layout.zero_stage == 1 and (self.layout.replica_size > 1 or offload):
                # Over dp x cp, the group the gradients are reduced over.
                opt = zero1_from(opt, self.layout.replica_group, offload=offload)
            float8_after_optimizer_step(opt, part)  # ZeRO-2/3 float8 all-gather: the weights' scales at once
            # sigmoid_bias routers: the loads of the global batch (every dp x cp rank's tokens) move the biases.
            router_bias_after_optimizer_step(opt, part, self.layout.replica_group)
            optimizers.append(opt)
        return optimizers[0] if len(optimizers) == 1 else OptimizersContainer(optimizers)

    def build_lr_scheduler(self, node, optimizer):
        """``node`` (the config's ``train.scheduler``) with the spec's ``max_iter`` and ``warmup_iter`` filled in."""
        from ..scheduler.lr_scheduler import check_group_floors

        return check_group_floors(instantiate_with(node, optimizer=optimizer,
                                                   max_iter=self.spec.train_iter, warmup_iter=self.spec.warmup_iter))

    def build_grad_scaler(self):
        """fp16's loss scaler (None for fp32 and bf16)."""
        scale = self.spec.loss_scale
        if scale is None:
            return None
        return build_loss_scaler(self.layout.device, scale.initial_scale, scale.growth_interval)

    def load_checkpoint(self) -> None:
        """The ``--resume`` checkpoint (the trainer's state comes back through its ``TrainerState``), else the
        weights of ``train.load_weight``."""
        if self.resume_path is not None:
            self.checkpointer.load(self.resume_path)
            logger.info(f"Resumed from {self.resume_path} at iteration {self.start_iter}, "
                        f"{self.consumed_samples} samples consumed")
        elif self.spec.checkpoint.load_weight:
            self.checkpointer.load(self.spec.checkpoint.load_weight, weights_only=True)
            logger.info(f"Loaded weights from {self.spec.checkpoint.load_weight}")

    def build_trainer(self, model: ParallelModel, train_loader, optimizer, scheduler, grad_scaler) -> Trainer:
        """The step runner: eager, or through the pipeline schedule when the model is pipelined."""
        step = self.spec.optim
        return Trainer(
            model.module, train_loader, optimizer, scheduler, model.metrics,
            num_accumulation_steps=self.spec.batch.num_accumulation_steps, device=self.layout.device,
            amp_dtype=self.spec.amp_dtype, grad_scaler=grad_scaler, clip_grad_max_norm=step.clip_grad_max_norm,
            clip_grad_norm_type=step.clip_grad_norm_type, max_skipped_nonfinite=step.max_skipped_nonfinite,
            min_loss_scale=self.spec.loss_scale.min_loss_scale if self.spec.loss_scale is not None else None,
            loss_context=self.loss_context,
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
    def checkpoint_states(self) -> dict:
        """A training checkpoint holds the RNG streams and the trainer's state (``TrainerState``)."""
        return {"rng": RngState(), "trainer": TrainerState(self.trainer_state, self._restore_trainer_state)}

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

    # ---------------------------------------------------------------- run
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

    def train(self) -> int | None:
        """Train from `start_iter` to `train.train_iter`; return the stop signal that ended it early (every rank
        the same) or arrived during its last evaluation or save (that rank's), None for a run left alone."""
        max_iter = self.spec.train_iter
        logger.info(f"Starting training from iteration {self.start_iter} to {max_iter}")
        self.trainer.train(self.start_iter, max_iter)
        return self.trainer.stop_signal or stop_requested()
