"""From a built model and the run's ``Layout`` to what this rank trains: torchtitan's order, one job per step.

Pipeline split, then on each stage expert parallel, tensor parallel, activation checkpointing,
torch.compile and data parallel. Everything comes from the layout and the model; no config key is read.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from ..converters.activation_checkpoint import apply_activation_checkpointing
from ..converters.compile import CompileOptions, apply_compile
from ..converters.float8 import Float8Options, apply_float8
from ..layers.moe import MoEConfig, moe_layers
from ..model import output_metrics, pipeline_hooks, pipeline_num_layers, supports_pipeline
from ..model import stage_of_layer as model_stage_of_layer
from ..utils.distributed import Layout
from ..utils.errors import UsageError
from . import pipeline_split as ps
from .context_parallel import apply_context_parallel, check_context_parallel, check_context_parallel_chunks
from .data_parallel import apply_data_parallel, check_zero1
from .expert_parallel import apply_expert_parallel, build_expert_mesh, check_moe_layout
from .pipeline import PipelineStepper, check_schedule
from .tensor_parallel import apply_tensor_parallel, check_sequence_parallel_split

logger = logging.getLogger("libai_lite")


@dataclass
class ParallelModel:
    """What ``parallelize_model`` returns.

    ``source`` is the model as built, possibly cut in place by a pipeline. ``module`` is what the trainer
    calls; under pipeline parallelism it is a view with the unsplit names, for checkpoints and optimizers
    only. ``parts`` get one optimizer each. ``checkpoint_aliases`` and ``tied_copies`` map the FQNs of a
    pipelined tied weight this rank reads from another entry. ``context_parallel`` shards the trainer's
    batches when cp > 1.
    """

    source: nn.Module
    module: nn.Module
    parts: list[nn.Module]
    metrics: dict
    pipeline: object | None = None
    checkpoint_aliases: dict = field(default_factory=dict)
    context_parallel: object | None = None
    tied_copies: dict = field(default_factory=dict)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters, each once."""
        return ps.trainable_parameters(self.parts)


def model_moe_config(model: nn.Module) -> MoEConfig | None:
    """The MoE settings the model's MoE layers were built with (None for a dense model)."""
    layers = moe_layers(model)
    return layers[0].moe_config if layers else None


def check_sample_layout(sample: dict, layout: Layout) -> None:
    """Under sequence parallelism every sequence of ``sample`` must split evenly over the tp ranks; under context
    parallelism cut into 2 x cp equal chunks (and, with sequence parallelism, each rank's part split evenly)."""
    tp, cp, sp = layout.tensor_parallel_size, layout.context_parallel_size, layout.sequence_parallel
    if not (sp and tp > 1) and cp == 1:
        return
    sequences = [(name, value.shape[0]) for name, value in sample.items() if len(getattr(value, "shape", ())) == 1]
    if sp and tp > 1:
        for name, length in sequences:
            check_sequence_parallel_split(length, tp, f"the samples' {name}")
    if cp > 1:
        for name, length in sequences:
            check_context_parallel_chunks(length, cp, f"the samples' {name}")
            if sp:
                check_sequence_parallel_split(length // cp, tp,
                                              f"each context-parallel rank's part of the samples' {name}")


def check_model_layout(model: nn.Module, layout: Layout, n_microbatches: int) -> None:
    """Refuse, in one line and before any work, a layout this model (built on ``meta``) cannot take."""
    check_moe_layout(model_moe_config(model), layout.data_parallel_size, layout.tensor_parallel_size,
                     layout.zero_stage, layout.sequence_parallel)
    check_context_parallel(model, layout.context_parallel_size, layout.pipeline_parallel_size,
                           model_moe_config(model) is not None)
    if layout.zero_stage == 1 and (layout.replica_size > 1 or layout.offload):
        check_zero1(tensor_parallel=layout.tensor_parallel_size > 1)
    if layout.pipeline_parallel_size == 1:
        return
    if not supports_pipeline(model):
        raise UsageError(f"{type(model).__name__} does not support pipeline parallelism (no pipeline_module()); "
                         f"set train.dist.pipeline_parallel_size=1")
    layout.dims.stage_of_layer(pipeline_num_layers(model))  # refuses more stages than layers, a bad custom list
    check_schedule(layout.pipeline_schedule, layout.num_stages, layout.pipeline_parallel_size, n_microbatches)


