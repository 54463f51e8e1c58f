"""Pipeline parallelism: this rank's stages run by a ``torch.distributed.pipelining`` schedule.

The model is cut by ``pipeline_split`` (by the ``layer_idx`` of its pieces); this module validates
the schedule (GPipe, 1F1B, interleaved 1F1B), builds the ``PipelineStage``s and runs one step's
forward and backward (``PipelineStepper``). What flows between stages and how the last stage's
output becomes a loss is the model's (``libai_lite.model``): ``pipeline_batch``,
``pipeline_loss_fn`` and, optionally, ``pipeline_metrics`` with ``pipeline_metric_names``.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ..utils.errors import UsageError
from .expert_parallel import PipelineMoE
from .pipeline_split import local_stage_ids, sync_tied_weight_grads, tied_weight_copies, trainable_parameters

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}
# Schedules that drive several stages per rank; the others drive exactly one.
_MULTI_STAGE = {"interleaved_1f1b"}


# ------------------------------------------------------------------------------- schedules


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
    if name in _MULTI_STAGE:
        if virtual < 2:
            raise UsageError(f"schedule 'interleaved_1f1b' needs at least 2 virtual stages per pipeline rank, got "
                             f"{virtual}; set 2 or more virtual stages or use '1f1b'")
        rounds = max(1, n_microbatches // pp_size)
        if n_microbatches % rounds:
            raise UsageError(
                f"schedule 'interleaved_1f1b' needs n_microbatches ({n_microbatches}) to be a multiple of "
                f"max(1, n_microbatches // pp) = {rounds}; use a multiple of pipeline_parallel_size ({pp_size})"
            )
    else:
        if virtual != 1:
            raise UsageError(f"schedule {name!r} runs one stage per pipeline rank, got {virtual}; "
                             f"use 'interleaved_1f1b' for virtual stages")
        if name == "1f1b" and n_microbatches < num_stages:
            raise UsageError(f"schedule '1f1b' needs n_microbatches ({n_microbatches}) >= the number of stages "
                             f"({num_stages}); raise train.num_accumulation_steps to {num_stages} or use 'gpipe'")
    return name


def build_pipeline_schedule(
    stage_modules: Sequence[nn.Module],
    stage_ids: Sequence[int],
    num_stages: int,
    pp_group,
    device: torch.device,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """``PipelineStage``s for this rank's stage modules and the torch schedule named ``schedule``.

    ``loss_fn(output, target)`` is the mean loss of one micro-batch; the schedule divides the
    accumulated gradients by ``n_microbatches`` (``scale_grads=True``), so they are the gradient
    of the mean of micro-batch losses. Call ``step(inputs...)`` on the rank of stage 0 and
    ``step(target=labels)`` on the rank of the last stage (``PipelineStepper`` does this).
    """
    pp_size = dist.get_world_size(pp_group)
    pp_rank = dist.get_rank(pp_group)
    name = check_schedule(schedule, num_stages, pp_size, n_microbatches)
    expected = local_stage_ids(pp_rank, pp_size, num_stages // pp_size)
    if list(stage_ids) != expected or len(stage_modules) != len(expected):
        raise UsageError(f"pipeline rank {pp_rank} of {pp_size} must own stages {expected} of {num_stages}, "
                         f"got stage ids {list(stage_ids)} for {len(stage_modules)} modules")
    stages = [
        PipelineStage(module, sid, num_stages, device, group=pp_group)
        for module, sid in zip(stage_modules, stage_ids)
    ]
    cls = SCHEDULES[name]
    if name in _MULTI_STAGE:
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)


# ------------------------------------------------------------------------------- the step


class PipelineStepper:
    """Runs one optimizer step's forward and backward through the pipeline.

    ``step(input_ids, labels)`` takes the step's ``n_microbatches`` micro-batches concatenated on
    dim 0 (every rank may pass them; only stage 0 uses the inputs and only the last stage the
    labels) and leaves in the stage parameters the gradient of the mean of micro-batch losses,
    the tied copies already summed, ready for ``clip_grad_norm_`` and ``optimizer.step()``.
    """

    def __init__(
        self,
        stage_modules: Sequence[nn.Module],
        stage_ids: Sequence[int],
        num_stages: int,
        pp_group,
        device: torch.device,
        schedule: str,
        n_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        tied_group=None,
        batch_fn: Callable[[dict], tuple[tuple, dict, torch.Tensor]] | None = None,
        metrics_fn: Callable[[torch.Tensor, torch.Tensor], dict] | None = None,
        metric_names: Sequence[str] = (),
    ):
        self.stage_modules = list(stage_modules)
        self.metrics_fn = metrics_fn
        self.metric_names = tuple(metric_names) if metrics_fn is not None else ()
        self._metric_records: list[torch.Tensor] = []
        self.batch_fn = batch_fn
        self.stage_ids = list(stage_ids)
        self.num_stages = num_stages
        self.pp_group = pp_group
        self.device = torch.device(device)
        self.n_microbatches = int(n_microbatches)
        self.tied_group = tied_group
        self.loss_fn = loss_fn
        self.is_first = 0 in self.stage_ids
        self.is_last = num_stages - 1 in self.stage_ids
        pp_size = dist.get_world_size(pp_group)
        # The last stage sits on pipeline rank (num_stages - 1) % pp = pp - 1.
        self._last_rank = dist.get_global_rank(pp_group, (num_stages - 1) % pp_size)
        self._grad_scaler = None
        self._losses: list[torch.Tensor] = []
        # A stage returns hidden states, not the auxiliary loss: MoE layers back-propagate it themselves.
        self._moe = PipelineMoE(self.stage_modules, pp_group, self.n_microbatches, self.device)
        self.step_metrics: dict = {}
        self.schedule = build_pipeline_schedule(
            self.stage_modules, self.stage_ids, num_stages, pp_group, self.device, schedule,
            self.n_microbatches, self._loss,
        )

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # torch also calls this on placeholder outputs while inferring backward metadata, so
        # the step's losses come from the schedule's `losses` list, not from here.
        loss = self.loss_fn(output, target)
        if self.metric_names:
            metrics = self.metrics_fn(output.detach(), target)
            self._metric_records.append(torch.stack([metrics[k].float() for k in self.metric_names]))
        if self._grad_scaler is not None and torch.is_grad_enabled():
            return self._grad_scaler.scale(loss)
        return loss

    def split_batch(self, batch: dict) -> tuple[tuple, dict, torch.Tensor]:
        """``(first-stage inputs, every-stage kwargs, labels)`` of a loader batch (the model's ``pipeline_batch``)."""
        if self.batch_fn is not None:
            return self.batch_fn(batch)
        return (batch["input_ids"],), {}, batch["labels"]

    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters, each once."""
        return trainable_parameters(self.stage_modules)

    def _check_batch(self, tensor: torch.Tensor, what: str) -> None:
        if tensor.shape[0] % self.n_microbatches:
            raise UsageError(f"{what} has {tensor.shape[0]} rows, not a multiple of the {self.n_microbatches} "
                             f"micro-batches per step; pass num_accumulation_steps micro-batches concatenated")

    def _run(self, fn, inputs, labels: torch.Tensor | None, kwargs: dict | None) -> None:
        args = ()
        if self.is_first:
            if inputs is None:
                raise ValueError("the first pipeline stage needs its inputs (input_ids)")
            inputs = (inputs,) if torch.is_tensor(inputs) else tuple(inputs)
            for i, t in enumerate(inputs):
                self._check_batch(t, "input_ids" if len(inputs) == 1 else f"pipeline input {i}")
            args = tuple(t.to(self.device) for t in inputs)
        target = None
        if self.is_last:
            if labels is None:
                raise ValueError("the last pipeline stage needs labels")
            self._check_batch(labels, "labels")
            target = labels.to(self.device)
        kwargs = {k: v.to(self.device) for k, v in (kwargs or {}).items()}
        for k, v in kwargs.items():
            self._check_batch(v, k)
        self._losses = []
        self._metric_records = []
        fn(*args, target=target, losses=self._losses, **kwargs)

    def _broadcast_losses(self, values: list[float]) -> list[float]:
        t = torch.tensor(values if self.is_last else [0.0] * len(values), dtype=torch.float64, device=self.device)
        if dist.get_world_size(self.pp_group) > 1:
            dist.broadcast(t, src=self._last_rank, group=self.pp_group)
        return t.tolist()

    def step(self, input_ids, labels: torch.Tensor | None, grad_scaler=None,
             broadcast_loss: bool = True, kwargs: dict | None = None) -> torch.Tensor | None:
        """Forward + backward of one step; returns the mean micro-batch loss (a 0-d float64 tensor).

        ``input_ids`` is the first stage's input, a tensor or a tuple of tensors (T5's encoder
        and decoder ids); ``kwargs`` (masks) reach every stage and every rank must pass them.

        The loss is returned on every pipeline rank when ``broadcast_loss`` (for logging), else
        on the last stage only (None elsewhere). With ``grad_scaler`` (fp16) each micro-batch
        loss is scaled before its backward; the returned loss is unscaled. With MoE layers,
        ``step_metrics`` then holds the step's ``moe_aux_loss`` (already in the gradients),
        ``moe_dropped_frac`` and ``moe_load_max`` on every pipeline rank; with ``metrics_fn`` (the
        model's ``pipeline_metrics``), also the micro-batch mean of each of ``metric_names``.
        """
        for m in self.stage_modules:
            m.train()
        self._grad_scaler = grad_scaler
        loss_scale = float(grad_scaler.get_scale()) if grad_scaler is not None else 1.0
        self._moe.begin_step(loss_scale)
        try:
            self._run(lambda *a, **k: self.schedule.step(*a, return_outputs=False, **k), input_ids, labels, kwargs)
        finally:
            self._grad_scaler = None
        sync_tied_weight_grads(self.stage_modules, self.tied_group)
        self.step_metrics = self._moe.step_metrics()
        loss = [0.0] * (1 + len(self.metric_names))
        if self.is_last:
            # Scaling by the loss scale (a power of two) is exact, so dividing it out is too.
            loss[0] = float(torch.stack([l.detach().float() for l in self._losses]).mean()) / loss_scale
            if self.metric_names:
                # The last n: on its first step torch also calls the loss on placeholder outputs.
                loss[1:] = torch.stack(self._metric_records[-self.n_microbatches:]).mean(0).tolist()
        if broadcast_loss:
            loss = self._broadcast_losses(loss)
        elif not self.is_last:
            return None
        self.step_metrics.update(
            {k: torch.tensor(v, dtype=torch.float32) for k, v in zip(self.metric_names, loss[1:])})
        return torch.tensor(loss[0], dtype=torch.float64)

    @torch.no_grad()
    def eval_step(self, input_ids, labels: torch.Tensor | None, kwargs: dict | None = None) -> dict:
        """Forward only; ``{"lm_loss", "nll_sum", "num_tokens"}`` as float tensors on every pipeline rank.

        ``nll_sum`` weights each micro-batch's mean loss by its count of labels other than -100,
        so ``nll_sum / num_tokens`` is the token-weighted mean the perplexity evaluator wants.
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
            chunks = torch.tensor_split(labels, self.n_microbatches, dim=0)
            counts = [float((c != -100).sum()) for c in chunks]
            values = [sum(float(l) * n for l, n in zip(self._losses, counts)), sum(counts)]
        nll, tokens = self._broadcast_losses(values)
        return {
            "lm_loss": torch.tensor(nll / tokens if tokens else 0.0, dtype=torch.float64),
            "nll_sum": torch.tensor(nll, dtype=torch.float64),
            "num_tokens": torch.tensor(tokens, dtype=torch.float64),
        }

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """The one clipper over this rank's stages and the pipeline group, the tied weight counted once."""
        from .clip_grad import clip_grad_norm_

        return clip_grad_norm_(self.parameters(), max_norm, norm_type, self.pp_group,
                               exclude_from_norm=tied_weight_copies(self.stage_modules))
