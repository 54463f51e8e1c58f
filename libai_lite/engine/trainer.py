"""The training loop: a minimal base whose behaviour is a list of hooks, and the one training step."""
from __future__ import annotations

import logging
import math
import time
import weakref
from contextlib import nullcontext

import torch

from ..utils.distributed import set_activity
from ..utils.events import EventStorage

logger = logging.getLogger("libai_lite")


class HookBase:
    """Called around training and around each step; `self.trainer` is set on registration."""

    trainer = None

    def before_train(self):
        pass

    def after_train(self):
        pass

    def before_step(self):
        pass

    def after_step(self):
        pass


class StopTraining(Exception):
    """Raised by a hook to end training cleanly after the current step (e.g. on SIGTERM)."""


class TrainerBase:
    """Runs `run_step` from `start_iter` to `max_iter`, calling hooks around it (detectron2 style)."""

    def __init__(self):
        self._hooks: list[HookBase] = []
        self.iter = 0
        self.start_iter = 0
        self.max_iter = 0
        self.storage: EventStorage | None = None

    def register_hooks(self, hooks) -> None:
        for h in hooks:
            if h is None:
                continue
            # A weak reference avoids a cycle trainer -> hook -> trainer.
            h.trainer = weakref.proxy(self)
            self._hooks.append(h)

    def train(self, start_iter: int, max_iter: int) -> None:
        """Train on iterations [start_iter, max_iter)."""
        self.iter = self.start_iter = start_iter
        self.max_iter = max_iter
        self.storage = EventStorage(start_iter)
        try:
            for h in self._hooks:
                set_activity(f"{type(h).__name__}.before_train")
                h.before_train()
            for self.iter in range(start_iter, max_iter):
                self.storage.begin(self.iter)
                for h in self._hooks:
                    set_activity(f"{type(h).__name__}.before_step", self.iter)
                    h.before_step()
                self.run_step()
                try:
                    for h in self._hooks:
                        # Named so a collective timeout can say which hook (checkpoint save, evaluation) hung.
                        set_activity(f"{type(h).__name__}.after_step", self.iter)
                        h.after_step()
                except StopTraining as stop:
                    logger.info(str(stop))
                    break
            else:
                # After a full run `iter` equals max_iter, so after_train hooks see the end.
                self.iter += 1
        finally:
            # No set_activity here: after an exception it must still say where the step failed.
            for h in self._hooks:
                h.after_train()

    def run_step(self) -> None:
        raise NotImplementedError


def _combine(values: list[torch.Tensor], reduce: str) -> torch.Tensor:
    """One step's value of a metric from its micro-batches' values."""
    stacked = torch.stack([v.detach().float() for v in values])
    return {"mean": stacked.mean, "sum": stacked.sum, "max": stacked.max}[reduce]()


