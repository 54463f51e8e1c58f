"""The training loop: a minimal base whose behaviour is a list of hooks, and the one training step."""
from __future__ import annotations

import logging
import math
import sys
import time
import weakref
from contextlib import nullcontext

import torch

from ..optim.container import optimizer_parts
from ..converters.compile import compiled_modules_eager
from ..utils.distributed import set_activity
from ..utils.events import EventStorage
from .amp import autocast_context

logger = logging.getLogger("libai_lite")

# Steps whose device-side skip decisions may wait for a read (the log period's) before one is forced.
_MAX_PENDING = 1000


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
    """Raised by a hook to end training cleanly after the current step (e.g. on SIGTERM, its ``signum``)."""

    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message)
        self.signum = signum


class TrainerBase:
    """Runs `run_step` from `start_iter` to `max_iter`, calling hooks around it (detectron2 style)."""

    def __init__(self):
        self._hooks: list[HookBase] = []
        self.iter = self.start_iter = self.max_iter = 0
        # The first iteration not yet done, where a checkpoint taken now resumes.
        self.next_iter = 0
        # The signal a hook stopped training on (StopTraining.signum), None for a run that trained to the end.
        self.stop_signal: int | None = None
        self.storage: EventStorage | None = None

    def register_hooks(self, hooks) -> None:
        for h in [h for h in hooks if h is not None]:
            # A weak reference avoids a cycle trainer -> hook -> trainer.
            h.trainer = weakref.proxy(self)
            self._hooks.append(h)

    def _call_hooks(self, stage: str) -> None:
        for h in self._hooks:
            # Named so a collective timeout can say which hook (checkpoint save, evaluation) hung.
            set_activity(f"{type(h).__name__}.{stage}", self.iter)
            getattr(h, stage)()

    def train(self, start_iter: int, max_iter: int) -> None:
        """Train on iterations [start_iter, max_iter)."""
        self.iter = self.start_iter = self.next_iter = start_iter
        self.max_iter = max_iter
        self.storage = EventStorage(start_iter)
        self.stop_signal = None
        try:
            self._call_hooks("before_train")
            for self.iter in range(start_iter, max_iter):
                self.storage.begin(self.iter)
                self._call_hooks("before_step")
                with compiled_modules_eager() if self.iter == start_iter else nullcontext():
                    self.run_step()
                self.next_iter = self.iter + 1
                try:
                    self._call_hooks("after_step")
                except StopTraining as stop:
                    logger.info(str(stop))
                    self.stop_signal = stop.signum
                    break
            else:
                # After a full run `iter` equals max_iter, so after_train hooks see the end.
                self.iter += 1
        finally:
            # No set_activity here: after an exception it must still say where the step failed.
            leaving = sys.exc_info()[1]
            for h in self._hooks:
                if leaving is None:
                    h.after_train()
                    continue
                # The error that stopped the run is reported; one met on the way out only goes to the log.
                try:
                    h.after_train()
                except Exception as e:  # noqa: BLE001
                    logger.error(f"{type(h).__name__} failed after the run stopped on an error: {e}")

    def run_step(self) -> None:
        raise NotImplementedError

    def check_skipped(self) -> None:
        """Read back what the steps since the last call decided on the device (hooks call it at the
        log period and before a checkpoint); a trainer that decides nothing there has nothing to do."""


def _own_gradients(model) -> None:
    # A first backward's gradients can be CUDA-graph outputs that the next replay overwrites.
    for p in model.parameters():
        if p.grad is not None:
            p.grad = p.grad.clone()


