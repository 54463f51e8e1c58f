"""Metric storage and writers: the log line, `metrics.json` and TensorBoard event files."""
from __future__ import annotations

import datetime
import json
import logging
from collections import defaultdict

logger = logging.getLogger("libai_lite")


class EventStorage:
    """Scalars recorded by the trainer and hooks for the current iteration, plus their history."""

    def __init__(self, start_iter: int = 0):
        self.iter = start_iter
        self._latest: dict[str, float] = {}
        self._history: dict[str, list[tuple[int, float]]] = defaultdict(list)

    def put_scalar(self, name: str, value: float) -> None:
        value = float(value)
        self._latest[name] = value
        self._history[name].append((self.iter, value))
        # Bounded history: writers only need recent windows.
        if len(self._history[name]) > 2000:
            del self._history[name][:1000]

    def put_scalars(self, **kwargs) -> None:
        for k, v in kwargs.items():
            self.put_scalar(k, v)

    def latest(self) -> dict[str, float]:
        return dict(self._latest)

    def median(self, name: str, window: int = 20) -> float | None:
        values = [v for _, v in self._history.get(name, [])[-window:]]
        if not values:
            return None
        values.sort()
        return values[len(values) // 2]

    def begin(self, iteration: int) -> None:
        """Start recording `iteration`: `latest()` holds only what this iteration records."""
        self.iter = iteration
        self._latest = {}


class JSONWriter:
    """Appends one JSON object per logged iteration to `metrics.json` with the raw values."""

    def __init__(self, path: str):
        self._file = open(path, "a")

    def write(self, iteration: int, scalars: dict) -> None:
        self._file.write(json.dumps({"iteration": iteration, **scalars}, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorboardWriter:
    """Scalars into TensorBoard event files in the output directory."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir)

    def write(self, iteration: int, scalars: dict) -> None:
        for k, v in scalars.items():
            self._writer.add_scalar(k, v, iteration)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


def format_bytes(n: float) -> str:
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit in ("B", "K") else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"
