"""Where a log row goes: ``metrics.json``, TensorBoard and the console line, each a writer with one ``write``.

``hooks.PeriodicWriter`` decides when a row is due and what it holds. A file writer's failed write raises
the ``OSError`` and names its file in ``path``.
"""
from __future__ import annotations

import json
import logging
import os

from ..utils.events import format_bytes, format_eta

logger = logging.getLogger("libai_lite")


class EventWriter:
    """One destination of the trainer's log rows: ``write`` a row of scalars, ``close`` at the end."""

    def write(self, iteration: int, scalars: dict) -> None:
        """Record ``scalars`` (name -> float) for training iteration ``iteration`` (counted from 1)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the writer holds; nothing to do by default."""


class JSONWriter(EventWriter):
    """``metrics.json``: one JSON object per line, its keys sorted, appended to the file of earlier runs.

    A failed write (full disk) cuts the file back to its last whole row before raising."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, "metrics.json")
        # Unbuffered, so a row fails on the spot and close() has nothing left to fail on.
        self._file = open(self.path, "ab", buffering=0)

    def write(self, iteration: int, scalars: dict) -> None:
        row = (json.dumps({"iteration": iteration, **scalars}, sort_keys=True) + "\n").encode()
        size = os.fstat(self._file.fileno()).st_size
        try:
            view = memoryview(row)
            while view:
                view = view[self._file.write(view):]
        except OSError:
            try:
                os.truncate(self.path, size)
            except OSError:
                pass
            raise

    def close(self) -> None:
        self._file.close()


def _event_file(tb) -> str:
    """The path of a SummaryWriter's event file (its directory where tensorboard hides it)."""
    name = getattr(tb._get_file_writer().event_writer, "_file_name", None)
    return os.fsdecode(name) if name else tb.get_logdir()


def _quiet_tensorboard_write_errors() -> None:
    """TensorBoard writes in a thread which, on a full disk, prints its traceback and dies; the same
    error comes back to the writer hook at its next flush, which reports it in one line."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "_libai_lite", False):
        return

    def hook(args):
        if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
            return
        previous(args)

    hook._libai_lite = True
    threading.excepthook = hook


class TensorboardXWriter(EventWriter):
    """TensorBoard event files in the output directory: every scalar of the row but ``consumed_samples``
    (the step axis already counts it), flushed each row. Raises ImportError without tensorboard."""

    def __init__(self, output_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(output_dir)
        _quiet_tensorboard_write_errors()

    @property
    def path(self) -> str:
        """The event file, named in the error of a failed write."""
        return _event_file(self._tb)

    def write(self, iteration: int, scalars: dict) -> None:
        for k, v in scalars.items():
            if k != "consumed_samples":
                self._tb.add_scalar(k, v, iteration)
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()


class CommonMetricPrinter(EventWriter):
    """The console (and log.txt) line of a log row.

    Losses and times are the interval's means (``means``, over ``steps`` steps, marked when more than
    one), so are samples/s and tokens/s derived from them; the rest is the row's (``scalars``): the
    logged step's learning rate, gradient norm and loss scale, TFLOP/s, MFU and peak memory.
    """

    def __init__(self, max_iter: int, global_batch_size: int, tokens_per_sample: int | None):
        self.max_iter = max_iter
        self.global_batch_size = global_batch_size
        self.tokens_per_sample = tokens_per_sample

    def write(self, iteration: int, scalars: dict, means: dict, steps: int) -> None:
        """``means``: the interval's means of the losses to show (in order), ``time`` and ``data_time``."""
        losses = [k for k in means if k not in ("time", "data_time")]
        samples_s = self.global_batch_size / means["time"]
        parts = [f"iteration: {iteration}/{self.max_iter}", f"consumed_samples: {scalars['consumed_samples']}"]
        parts += [f"{k}: {means[k]:.4f}" for k in losses]
        if steps > 1:
            parts[-1] += f" (mean of {steps} steps)"
        parts += [f"lr: {scalars['lr']:.3e}", f"grad_norm: {scalars['grad_norm']:.3f}"]
        if "loss_scale" in scalars:
            parts.append(f"loss_scale: {scalars['loss_scale']:g}")
        parts += [f"time: {means['time']:.4f} s/it", f"data_time: {means['data_time']:.4f} s/it",
                  f"samples/s: {samples_s:.2f}"]
        if self.tokens_per_sample:
            parts.append(f"tokens/s: {samples_s * self.tokens_per_sample:.0f}")
        if "tflops_per_rank" in scalars:
            parts.append(f"TFLOP/s/rank: {scalars['tflops_per_rank']:.3f}")
            if "mfu" in scalars:
                parts.append(f"MFU: {100 * scalars['mfu']:.1f}%")
        parts.append(f"max_mem: {format_bytes(scalars['max_mem_bytes'])}")
        parts.append(f"eta: {format_eta(means['time'] * (self.max_iter - iteration))}")
        logger.info("  ".join(parts))