class Trainer(TrainerBase):
    """One optimizer step over ``num_accumulation_steps`` micro-batches, with AMP and gradient clipping.

    Forward and backward run eagerly, or through ``pipeline``'s schedule with the micro-batches
    concatenated. ``metrics`` is the model's ``output_metrics()``. With ``context_parallel`` each
    micro-batch is cut to this rank's part of the sequence. With ``cuda_graphs`` the outputs and first
    gradients are copied, since the next graph replay overwrites their memory.

    A step reads nothing back from the device. Losses, metrics and the gradient norm are stored as
    tensors, and skipping a step with a NaN/inf loss or norm, or an fp16 overflow, is decided on the
    device. ``check_skipped`` reads those decisions at the log period and stops a diverged run.
    """

    def __init__(self, model, data_loader, optimizer, scheduler, metrics, *, num_accumulation_steps: int = 1,
                 device: torch.device = torch.device("cpu"), amp_dtype: torch.dtype | None = None,
                 grad_scaler: torch.amp.GradScaler | None = None, clip_grad_max_norm: float | None = None,
                 clip_grad_norm_type: float = 2.0, max_skipped_nonfinite: int = 0,
                 min_loss_scale: float | None = None, loss_context=nullcontext,
                 pipeline=None, context_parallel=None, cuda_graphs: bool = False):
        super().__init__()
        self.cuda_graphs = cuda_graphs
        self.model, self.data_loader, self.optimizer, self.scheduler = model, data_loader, optimizer, scheduler
        self._data_iter = iter(data_loader)
        self.metrics = dict(metrics)
        self.num_accumulation_steps, self.device, self.amp_dtype = num_accumulation_steps, device, amp_dtype
        self.grad_scaler, self.loss_context, self.pipeline = grad_scaler, loss_context, pipeline
        self.context_parallel = context_parallel
        self.clip_grad = (clip_grad_max_norm or float("inf"), clip_grad_norm_type)
        # fp32/bf16 runs may skip this many steps whose loss is NaN/inf before stopping.
        self.max_skipped_nonfinite = int(max_skipped_nonfinite or 0)
        self.skipped_nonfinite = 0
        # fp16: an overflow at this loss scale or below is a divergence, not an overflow.
        self.min_loss_scale = min_loss_scale
        # Steps whose skip was decided on the device and not yet read back: (iteration, tensors).
        self._pending: list[tuple[int, dict]] = []
        # Fused Adam/AdamW/SGD skip a step on the device when given `found_inf` (as GradScaler does).
        parts = optimizer_parts(optimizer)
        self._skips_on_device = bool(parts) and all(getattr(o, "_step_supports_amp_scaling", False) for o in parts)
        # Host seconds of the steps since ``take_step_times`` outside backward, where data parallelism's
        # gradient reduction makes every rank wait for the slowest; and the steps they cover.
        self._own_time, self._own_steps, self._backward_time = 0.0, 0, 0.0

    def take_step_times(self) -> tuple[float, int]:
        """This rank's mean host seconds per step outside backward since the last call, and the steps it covers."""
        mean = self._own_time / self._own_steps if self._own_steps else 0.0
        taken = self._own_steps
        self._own_time, self._own_steps = 0.0, 0
        return mean, taken

    def autocast(self):
        """The autocast context for this run's precision (a no-op in fp32)."""
        return autocast_context(self.device, self.amp_dtype)

    def _next_batch(self) -> dict:
        try:
            batch = next(self._data_iter)
        except StopIteration:
            # The split is sized for train_iter steps; wrap around rather than stop mid-run.
            self._data_iter = iter(self.data_loader)
            batch = next(self._data_iter)
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def forward_backward(self, batches: list[dict]) -> dict:
        """Forward and backward over the step's micro-batches; returns each declared metric's step value."""
        if self.pipeline is not None:
            from ..model import loss_name

            batch = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
            inputs, kwargs, labels = self.pipeline.split_batch(batch)
            with self.loss_context(), self.autocast():
                loss = self.pipeline.step(inputs, labels, grad_scaler=self.grad_scaler, kwargs=kwargs)
            return {loss_name(self.metrics): loss.float(), **self.pipeline.step_metrics}
        from ..parallel.data_parallel import no_sync_context

        seen: dict[str, list[torch.Tensor]] = {}
        cp = self.context_parallel
        for micro, batch in enumerate(batches):
            if cp is not None:
                batch = cp.shard_batch(batch)
            # Backward stays inside `sharded()` because recomputed attention gathers again.
            with no_sync_context(self.model, micro == len(batches) - 1), self.loss_context(), \
                    (cp.sharded() if cp is not None else nullcontext()):
                if self.cuda_graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with self.autocast():
                    outputs = self.model(**batch)
                if cp is not None:
                    outputs = cp.reduce_outputs(outputs, self.metrics)
                for k in self.metrics:
                    if k in outputs:
                        kept = outputs[k].detach().float()
                        seen.setdefault(k, []).append(kept.clone() if self.cuda_graphs else kept)
                loss = sum(outputs[k] for k, m in self.metrics.items() if m.backward and k in outputs) / len(batches)
                began = time.perf_counter()
                (loss if self.grad_scaler is None else self.grad_scaler.scale(loss)).backward()
                self._backward_time += time.perf_counter() - began
            if self.cuda_graphs and micro == 0 and len(batches) > 1:
                _own_gradients(self.model)
        combine = {"mean": torch.mean, "sum": torch.sum, "max": torch.max}
        return {k: combine[self.metrics[k].reduce](torch.stack(v)) for k, v in seen.items()}

    def clip_gradients(self) -> torch.Tensor:
        """Clip to ``optim.params.clip_grad_max_norm`` (inf only measures); returns the global gradient norm,
        a 0-d device tensor."""
        if self.pipeline is not None:
            return self.pipeline.clip_grad_norm_(*self.clip_grad)
        from ..parallel.clip_grad import clip_grad_norm_

        return clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], *self.clip_grad)

    def check_skipped(self) -> None:
        """Read the skip decisions since the last call, count them, rewind the schedule over them and warn.
        Past train.max_skipped_nonfinite, raise the error that stops the run."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        from ..utils.events import read_scalars

        skipped = [(it, v) for it, v in zip([it for it, _ in pending], read_scalars([v for _, v in pending]))
                   if v["skipped"]]
        if not skipped:
            return
        for it, v in skipped:
            if "scale_before" in v:
                if self.min_loss_scale is not None and v["scale_before"] <= self.min_loss_scale:
                    raise FloatingPointError(
                        f"fp16 overflow at iteration {it} with the loss scale at {v['scale_before']:g}, at or below "
                        f"train.amp.min_loss_scale={self.min_loss_scale:g}: training diverged (its gradients are "
                        f"NaN or inf at any scale); train in bf16 (train.amp.dtype=bf16), lower optim.lr or enable "
                        f"clipping (optim.params.clip_grad_max_norm), then --resume from the last checkpoint")
                logger.warning(f"fp16 overflow at iteration {it}: step skipped, loss scale "
                               f"{v['scale_before']:g} -> {v['loss_scale']:g}")
                continue
            what = f"loss is {v['total_loss']}" if not math.isfinite(v["total_loss"]) else \
                f"gradient norm is {v['grad_norm']}"
            if self.skipped_nonfinite >= self.max_skipped_nonfinite:
                raise FloatingPointError(
                    f"{what} at iteration {it}: training diverged; lower optim.lr, raise "
                    f"train.warmup_ratio or enable clipping (optim.params.clip_grad_max_norm), then --resume from "
                    f"the last checkpoint (or allow skipping with train.max_skipped_nonfinite=N)"
                )
            self.skipped_nonfinite += 1
            logger.warning(
                f"{what} at iteration {it}: batch skipped without an optimizer step "
                f"({self.skipped_nonfinite}/{self.max_skipped_nonfinite} allowed by train.max_skipped_nonfinite)"
            )
        self._rewind_schedule(len(skipped))
        if skipped[-1][0] == self.storage.iter:
            self._mark_skipped_row()

    def _mark_skipped_row(self) -> None:
        self.storage.put_scalars(skipped=1.0, **({} if self.grad_scaler else {"grad_norm": float("nan")}))

    def _rewind_schedule(self, steps: int) -> None:
        # A skipped step must not advance the schedule; schedules are pure functions of the iteration.
        self.scheduler.last_epoch -= steps + 1
        self.scheduler.step()

    def _optimizer_step(self, found_inf: torch.Tensor) -> None:
        """One optimizer step that the optimizer itself skips where ``found_inf`` is 1 (no host read)."""
        parts = optimizer_parts(self.optimizer)
        for o in parts:
            o.found_inf = found_inf
        try:
            self.optimizer.step()
        finally:
            for o in parts:
                del o.found_inf

    def run_step(self) -> None:
        start = time.perf_counter()
        groups = self.optimizer.param_groups
        scalars = {"lr": groups[0]["lr"]}
        decoupled = next((g["lr"] for g in groups if g.get("decoupled")), None)
        if decoupled is not None:  # optim.params.decoupled_lr: the embedding and output layer's own
            scalars["decoupled_lr"] = decoupled
        self.model.train()
        set_activity("data loading", self.iter)
        batches = [self._next_batch() for _ in range(self.num_accumulation_steps)]
        scalars["data_time"] = time.perf_counter() - start
        set_activity("forward/backward (gradient reduction)", self.iter)
        totals = self.forward_backward(batches)
        scalars.update(totals)
        total_loss = sum(v for k, v in totals.items() if k in self.metrics and self.metrics[k].backward)
        scalars["total_loss"] = total_loss
        set_activity("gradient clipping and optimizer step", self.iter)
        scaler = self.grad_scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        scalars["grad_norm"] = grad_norm = self.clip_gradients()
        if scaler is not None:
            # A step whose gradients overflowed lowers the scale: both scales are read at the log period.
            scale_before = scaler._get_scale_async().clone()
            scaler.step(self.optimizer)
            scaler.update()
            scale = scaler._get_scale_async().clone()
            skipped = (scale < scale_before).float()
            scalars.update(loss_scale=scale, skipped=skipped)
            self._pending.append((self.iter, {"skipped": skipped, "scale_before": scale_before, "loss_scale": scale}))
        else:
            # fp32/bf16: a NaN/inf loss or gradient norm skips the step, decided on the device.
            finite = torch.isfinite(total_loss.to(grad_norm.device)) & torch.isfinite(grad_norm)
            found_inf = (~finite).float()
            self._pending.append((self.iter, {"skipped": found_inf, "total_loss": total_loss, "grad_norm": grad_norm}))
            if self._skips_on_device:
                self._optimizer_step(found_inf)
            else:
                # This optimizer cannot skip on the device: decide now, with one read, before it steps.
                taken = self.skipped_nonfinite
                self.check_skipped()
                skipped_now = self.skipped_nonfinite > taken
                if not skipped_now:
                    self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        elapsed = time.perf_counter() - start
        self.storage.put_scalars(**scalars, time=elapsed)
        self._own_time += elapsed - self._backward_time
        self._own_steps += 1
        self._backward_time = 0.0
        if scaler is None and not self._skips_on_device and skipped_now:
            self._mark_skipped_row()
        if len(self._pending) >= _MAX_PENDING:
            # No log line has read them (a loop without the writer hook): read now rather than pile up.
            self.check_skipped()
