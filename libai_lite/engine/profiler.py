"""``train.profile``: a ``torch.profiler`` Chrome trace (and on CUDA a memory snapshot) of chosen training steps.

Each rank skips ``wait`` steps from the run's first, warms up ``warmup``, traces ``active``, ``repeat`` times,
and writes ``OUTPUT_DIR/profile/trace_iterNNNNNNN_rankR.json`` named after the last step traced.
``memory_snapshot`` also dumps the CUDA allocator's history over the same steps beside the trace.
"""
from __future__ import annotations

import logging
import os
import time

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from ..run_sections import ProfileSettings
from ..utils.distributed import get_rank
from ..utils.errors import UsageError
from .trainer import HookBase

logger = logging.getLogger("libai_lite")

# Allocation events the CUDA memory history keeps (torchtitan's figure): enough for a few large steps.
_MEMORY_HISTORY_ENTRIES = 100_000


class ProfilerHook(HookBase):
    """Runs ``torch.profiler`` over the steps its ``ProfileSettings`` select. Register it last, so each
    traced step spans the iteration's hooks too.
    """

    def __init__(self, output_dir: str, device: torch.device, settings: ProfileSettings = ProfileSettings()):
        self.device = torch.device(device)
        if settings.memory_snapshot and self.device.type != "cuda":
            raise UsageError(f"train.profile.memory_snapshot=True records the CUDA allocator, and this run trains on "
                             f"{self.device.type}: set train.profile.memory_snapshot=False (the Chrome trace is "
                             f"still written)")
        self.directory = os.path.join(output_dir, "profile")
        self.memory_snapshot = bool(settings.memory_snapshot)
        self._schedule = torch.profiler.schedule(wait=int(settings.wait), warmup=int(settings.warmup),
                                                 active=int(settings.active), repeat=int(settings.repeat))
        self.cycles, self.done = int(settings.repeat), 0
        self._first = self._current = 0
        self._profiler = None
        self._recording_memory = False
        self.written: list[str] = []

    def _action(self, iteration: int) -> ProfilerAction:
        # Negative only for the profiler's own probe at step 0, before the step counter is moved
        # to the run's first iteration.
        return self._schedule(max(iteration - self._first, 0))

    def before_train(self):
        self._first = self.trainer.start_iter
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._profiler = torch.profiler.profile(activities=activities, schedule=self._action,
                                                on_trace_ready=self._write)
        # Step labels (ProfilerStep#N) and the schedule in the log's iteration numbers.
        self._profiler.step_num = self._first
        self._profiler.start()

    def before_step(self):
        self._current = self.trainer.iter
        if (self.memory_snapshot and not self._recording_memory and self._profiler is not None
                and self._action(self.trainer.iter) != ProfilerAction.NONE):
            torch.cuda.memory._record_memory_history(max_entries=_MEMORY_HISTORY_ENTRIES)
            self._recording_memory = True

    def after_step(self):
        if self._profiler is None:
            return
        if self.trainer.iter + 1 >= self.trainer.max_iter:
            # The last step: a trace still open ends with it, not with what runs after the loop.
            self.after_train()
            return
        self._profiler.step()
        if self.done >= self.cycles:
            # Every cycle is written: no profiler overhead for the rest of the run.
            self._profiler.stop()
            self._profiler = None

    def after_train(self):
        if self._profiler is not None:
            # A run that ends inside the window writes what it traced.
            self._profiler.stop()
            self._profiler = None
        self._stop_memory_history()

    def _write(self, prof) -> None:
        """on_trace_ready: write this rank's Chrome trace (and memory snapshot) of the cycle just traced."""
        last = self._current  # the last step begun: the trace ends with it
        os.makedirs(self.directory, exist_ok=True)
        tag = f"iter{last:07d}_rank{get_rank()}"
        path = os.path.join(self.directory, f"trace_{tag}.json")
        t = time.perf_counter()
        prof.export_chrome_trace(path)
        self.written.append(path)
        if self._recording_memory:
            snapshot = os.path.join(self.directory, f"memory_snapshot_{tag}.pickle")
            torch.cuda.memory._dump_snapshot(snapshot)
            self._stop_memory_history()
            self.written.append(snapshot)
        self.done += 1
        logger.info(f"Profiler trace of iterations up to {last} written to {path} in {time.perf_counter() - t:.2f}s")

    def _stop_memory_history(self) -> None:
        if self._recording_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False
