"""The training loop: a minimal base whose behaviour is a list of hooks, and the eager step."""
from __future__ import annotations

import logging
import math
import time
import weakref
from contextlib import nullcontext

import torch
from torch.nn.parallel import DistributedDataParallel

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
                h.before_train()
            for self.iter in range(start_iter, max_iter):
                self.storage.begin(self.iter)
                for h in self._hooks:
                    h.before_step()
                self.run_step()
                try:
                    for h in self._hooks:
                        h.after_step()
                except StopTraining as stop:
                    logger.info(str(stop))
                    break
            else:
                # After a full run `iter` equals max_iter, so after_train hooks see the end.
                self.iter += 1
        finally:
            for h in self._hooks:
                h.after_train()

    def run_step(self) -> None:
        raise NotImplementedError


class EagerTrainer(TrainerBase):
    """One optimizer step over `num_accumulation_steps` micro-batches, with AMP and gradient clipping."""

    def __init__(
        self,
        model,
        data_loader,
        optimizer,
        scheduler,
        num_accumulation_steps: int = 1,
        device: torch.device = torch.device("cpu"),
        amp_dtype: torch.dtype | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        clip_grad_max_norm: float | None = None,
        clip_grad_norm_type: float = 2.0,
        max_skipped_nonfinite: int = 0,
    ):
        super().__init__()
        self.model = model
        self.data_loader = data_loader
        self._data_iter = iter(data_loader)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.num_accumulation_steps = num_accumulation_steps
        self.device = device
        self.amp_dtype = amp_dtype
        self.grad_scaler = grad_scaler
        self.clip_grad_max_norm = clip_grad_max_norm
        self.clip_grad_norm_type = clip_grad_norm_type
        self._params = [p for p in model.parameters() if p.requires_grad]
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

    def run_step(self) -> None:
        start = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        self.model.train()
        acc = self.num_accumulation_steps
        data_time = 0.0
        totals: dict[str, torch.Tensor] = {}
        for micro in range(acc):
            t = time.perf_counter()
            batch = self._next_batch()
            data_time += time.perf_counter() - t
            # Gradients are all-reduced once per step, not once per micro-batch.
            sync = (
                self.model.no_sync()
                if isinstance(self.model, DistributedDataParallel) and micro < acc - 1
                else nullcontext()
            )
            with sync:
                with self.autocast():
                    outputs = self.model(**batch)
                losses = {k: v for k, v in outputs.items() if "loss" in k}
                loss = sum(losses.values())
                scaled = loss / acc
                if self.grad_scaler is not None:
                    scaled = self.grad_scaler.scale(scaled)
                scaled.backward()
            for k, v in losses.items():
                totals[k] = totals.get(k, 0.0) + v.detach().float() / acc
        total_loss = float(sum(totals.values()))
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
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
        max_norm = self.clip_grad_max_norm if self.clip_grad_max_norm else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self._params, max_norm, norm_type=self.clip_grad_norm_type)
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
