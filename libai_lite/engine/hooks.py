"""Hooks that make up the trainer's behaviour: timing, checkpoints, evaluation, signals, writers."""
from __future__ import annotations

import logging
import math
import signal
import sys
import time

import torch

from ..utils.distributed import (all_reduce_max, all_reduce_mean, all_reduce_sum, broadcast_object, get_rank,
                                 is_main_process)
from ..utils.errors import UsageError, write_error
from ..utils.events import format_eta, read_scalars
from ..utils.flops import achieved_tflops
from ..utils.process import defer_stop_signals, fail_at_step_boundary, pending_failure, stop_requested
from .trainer import HookBase, StopTraining
from .writers import CommonMetricPrinter, JSONWriter, TensorboardXWriter

logger = logging.getLogger("libai_lite")


def peak_memory_bytes(device: torch.device) -> float:
    """Peak allocated accelerator memory, or the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    import resource

    # ru_maxrss is in KiB on Linux.
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class PeriodicCheckpointer(HookBase):
    """Saves `model_XXXXXXX` every `period` iterations and `model_final` at the end.

    With `async_save` a save returns once the state is staged, and a later step publishes it when the
    background write is done. A failed write stops every rank at the step boundary. The run never ends
    before the write in flight has finished.
    """

    def __init__(self, checkpointer, period: int):
        self.checkpointer = checkpointer
        self.period = int(period)
        self._ending = False

    def after_step(self):
        self._poll()
        it = self.trainer.iter
        if self.period > 0 and (it + 1) % self.period == 0 and it + 1 < self.trainer.max_iter:
            self.save(f"model_{it:07d}")

    def _poll(self) -> None:
        try:
            self.checkpointer.poll()
        except UsageError as e:
            # Ranks see the write end at different steps: all stop together at the boundary.
            fail_at_step_boundary(e)

    def after_train(self):
        # Every later save blocks, since nothing after the loop waits for a background write.
        self._ending = True
        # Only a run that reached the end writes model_final; a crash must not label itself final.
        if self.trainer.iter >= self.trainer.max_iter:
            self.save("model_final", blocking=True)
            return
        # Stopped or failing: finish the background write so the process exits with it published.
        leaving = sys.exc_info()[1]
        try:
            self.checkpointer.wait(collective=False)
        except UsageError as e:
            if leaving is None:
                raise
            # The exception already leaving is the one reported; a different one goes to the log.
            if str(e) != str(leaving):
                logger.error(str(e))

    def save(self, name: str, blocking: bool = False) -> None:
        """Save checkpoint ``name`` (in the background with async_save, unless ``blocking``)."""
        # A save reads the device anyway: the steps' skip decisions first, so no diverged state is saved.
        self.trainer.check_skipped()
        t = time.perf_counter()
        path = self.checkpointer.save(name, blocking=blocking or self._ending)
        if self.checkpointer.in_flight == name:
            logger.info(f"Checkpoint {path} staged in {time.perf_counter() - t:.2f}s, writing in the background")
        else:
            logger.info(f"Saved checkpoint {path} in {time.perf_counter() - t:.2f}s")


class SignalCheckpointer(HookBase):
    """At each step boundary all ranks agree whether to stop. After SIGTERM, SIGINT or SIGHUP on any rank
    it saves a checkpoint and stops; after a rank-local failure it stops every rank with that rank's error.
    The handler in ``libai_lite.utils.process`` only records the signal during training.
    """

    def __init__(self, periodic: PeriodicCheckpointer):
        self.periodic = periodic

    def before_train(self):
        defer_stop_signals(True)

    def after_step(self):
        received, failure = stop_requested(), pending_failure()
        # One collective for both questions, so no rank enters the save's collectives alone; every rank
        # learns the signal (the highest number if several). The lowest failing rank's error is reported.
        signalled, failed = all_reduce_max([float(received or 0),
                                            -float(get_rank()) if failure is not None else -math.inf])
        if failed > -math.inf:
            src = int(-failed)
            message = broadcast_object(str(failure) if get_rank() == src else None, src=src)
            raise UsageError(message) from failure
        if signalled > 0:
            it = self.trainer.iter
            # Blocking: the job may be killed soon after the stop, and a failed write must stop it here.
            self.periodic.save(f"model_{it:07d}", blocking=True)
            name = signal.Signals(int(signalled)).name
            raise StopTraining(f"Stopped by {name} after iteration {it}; resume with --resume", int(signalled))

    def after_train(self):
        # Runs last, after the final checkpoint: a signal during that save waited for it to finish.
        defer_stop_signals(False)


class EvalHook(HookBase):
    """Runs `eval_fn` every `eval_period` iterations and after the last one, storing its results as `valid/*`.

    With `save_best`, a function taking a checkpoint name, `model_best` is due whenever `metric` improves
    in `mode` "min" or "max". `BestCheckpointer` saves it after the step's metrics row is written.
    """

    def __init__(self, eval_period: int, eval_fn, *, save_best=None, metric: str | None = "PPL", mode: str = "min"):
        if mode not in ("min", "max"):
            raise UsageError(f"train.evaluation.eval_mode must be 'min' or 'max', not {mode!r}")
        self.period = int(eval_period)
        self.eval_fn = eval_fn
        self.save_best, self.metric, self.mode = save_best, metric, mode
        self.best: float | None = None
        self._best_due = False

    def _run(self):
        from ..evaluation.evaluator import EvaluationStopped

        try:
            results = self.eval_fn()
        except EvaluationStopped as stop:
            # SignalCheckpointer (this step) or the final checkpoint (after training) saves, then the run stops.
            logger.warning(f"{stop}: no valid metrics this time; checkpointing, then stopping")
            return
        for k, v in results.items():
            self.trainer.storage.put_scalar(f"valid/{k}", v)
        value = results.get(self.metric)
        if self.save_best is not None and self.metric not in results:
            raise UsageError(f"train.evaluation.eval_metric={self.metric!r} is not a metric the evaluator gives "
                             f"({', '.join(map(str, results)) or 'none'}), so model_best would never be saved; set it "
                             f"to one of those, or null to save no model_best")
        if self.save_best is None or value is None or not math.isfinite(value):
            return
        if self.best is None or (value < self.best if self.mode == "min" else value > self.best):
            self.best = value
            self._best_due = True

    def save_due_best(self) -> None:
        """Save `model_best` if the last evaluation improved the metric (once)."""
        if self._best_due:
            self._best_due = False
            logger.info(f"New best {self.metric} {self.best:.4f}: checkpointing model_best")
            self.save_best("model_best")

    def after_step(self):
        it = self.trainer.iter + 1
        if self.period > 0 and it % self.period == 0 and it != self.trainer.max_iter:
            self._run()

    def after_train(self):
        if self.trainer.iter >= self.trainer.max_iter:
            self._run()


class BestCheckpointer(HookBase):
    """Saves the `model_best` an `EvalHook` found due, after the step's metrics row is written."""

    def __init__(self, eval_hook: EvalHook):
        self.eval_hook = eval_hook

    def after_step(self):
        self.eval_hook.save_due_best()

    def after_train(self):
        self.eval_hook.save_due_best()