def parallelize_part(module: nn.Module, layout: Layout, *, moe: MoEConfig | None = None,
                     activation_checkpoint_every: int = 0, activation_checkpoint_mode: str = "full",
                     compile: CompileOptions | None = None, param_dtype: torch.dtype | None = None,
                     float8: Float8Options | None = None) -> nn.Module:
    """FP8, expert and tensor parallelism, activation checkpointing, compilation and data parallelism for one
    part. ``moe`` is the whole model's, since building the expert mesh is collective whatever the part holds."""
    if float8 is not None:
        # First, so checkpointing, compilation and FSDP2 wrap the float8 linears; uncompiled FP8 is slow.
        apply_float8(module, float8, compile_backend=None if compile is not None and compile.enabled else "inductor",
                     fsdp=(layout.zero_stage or 0) >= 2 and (layout.replica_size > 1 or layout.offload))
    expert_mesh = None
    if moe is not None and moe.ep_size > 1:
        # First, so later steps only touch this rank's experts.
        mesh = build_expert_mesh(layout.mesh, moe.ep_size)
        apply_expert_parallel(module, mesh)
        expert_mesh = mesh["edp"]
    tp = layout.tensor_parallel_size
    if tp > 1:
        apply_tensor_parallel(module, layout.mesh["tp"], layout.sequence_parallel)
    if activation_checkpoint_every:
        apply_activation_checkpointing(module, activation_checkpoint_every, activation_checkpoint_mode)
    if compile is not None:
        # Before FSDP2, so its hooks stay outside the compiled code. The whole model only where nothing
        # needs the layers apart; DDP's buckets would all wait for one backward graph.
        apply_compile(module, compile, whole_model_ok=layout.pipeline_parallel_size == 1 and tp == 1
                      and layout.replica_size == 1 and not layout.offload and layout.context_parallel_size == 1
                      and expert_mesh is None)
    # Over dp x cp under context parallelism: every cp rank holds the whole parameters.
    return apply_data_parallel(module, layout.replica_mesh, layout.zero_stage, offload=layout.offload,
                               param_dtype=param_dtype, tp_enabled=tp > 1,
                               pipeline=layout.pipeline_parallel_size > 1, expert_mesh=expert_mesh)


def _build_pipeline(model: nn.Module, layout: Layout, n_microbatches: int, metrics: dict,
                    stage_of_layer: Sequence[int], **part_options):
    num_stages = layout.num_stages
    ids = ps.local_stage_ids(layout.pp_rank, layout.pipeline_parallel_size, layout.virtual_pipeline_size,
                             layout.pipeline_schedule)
    tied = ps.pipeline_tied(ps.pipeline_module(model))
    stages, models = ps.build_stage_modules(model, ids, num_stages, stage_of_layer)
    wrapped = [parallelize_part(stage, layout, **part_options) for stage in stages]
    # new_group is collective: every rank sees the same model, so all skip it together for an untied one.
    tied_group = (ps.build_tied_weight_group(layout.mesh, schedule=layout.pipeline_schedule,
                                             virtual_stages=layout.virtual_pipeline_size) if tied else None)
    view = ps.pipeline_model_view(models)
    loss_fn, batch_fn, metrics_fn, metric_names = pipeline_hooks(model)
    stepper = PipelineStepper(
        wrapped, ids, num_stages, layout.group("pp"), layout.device, layout.pipeline_schedule, n_microbatches,
        loss_fn, tied_group, batch_fn=batch_fn, metrics_fn=metrics_fn, metric_names=metric_names,
    )
    logger.info(f"Pipeline stages {ids} of {num_stages} on this rank; stage of each layer: {list(stage_of_layer)}")
    return ParallelModel(model, view, [view], metrics, stepper, ps.tied_checkpoint_aliases(view, tied),
                         tied_copies=ps.tied_copies_with_source(view, tied))


def parallelize_model(model: nn.Module, layout: Layout, n_microbatches: int = 1, *,
                      activation_checkpoint_every: int = 0, activation_checkpoint_mode: str = "full",
                      compile: CompileOptions | None = None,
                      param_dtype: torch.dtype | None = None, float8: Float8Options | None = None,
                      stage_of_layer: Sequence[int] | None = None) -> ParallelModel:
    """Make ``model`` (built whole on this rank's device) what this rank trains under ``layout``.

    ``stage_of_layer`` places the layers on pipeline stages (a run's ``RunSpec.stage_of_layer``); None derives it
    from the model (``libai_lite.model.stage_of_layer``).

    ``activation_checkpoint_every`` recomputes every N-th transformer layer, 0 for none.
    ``param_dtype`` sets FSDP's mixed-precision parameters.
    """
    metrics = output_metrics(model)
    options = dict(moe=model_moe_config(model), activation_checkpoint_every=activation_checkpoint_every,
                   activation_checkpoint_mode=activation_checkpoint_mode, compile=compile,
                   param_dtype=param_dtype, float8=float8)
    if layout.pipeline_parallel_size == 1:
        # Before the part is wrapped: the attention layers are reached through the model as built.
        cp = apply_context_parallel(model, layout.mesh["cp"]) if layout.context_parallel_size > 1 else None
        return ParallelModel(model, parallelize_part(model, layout, **options), [model], metrics,
                             context_parallel=cp)
    if stage_of_layer is None:
        stage_of_layer = model_stage_of_layer(model, layout.dims)
    return _build_pipeline(model, layout, n_microbatches, metrics, tuple(stage_of_layer), **options)
