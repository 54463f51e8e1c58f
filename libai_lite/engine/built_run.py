"""What training and evaluation both start from: a config resolved for its ``Layout``, checked before anything is
written, its data and model built, its output folder owned.

``BuiltRun`` holds those steps; ``DefaultTrainer`` (``engine/default.py``) adds what training needs and
``EvalOnlyTrainer`` (``engine/eval_only.py``) evaluates, each ``__init__`` calling the steps in order. Every
``build_*`` method takes the one config node it builds and reads its settings from ``self.spec`` (the run resolved
once by ``libai_lite.run_spec.resolve_run``), so a subclass overriding one of them (LiBai's extension point) still
runs.
"""
from __future__ import annotations

import copy
import logging
import os

import torch
from omegaconf import OmegaConf, open_dict

from ..checkpoint import Checkpointer, checkpoint_to_resume
from ..checkpoint.dcp_io import async_save_wanted
from ..checkpoint.integrity import check_checkpoint_shapes
from ..checkpoint.trainer_state import check_model_unchanged
from ..config import LazyConfig, instantiate
from ..config.instantiate import instantiate_with
from ..converters.compile import check_compile
from ..converters.float8 import check_float8
from ..data.build import check_data_tokenizer, megatron_valid_samples
from ..evaluation.runner import eval_context, run_evaluator
from ..model import max_seq_length
from ..parallel.parallelize import ParallelModel, check_model_layout, check_sample_layout, parallelize_model
from ..planning import startup_estimate
from ..run_spec import RunSpec, resolve_run, tokenizer_from_config
from ..utils.distributed import Layout, broadcast_object, flight_recorder_dir
from ..utils.errors import UsageError, write_error
from ..utils.logger import attach_log_file
from ..utils.process import OutputDirLock, shield_workers_from_stop_signals
from .amp import autocast_context
from .run_folder import check_output_dir_writable

logger = logging.getLogger("libai_lite")