class Trainer(TrainerBase):
    """One optimizer step over ``num_accumulation_steps`` micro-batches, with AMP and gradient clipping.

    Forward and backward run eagerly on a plain, DDP, FSDP2 or tensor-parallel model, or, when
    ``pipeline`` (a ``PipelineStepper``) is given, through its schedule with the micro-batches
    concatenated; the rest of the step (non-finite checks, one clipper, loss scaling, optimizer
    and schedule) is the same. ``metrics`` is the model's ``output_metrics()``: the entries
    back-propagated and how each logged value combines over micro-batches.
    """

    def __init__(
        self,
        model,
        data_loader,
        optimizer,
        scheduler,
        metrics,
        num_accumulation_steps: int = 1,
        device: torch.device = torch.device("cpu"),
        amp_dtype: torch.dtype | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        clip_grad_max_norm: float | None = None,
        clip_grad_norm_type: float = 2.0,
        max_skipped_nonfinite: int = 0,
        loss_context=nullcontext,
        params=None,
        pipeline=None,
        pp_group=None,
    ):
        super().__init__()
        self.model = model
        self.data_loader = data_loader
        self._data_iter = iter(data_loader)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.metrics = dict(metrics)
        self.num_accumulation_steps = num_accumulation_steps
        self.device = device
        self.amp_dtype = amp_dtype
        self.grad_scaler = grad_scaler
        self.clip_grad_max_norm = clip_grad_max_norm
        self.clip_grad_norm_type = clip_grad_norm_type
        self.loss_context = loss_context
        self.pipeline = pipeline
        self.pp_group = pp_group
        params = model.parameters() if params is None else params
        self._params = [p for p in params if p.requires_grad]
        # fp32/bf16 runs may skip this many steps whose loss is NaN/inf before stopping.
        self.max_skipped_nonfinite = int(max_skipped_nonfinite or 0)
        self.skipped_nonfinite = 0

    def autocast(self):
        """The autocast context for this run's precision (a no-op in fp32)."""
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def _next_batch(self) -> dict:
        try:
            batch = next(self._data_iter)
        except StopIteration:
            # The GPT dataset is sized for train_iter steps; an exhausted loader means the
            # caller asked for more, so wrap around rather than stop mid-run.
            self._data_iter = iter(self.data_loader)
            batch = next(self._data_iter)
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def forward_backward(self, batches: list[dict]) -> dict:
        """Forward and backward over the step's micro-batches; returns each declared metric's step value."""
        if self.pipeline is not None:
            return self._pipeline_forward_backward(batches)
        from ..parallel.data_parallel import no_sync_context

        acc = len(batches)
        seen: dict[str, list[torch.Tensor]] = {}
        for micro, batch in enumerate(batches):
            # Gradients are reduced across data-parallel ranks once per step, on the last micro-batch.
            with no_sync_context(self.model, micro == acc - 1), self.loss_context():
                with self.autocast():
                    outputs = self.model(**batch)
                losses = [outputs[k] for k, m in self.metrics.items() if m.backward and k in outputs]
                scaled = sum(losses) / acc
                if self.grad_scaler is not None:
                    scaled = self.grad_scaler.scale(scaled)
                scaled.backward()
            for k in self.metrics:
                if k in outputs:
                    seen.setdefault(k, []).append(outputs[k])
        return {k: _combine(v, self.metrics[k].reduce) for k, v in seen.items()}

    def _pipeline_forward_backward(self, batches: list[dict]) -> dict:
        from ..model import loss_name

        batch = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        inputs, kwargs, labels = self.pipeline.split_batch(batch)
        with self.loss_context(), self.autocast():
            loss = self.pipeline.step(inputs, labels, grad_scaler=self.grad_scaler, kwargs=kwargs)
        return {loss_name(self.metrics): loss.float(), **self.pipeline.step_metrics}

    def clip_gradients(self, max_norm: float) -> float:
        """Clip to ``max_norm`` (inf only measures); returns the global gradient norm."""
        from ..parallel.clip_grad import clip_grad_norm_
        from ..parallel.pipeline_split import tied_weight_copies

        # A pipelined tied weight is held twice (embedding and head copy): counted once.
        exclude = tied_weight_copies(self.pipeline.stage_modules) if self.pipeline is not None else ()
        return clip_grad_norm_(self._params, max_norm, self.clip_grad_norm_type, self.pp_group,
                               exclude_from_norm=exclude)

    def run_step(self) -> None:
        start = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        self.model.train()
        data_time = time.perf_counter()
        set_activity("data loading", self.iter)
        batches = [self._next_batch() for _ in range(self.num_accumulation_steps)]
        data_time = time.perf_counter() - data_time
        set_activity("forward/backward (gradient reduction)", self.iter)
        totals = self.forward_backward(batches)
        total_loss = float(sum(v for k, v in totals.items() if self.metrics.get(k) is not None
                               and self.metrics[k].backward))
        if not math.isfinite(total_loss) and self.grad_scaler is None:
            # fp16 runs leave this to the loss scaler, which skips overflowed steps itself.
            if self.skipped_nonfinite < self.max_skipped_nonfinite:
                self.skipped_nonfinite += 1
                self.optimizer.zero_grad(set_to_none=True)
                logger.warning(
                    f"loss is {total_loss} at iteration {self.iter}: batch skipped without an optimizer step "
                    f"({self.skipped_nonfinite}/{self.max_skipped_nonfinite} allowed by train.max_skipped_nonfinite)"
                )
                self.storage.put_scalars(total_loss=total_loss, lr=lr, grad_norm=float("nan"),
                                         time=time.perf_counter() - start, data_time=data_time, skipped=1.0)
                return
            raise FloatingPointError(
                f"loss is {total_loss} at iteration {self.iter}: training diverged; lower optim.lr, raise "
                f"train.warmup_ratio or enable clipping (optim.params.clip_grad_max_norm), then --resume from the "
                f"last checkpoint (or allow skipping with train.max_skipped_nonfinite=N)"
            )
        set_activity("gradient clipping and optimizer step", self.iter)
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
        max_norm = self.clip_grad_max_norm if self.clip_grad_max_norm else float("inf")
        grad_norm = self.clip_gradients(max_norm)
        skipped = False
        if self.grad_scaler is not None:
            scale_before = self.grad_scaler.get_scale()
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
            skipped = self.grad_scaler.get_scale() < scale_before
            if skipped:
                logger.warning(
                    f"fp16 overflow at iteration {self.iter}: step skipped, loss scale {scale_before:g} -> "
                    f"{self.grad_scaler.get_scale():g}"
                )
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # As in Megatron, a skipped step does not advance the schedule.
        if not skipped:
            self.scheduler.step()
        metrics = {k: float(v) for k, v in totals.items()}
        metrics.update(
            total_loss=total_loss,
            lr=lr,
            grad_norm=float(grad_norm),
            time=time.perf_counter() - start,
            data_time=data_time,
        )
        if self.grad_scaler is not None:
            metrics.update(loss_scale=self.grad_scaler.get_scale(), skipped=float(skipped))
        self.storage.put_scalars(**metrics)
