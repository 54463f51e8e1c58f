"""Pipeline parallelism: this rank's stages run by a ``torch.distributed.pipelining`` schedule.

``pipeline_split`` cuts the model; this module validates the schedule, builds the ``PipelineStage``s and
runs one step's forward and backward in ``PipelineStepper``. The model decides what flows between stages
and how the last stage's output becomes a loss.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from ..layers.moe import paused_load_counting
from ..utils.errors import UsageError
from ..utils.parallel_dims import SPLIT_BACKWARD_SCHEDULES, V_SHAPE_SCHEDULES
from .expert_parallel import PipelineMoE
from .pipeline_split import (
    local_stage_ids,
    stage_ranks,
    sync_tied_weight_grads,
    tied_weight_copies,
    trainable_parameters,
)

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    # Zero bubble splits backward into input and weight gradients; the weight half fills the bubbles.
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
# Take a list of stages (one or more per rank); the others exactly one stage.
_MULTI_STAGE = {"interleaved_1f1b", "interleaved_zero_bubble"} | V_SHAPE_SCHEDULES


def check_schedule(schedule: str, num_stages: int, pp_size: int, n_microbatches: int) -> str:
    """Validate a schedule choice against torch's rules; returns the normalised name or raises UsageError."""
    name = str(schedule).lower()
    if name not in SCHEDULES:
        raise UsageError(f"unknown pipeline schedule {schedule!r}; use one of {sorted(SCHEDULES)}")
    if n_microbatches < 1:
        raise UsageError(f"n_microbatches={n_microbatches} must be at least 1 (train.num_accumulation_steps)")
    if num_stages % pp_size:
        raise UsageError(f"{num_stages} pipeline stages do not divide over {pp_size} pipeline ranks; "
                         f"use a multiple of {pp_size} stages")
    virtual = num_stages // pp_size
    if name in V_SHAPE_SCHEDULES:
        if virtual != 2:
            raise UsageError(f"schedule {name!r} runs exactly 2 stages per pipeline rank (a V: rank r holds stages "
                             f"r and 2*pp-1-r), got {virtual}; set train.dist.virtual_pipeline_size=2")
        if name == "dualpipev" and n_microbatches < num_stages:
            raise UsageError(f"schedule 'dualpipev' needs n_microbatches ({n_microbatches}) >= the number of stages "
                             f"({num_stages}); raise train.num_accumulation_steps to {num_stages}")
    elif name in _MULTI_STAGE:
        if name == "interleaved_1f1b" and virtual < 2:
            raise UsageError(f"schedule 'interleaved_1f1b' needs at least 2 virtual stages per pipeline rank, got "
                             f"{virtual}; set 2 or more virtual stages or use '1f1b'")
        rounds = max(1, n_microbatches // pp_size)
        if n_microbatches % rounds:
            raise UsageError(f"schedule {name!r} needs n_microbatches ({n_microbatches}) to be a "
                             f"multiple of max(1, n_microbatches // pp) = {rounds}; use a multiple of "
                             f"pipeline_parallel_size ({pp_size})")
    elif virtual != 1:
        raise UsageError(f"schedule {name!r} runs one stage per pipeline rank, got {virtual}; "
                         f"use 'interleaved_1f1b' or 'interleaved_zero_bubble' for virtual stages")
    elif name == "1f1b" and n_microbatches < num_stages:
        raise UsageError(f"schedule '1f1b' needs n_microbatches ({n_microbatches}) >= the number of stages "
                         f"({num_stages}); raise train.num_accumulation_steps to {num_stages} or use 'gpipe'")
    return name


def check_split_backward(schedule: str, stage_modules: Sequence[nn.Module]) -> None:
    """Refuse a zero-bubble schedule over torch.compile'd layers, whose backward computes input and weight
    gradients in one graph; torch would fail there and the other ranks hang until the timeout."""
    if str(schedule).lower() not in SPLIT_BACKWARD_SCHEDULES:
        return
    for stage in stage_modules:
        for m in stage.modules():
            # nn.Module.compile() (libai_lite.converters.compile) compiles in place; torch.compile() wraps.
            if getattr(m, "_compiled_call_impl", None) is not None or isinstance(m, OptimizedModule):
                raise UsageError(f"pipeline schedule {schedule!r} splits each backward into input and weight "
                                 f"gradients, which torch.compile'd layers cannot run; set "
                                 f"train.compile.enabled=False or use 'interleaved_1f1b'")


def _placeholder_runs_count_no_load(stage: PipelineStage, module: nn.Module) -> None:
    """torch >= 2.13 infers a stage's metadata on its first step by running it forward and backward with grad
    on placeholder inputs; MoE routers must not count those tokens' loads (torch 2.11 infers under no_grad)."""
    for name in ("_forward_metadata_inference", "_backward_metadata_inference"):
        run = getattr(stage, name, None)
        if run is None:
            continue

        def paused(*args, _run=run, **kwargs):
            with paused_load_counting(module):
                return _run(*args, **kwargs)

        setattr(stage, name, paused)

class PipelineStepper:
    """Runs one optimizer step's forward and backward through the pipeline.

    ``stage_modules`` are this rank's stages ``stage_ids``. ``loss_fn(output, target)`` is one
    micro-batch's mean loss. ``step`` takes the micro-batches concatenated on dim 0 and leaves the gradient
    of the mean micro-batch loss in the parameters, tied copies summed. ``batch_fn``, ``metrics_fn`` and
    ``metric_names`` are the model's ``pipeline_batch``, ``pipeline_metrics`` and ``pipeline_metric_names``.
    """

    def __init__(self, stage_modules: Sequence[nn.Module], stage_ids: Sequence[int], num_stages: int, pp_group,
                 device: torch.device, schedule: str, n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tied_group=None,
                 batch_fn: Callable[[dict], tuple[tuple, dict, torch.Tensor]] | None = None,
                 metrics_fn: Callable[[torch.Tensor, torch.Tensor], dict] | None = None,
                 metric_names: Sequence[str] = ()):
        self.stage_modules = list(stage_modules)
        self.stage_ids = list(stage_ids)
        self.batch_fn, self.metrics_fn, self.loss_fn = batch_fn, metrics_fn, loss_fn
        self.metric_names = tuple(metric_names) if metrics_fn is not None else ()
        self.pp_group = pp_group
        self.device = torch.device(device)
        self.n_microbatches = int(n_microbatches)
        self.tied_group = tied_group
        self.is_first = 0 in self.stage_ids
        self.is_last = num_stages - 1 in self.stage_ids
        pp_size, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        name = check_schedule(schedule, num_stages, pp_size, self.n_microbatches)
        check_split_backward(name, self.stage_modules)
        # The last stage sits on pipeline rank pp - 1 (loop placement) or 0 (V-shape).
        self._last_rank = dist.get_global_rank(pp_group, stage_ranks(pp_size, num_stages, name)[-1])
        self._grad_scaler = None
        self._losses: list[torch.Tensor] = []
        self._metric_records: list[torch.Tensor] = []
        # A stage returns hidden states, not the auxiliary loss: MoE layers back-propagate it themselves.
        self._moe = PipelineMoE(self.stage_modules, pp_group, self.n_microbatches, self.device)
        self.step_metrics: dict = {}

        expected = local_stage_ids(pp_rank, pp_size, num_stages // pp_size, name)
        if self.stage_ids != expected or len(self.stage_modules) != len(expected):
            raise UsageError(f"pipeline rank {pp_rank} of {pp_size} must own stages {expected} of {num_stages}, "
                             f"got stage ids {self.stage_ids} for {len(self.stage_modules)} modules")
        stages = [PipelineStage(module, sid, num_stages, self.device, group=pp_group)
                  for module, sid in zip(self.stage_modules, self.stage_ids)]
        for stage, module in zip(stages, self.stage_modules):
            _placeholder_runs_count_no_load(stage, module)
        self.schedule = SCHEDULES[name](stages if name in _MULTI_STAGE else stages[0],
                                        n_microbatches=self.n_microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # torch also calls this on placeholder outputs, so losses come from the schedule's `losses` list.
        loss = self.loss_fn(output, target)
        if self.metric_names:
            metrics = self.metrics_fn(output.detach(), target)
            self._metric_records.append(torch.stack([metrics[k].float() for k in self.metric_names]))
        if not torch.is_grad_enabled():  # evaluation: the plain micro-batch loss
            return loss
        # Dividing the loss, not the gradients, makes fp16 overflow at the eager trainer's loss scale.
        loss = loss / self.n_microbatches
        return self._grad_scaler.scale(loss) if self._grad_scaler is not None else loss

    def split_batch(self, batch: dict) -> tuple[tuple, dict, torch.Tensor]:
        """``(first-stage inputs, every-stage kwargs, labels)`` of a loader batch (the model's ``pipeline_batch``)."""
        if self.batch_fn is not None:
            return self.batch_fn(batch)
        return (batch["input_ids"],), {}, batch["labels"]

    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters, each once."""
        return trainable_parameters(self.stage_modules)

    def _on_device(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if tensor.shape[0] % self.n_microbatches:
            raise UsageError(f"{what} has {tensor.shape[0]} rows, not a multiple of the {self.n_microbatches} "
                             f"micro-batches per step; pass num_accumulation_steps micro-batches concatenated")
        return tensor.to(self.device)

    def _run(self, fn, inputs, labels: torch.Tensor | None, kwargs: dict | None) -> None:
        args, target = (), None
        if self.is_first:
            if inputs is None:
                raise ValueError("the first pipeline stage needs its inputs (input_ids)")
            inputs = (inputs,) if torch.is_tensor(inputs) else tuple(inputs)
            args = tuple(self._on_device(t, "input_ids" if len(inputs) == 1 else f"pipeline input {i}")
                         for i, t in enumerate(inputs))
        if self.is_last:
            if labels is None:
                raise ValueError("the last pipeline stage needs labels")
            target = self._on_device(labels, "labels")
        kwargs = {k: self._on_device(v, k) for k, v in (kwargs or {}).items()}
        self._losses, self._metric_records = [], []
        fn(*args, target=target, losses=self._losses, **kwargs)

    def _broadcast_from_last(self, values: list[float]) -> list[float]:
        t = torch.tensor(values if self.is_last else [0.0] * len(values), dtype=torch.float64, device=self.device)
        if dist.get_world_size(self.pp_group) > 1:
            dist.broadcast(t, src=self._last_rank, group=self.pp_group)
        return t.tolist()

    def step(self, input_ids, labels: torch.Tensor | None, grad_scaler=None,
             kwargs: dict | None = None) -> torch.Tensor:
        """Forward + backward of one step; returns the mean micro-batch loss (0-d float64, on the device) on every rank.

        ``input_ids`` is the first stage's input, a tensor or tuple; ``kwargs`` reach every stage. Afterwards
        ``step_metrics`` holds the step's MoE entries and the mean of each of ``metric_names``.
        """
        for m in self.stage_modules:
            m.train()
        self._grad_scaler = grad_scaler
        if grad_scaler is not None:
            # A GradScaler allocates its scale on the first scale(), which only the last stage calls.
            grad_scaler.scale(torch.zeros((), device=self.device))
        # The scale stays a device tensor; only MoE layers, which take it as a number, read it.
        scale = grad_scaler._get_scale_async() if grad_scaler is not None else None
        if self._moe.enabled:
            # The auxiliary losses' gradients scaled like the main loss's: loss scale / micro-batches.
            self._moe.begin_step((float(scale) if scale is not None else 1.0) / self.n_microbatches)
        try:
            self._run(lambda *a, **k: self.schedule.step(*a, return_outputs=False, **k), input_ids, labels, kwargs)
        finally:
            self._grad_scaler = None
        sync_tied_weight_grads(self.stage_modules, self.tied_group)
        self.step_metrics = self._moe.step_metrics()
        values = torch.zeros(1 + len(self.metric_names), dtype=torch.float64, device=self.device)
        if self.is_last:
            loss = torch.stack([l.detach().float() for l in self._losses]).sum()
            # Scaling by the loss scale (a power of two) is exact, so dividing it out is too.
            values[0] = loss if scale is None else loss / scale
            if self.metric_names:
                # The last n: on its first step torch also calls the loss on placeholder outputs.
                values[1:] = torch.stack(self._metric_records[-self.n_microbatches:]).mean(0)
        if dist.get_world_size(self.pp_group) > 1:
            dist.broadcast(values, src=self._last_rank, group=self.pp_group)
        self.step_metrics.update({k: values[i + 1].float() for i, k in enumerate(self.metric_names)})
        return values[0]

    @torch.no_grad()
    def eval_step(self, input_ids, labels: torch.Tensor | None, kwargs: dict | None = None) -> dict:
        """Forward only; ``{"lm_loss", "nll_sum", "num_tokens"}`` as float tensors on every pipeline rank.

        ``nll_sum`` weights each micro-batch's mean loss by its labels other than -100, for perplexity.
        """
        modes = [m.training for m in self.stage_modules]
        for m in self.stage_modules:
            m.eval()
        try:
            self._run(self.schedule.eval, input_ids, labels, kwargs)
        finally:
            for m, mode in zip(self.stage_modules, modes):
                m.train(mode)
        values = [0.0, 0.0]
        if self.is_last:
            counts = [float((c != -100).sum()) for c in torch.tensor_split(labels, self.n_microbatches, dim=0)]
            values = [sum(float(l) * n for l, n in zip(self._losses, counts)), sum(counts)]
        nll, tokens = self._broadcast_from_last(values)
        return {
            "lm_loss": torch.tensor(nll / tokens if tokens else 0.0, dtype=torch.float64),
            "nll_sum": torch.tensor(nll, dtype=torch.float64),
            "num_tokens": torch.tensor(tokens, dtype=torch.float64),
        }

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The one clipper over this rank's stages and the pipeline group, the tied weight counted once."""
        from .clip_grad import clip_grad_norm_

        return clip_grad_norm_(self.parameters(), max_norm, norm_type, self.pp_group,
                               exclude_from_norm=tied_weight_copies(self.stage_modules))