class BuiltRun:
    """The steps a run on ``layout`` takes before it trains or evaluates; ``__init__`` resolves the config
    (``self.spec``, ``self.cfg`` its read-only resolved copy) and the subclass's ``__init__`` builds the rest."""

    # Evaluation alone: the valid and test splits are read whatever train.evaluation.enabled says.
    evaluation_only = False

    def __init__(self, cfg, layout: Layout, verify: bool = True):
        """With ``verify`` False checkpoints load without checking their files against their manifest."""
        self.layout, self.verify = layout, verify
        self.tokenizer = self.build_tokenizer(cfg.get("tokenization"))
        # config.yaml keeps the layout asked for: a rerun on another process count derives its own.
        self._asked_dist = copy.deepcopy(cfg.train.get("dist"))
        self.spec = self.resolve(cfg)
        self.cfg = self.spec.cfg
        self.output_dir = self.spec.checkpoint.output_dir

    # ------------------------------------------------------------ checks
    def check_start(self, resume: bool, run_dir: str) -> str | None:
        """Refuse, before anything is written, a layout, output directory or checkpoint that cannot work;
        returns the checkpoint ``resume`` continues from (``run_dir``'s last), None to start from scratch."""
        model_cfg = self.cfg.model.get("cfg")
        meta_model = self.spec.meta_model if self.spec.meta_model is not None else self.build_meta_model(self.cfg.model)
        self.check_layout(meta_model)
        resume_path = checkpoint_to_resume(run_dir) if resume else None
        if resume and resume_path is None:
            logger.warning(f"--resume given but {run_dir} has no last_checkpoint: starting from scratch")
        self.precheck_output_dir(self.output_dir)
        if resume_path or self.spec.checkpoint.load_weight:
            check_checkpoint_shapes(resume_path or self.spec.checkpoint.load_weight, meta_model.state_dict(),
                                    vocab_ids=getattr(self.tokenizer, "vocab_size", None), model_config=model_cfg,
                                    verify=self.verify, rebuild=self.model_shapes_with)
        if resume_path is not None:  # after the shapes, whose refusal names the tensor that differs
            check_model_unchanged(resume_path, model_cfg, self.cfg.train.get("resume_model_changes") or ())
        return resume_path

    # The output folder's check (run_folder): static, so tools and tests call it without a trainer.
    precheck_output_dir = staticmethod(check_output_dir_writable)

    def check_layout(self, model: torch.nn.Module) -> None:
        """Refuse, before any work, parallel settings the model (built on ``meta``) or the world cannot take."""
        from ..parallel.data_parallel import validate_zero_config
        from ..parallel.tensor_parallel import check_declared_splits, check_sequence_parallel_split

        layout, spec = self.layout, self.spec
        validate_zero_config(layout.zero_stage, layout.offload, spec.param_dtype)
        # Whatever the model's config keys: every dimension its layers declare split must divide.
        check_declared_splits(model, layout.tensor_parallel_size, self.cfg.model.get("cfg"))
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

    def check_data(self, first_loader, *loaders) -> None:
        """Before the loaders' workers start, shield them from the job's stop signals (the trainer's to handle);
        refuse samples of ``first_loader`` the sequence or context-parallel split cannot cut; log the memory
        planner's estimate."""
        for loader in (first_loader, *loaders):
            shield_workers_from_stop_signals(loader)
        dataset = getattr(first_loader, "dataset", None)
        if dataset:
            self.check_sample_splits(dataset)
        if self.spec.log.memory_estimate and self.layout.rank == 0 and dataset is not None:
            # What the planner expects this run to need per rank (tools/estimate_memory.py explains it).
            logger.info(startup_estimate(self.spec, self.layout.device.type, dataset[0]))

    def check_sample_splits(self, dataset) -> None:
        """Refuse samples the sequence- or context-parallel split cannot cut (``check_sample_layout``)."""
        check_sample_layout(dataset[0], self.layout)

    # ------------------------------------------------------------ building
    def build_tokenizer(self, node):
        """``node.tokenizer`` (the config's ``tokenization``) instantiated, None without one; its padded size
        becomes the model's vocabulary when the config is resolved."""
        return tokenizer_from_config(node)

    def resolve(self, cfg) -> RunSpec:
        """``cfg`` resolved for this layout and tokenizer (``resolve_run``), with the start-up line that states it."""
        spec = resolve_run(cfg, self.layout.dims, self.tokenizer, eval_only=self.evaluation_only)
        if self.tokenizer is not None:
            logger.info(f"Tokenizer with {self.tokenizer.vocab_size} ids; vocab padded to {spec.vocab_size}")
        logger.info(f"Rank {self.layout.rank} of {self.layout.world_size}; {spec.describe(self.layout.device)}")
        return spec

    def build_meta_model(self, node) -> torch.nn.Module:
        """``node`` (the config's ``model``) on the meta device (no memory, no init): what the checks ask the model."""
        with torch.device("meta"):
            return instantiate(node)

    def model_shapes_with(self, changes: dict) -> dict:
        """The state-dict shapes of the model with ``changes`` to ``model.cfg`` (built on ``meta``): a refused
        checkpoint's shapes tell which key differs."""
        model_cfg = copy.deepcopy(self.cfg.model)
        OmegaConf.set_readonly(model_cfg, False)
        with open_dict(model_cfg):
            model_cfg.cfg.update(changes)
        with torch.device("meta"):
            return {k: tuple(v.shape) for k, v in instantiate(model_cfg).state_dict().items()}

    def build_loaders(self, node):
        """The train/valid/test loaders ``node`` (the config's ``dataloader.train``) builds, sized for the run's
        iterations and evaluations (``self.spec``), the train split from ``self.consumed_samples`` on."""
        spec, batch = self.spec, self.spec.batch
        check_data_tokenizer(node.get("data_prefix"), self.tokenizer, node.get("eod_token_id"))
        valid_samples = test_samples = 0
        if spec.evaluation.enabled or self.evaluation_only:
            # A pipeline schedule evaluates num_accumulation_steps batches at once: whole schedules.
            group = batch.num_accumulation_steps if self.layout.pipeline_parallel_size > 1 else 1
            eval_batches = -(-spec.eval_iter // group) * group
            read = eval_batches * batch.test_micro_batch_size * self.layout.data_parallel_size
            # Sized as Megatron-LM sizes them, so each evaluation reads the samples Megatron's would.
            valid_samples = megatron_valid_samples(spec.train_iter, spec.evaluation.period, spec.eval_iter,
                                                   batch.global_batch_size, read)
            test_samples = max(read, spec.eval_iter * batch.global_batch_size)
        extra = {}
        if self.tokenizer is not None and "eod_token_id" in node and node.eod_token_id is None:
            # Packed-document options need the end-of-document id: the run's tokenizer knows it.
            extra["eod_token_id"] = self.tokenizer.eod_id
        return instantiate_with(
            node,
            **extra,
            train_valid_test_num_samples=[spec.train_iter * batch.global_batch_size, valid_samples, test_samples],
            micro_batch_size=batch.micro_batch_size,
            eval_micro_batch_size=batch.test_micro_batch_size,
            consumed_samples=self.consumed_samples,
            data_parallel_rank=self.layout.dp_rank,
            data_parallel_size=self.layout.data_parallel_size,
            vocab_size=self.tokenizer.vocab_size if self.tokenizer is not None else None,
        )

    def build_model(self, node) -> ParallelModel:
        """``node`` (the config's ``model``) on this rank's device, parallelized as the layout and the spec say
        (``parallelize_model``)."""
        spec = self.spec
        model = instantiate(node).to(self.layout.device)
        logger.info(f"Model {type(model).__name__} with {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
                    f"parameters")
        return parallelize_model(model, self.layout, spec.batch.num_accumulation_steps,
                                 activation_checkpoint_every=spec.activation_checkpoint_every,
                                 activation_checkpoint_mode=spec.activation_checkpoint_mode, compile=spec.compile,
                                 param_dtype=spec.param_dtype, float8=spec.float8,
                                 stage_of_layer=spec.stage_of_layer)

    def build_checkpointer(self, model: ParallelModel, optimizer=None) -> Checkpointer:
        """DCP checkpoints of the model parts (and ``optimizer``) in ``train.output_dir``, with the
        ``checkpoint_states``."""
        settings = self.spec.checkpoint
        return Checkpointer(model.parts, optimizer, settings.output_dir, states=self.checkpoint_states(),
                            max_to_keep=settings.max_to_keep, aliases=model.checkpoint_aliases,
                            tied_copies=model.tied_copies,
                            async_save=async_save_wanted(settings.async_save, self.layout.device),
                            vocab_ids=getattr(self.tokenizer, "vocab_size", None),
                            model_config=self.cfg.model.get("cfg"), verify=self.verify)

    def checkpoint_states(self) -> dict | None:
        """The ``Stateful`` objects a checkpoint holds beside the model and optimizer (None: the RNG's only)."""
        return None

    # ------------------------------------------------------------ output
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

    # ------------------------------------------------------------ evaluating
    def autocast(self):
        """The autocast context of the run's precision (a no-op in fp32)."""
        return autocast_context(self.layout.device, self.spec.amp_dtype)

    def loss_context(self):
        """The context a loss over the run's logits is taken in: ``loss_parallel`` when tp splits the vocabulary."""
        from ..parallel.tensor_parallel import loss_parallel_context

        return loss_parallel_context(self.layout.tensor_parallel_size > 1)

    def eval_context(self):
        """What evaluators get from this run (``libai_lite.evaluation.runner.eval_context``)."""
        return eval_context(self.layout, self.model, self.tokenizer, self.spec.batch.test_micro_batch_size,
                            autocast=self.autocast, loss_context=self.loss_context)

    def _inference(self, loader, evaluator, eval_iter: int | None = None) -> dict:
        """`evaluator` over at most `eval_iter` batches of `loader` (all when None), or over its own data."""
        return run_evaluator(evaluator, self.model, loader, self.eval_context(), eval_iter)