class IterationTimer(HookBase):
    """Tracks total training time so the end-of-run summary can report it."""

    def before_train(self):
        self._start = time.perf_counter()

    def after_train(self):
        total = time.perf_counter() - self._start
        done = self.trainer.iter - self.trainer.start_iter
        if done > 0:
            logger.info(f"Total training time: {format_eta(total)} ({total / done:.4f} s / it over {done} iterations)")


class PeriodicWriter(HookBase):
    """Every `period` iterations and after the last, rank 0 writes the console line, `metrics.json`,
    TensorBoard and, when given, W&B, with a tqdm bar on a terminal.

    The console shows this rank's means since the last log. `metrics.json` holds the logged step's values
    reduced over data-parallel ranks as `metrics` declares, plus each mean-reduced loss's interval mean as
    `<key>_window_mean`. Device values are read back only once per log line. With a ``StragglerWatch``,
    the line names a rank persistently slower than the others.
    """

    def __init__(self, *, output_dir: str, period: int, global_batch_size: int, tokens_per_sample: int | None,
                 flops_per_sample: float | None, peak_flops: float | None, consumed_fn, layout, metrics,
                 wandb=None, stragglers=None):
        self.period = max(int(period), 1)
        self.global_batch_size = global_batch_size
        self.tokens_per_sample, self.flops_per_sample, self.peak_flops = tokens_per_sample, flops_per_sample, peak_flops
        self.consumed_fn = consumed_fn
        self.layout = layout
        self.metrics = dict(metrics)
        self.main = is_main_process()
        self._failed: UsageError | None = None
        # The file writers, in the order a row reaches them: metrics.json first, the record a resume reads.
        self._files: list = []
        self._wandb = wandb
        self._stragglers = stragglers
        self._printer: CommonMetricPrinter | None = None
        if self.main:
            self._files.append(JSONWriter(output_dir))
            try:
                self._files.append(TensorboardXWriter(output_dir))
            except ImportError:
                logger.warning("tensorboard is not installed: no event files will be written")
        self._window: list[dict] = []
        self._bar = None

    def before_train(self):
        if self.main:
            self._printer = CommonMetricPrinter(self.trainer.max_iter, self.global_batch_size, self.tokens_per_sample)
        if self.main and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=self.trainer.max_iter, initial=self.trainer.start_iter, unit="it",
                             dynamic_ncols=True)

    def _record(self, iteration: int, scalars: dict) -> None:
        """One metrics.json row and its TensorBoard scalars; a failed write (full disk) stops the run
        at the step boundary with one error line, metrics.json cut back to its last whole row."""
        if self._failed is not None:
            return
        for writer in self._files:
            try:
                writer.write(iteration, scalars)
            except OSError as e:
                self._failed = write_error(writer.path, e)
                fail_at_step_boundary(self._failed)
                return
        # Only after the row is safely in metrics.json.
        if self._wandb is not None:
            self._wandb.write(iteration, scalars)

    def _record_valid(self, iteration: int) -> None:
        """Evaluation results stored after the step's log line (or on a step not logged) still get a row."""
        valid = {k: v for k, v in self.trainer.storage.latest().items() if k.startswith("valid/")}
        if self.main and valid:
            self._record(iteration, read_scalars([valid])[0])

    def after_step(self):
        self._window.append(self.trainer.storage.latest())
        if self._bar is not None:
            self._bar.update(1)
        it = self.trainer.iter
        if (it + 1) % self.period == 0 or it + 1 == self.trainer.max_iter:
            self._write()
        else:
            self._record_valid(it + 1)

    def _write(self):
        # The interval's one read of device values, after the trainer reads its skip decisions.
        waited = time.perf_counter()
        self.trainer.check_skipped()
        latest, *window = read_scalars([self.trainer.storage.latest(), *self._window])
        # The steps only queued their work; the device's remaining time is charged to the logged step.
        waited = time.perf_counter() - waited
        latest["time"] += waited
        window[-1]["time"] += waited
        self._window = []
        keys = ["total_loss"] + [k for k in self.metrics if k in latest]
        means = {f"{k}_window_mean": sum(w.get(k, 0.0) for w in window) / len(window) for k in keys
                 if k not in self.metrics or self.metrics[k].reduce == "mean"}
        raw = {**latest, **self._reduce_over_dp({**{k: latest[k] for k in keys}, **means})}
        if self._stragglers is not None:
            # Host floats over the control group, on every rank: no device read.
            named = self._stragglers.observe(*self.trainer.take_step_times())
            if named and self.main:
                logger.warning(named)
        if not self.main:
            return
        it, batch = self.trainer.iter, self.global_batch_size
        mean = {k: sum(w.get(k, 0.0) for w in window) / len(window) for k in keys + ["time", "data_time"]}
        samples_s = batch / mean["time"]
        raw.update(consumed_samples=self.consumed_fn(), samples_per_sec=batch / raw["time"],
                   max_mem_bytes=peak_memory_bytes(self.layout.device))
        if self.tokens_per_sample:
            raw["tokens_per_sec"] = batch * self.tokens_per_sample / raw["time"]
        if self.flops_per_sample:
            raw["tflops_per_rank"], mfu = achieved_tflops(samples_s, self.flops_per_sample, self.layout.world_size,
                                                          self.peak_flops)
            if mfu is not None:
                raw["mfu"] = mfu
        self._printer.write(it + 1, raw, mean, len(window))
        self._record(it + 1, raw)

    def _reduce_over_dp(self, values: dict) -> dict:
        out = {}
        for reduce, fn in (("mean", all_reduce_mean), ("sum", all_reduce_sum), ("max", all_reduce_max)):
            keys = [k for k in values if (self.metrics[k].reduce if k in self.metrics else "mean") == reduce]
            if keys:
                out.update(zip(keys, fn([values[k] for k in keys], group=self.layout.group("dp"))))
        return out

    def after_train(self):
        # Evaluation at the end stores valid/* after the last log line; record it too.
        if self._failed is None:
            self._record_valid(self.trainer.iter)
        json_path = self._files[0].path if self._files else None
        for closing in (self._bar, *self._files, self._wandb):
            try:
                if closing is not None:
                    closing.close()
            except OSError as e:
                # After a failed write, closing fails the same way: the first error is the one to report.
                if self._failed is None:
                    self._failed = write_error(getattr(closing, "path", json_path), e)
                    raise self._failed from e


def hooks_in_order(timer: IterationTimer, writer: PeriodicWriter, checkpointer: PeriodicCheckpointer,
                   signal_checkpointer: SignalCheckpointer, evaluation: EvalHook | None = None,
                   best: BestCheckpointer | None = None, profiler: HookBase | None = None) -> list[HookBase]:
    """The trainer's hooks in the order each step runs them, those given as None left out.

    The timer comes first so the total time spans the others. Evaluation precedes the writer so its
    ``valid/*`` results join the step's metrics row. The writer precedes both checkpointers, so a kill
    between row and checkpoint resumes at a step that metrics.json already holds. The signal
    checkpointer follows them, and the profiler comes last so a traced step spans its hooks.
    """
    ordered = [timer, evaluation, writer, checkpointer, best, signal_checkpointer, profiler]
    return [h for h in ordered if h is not None]
