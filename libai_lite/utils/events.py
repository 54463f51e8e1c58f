"""What the trainer and its hooks record each iteration, and how the log line formats times and sizes."""
from __future__ import annotations

import datetime


class EventStorage:
    """The scalars recorded for the current iteration (the writer hook keeps its own window)."""

    def __init__(self, start_iter: int = 0):
        self.iter = start_iter
        self._latest: dict[str, float] = {}

    def put_scalar(self, name: str, value: float) -> None:
        self._latest[name] = float(value)

    def put_scalars(self, **kwargs) -> None:
        self._latest.update((k, float(v)) for k, v in kwargs.items())

    def latest(self) -> dict[str, float]:
        return dict(self._latest)

    def begin(self, iteration: int) -> None:
        """Start recording `iteration`: `latest()` holds only what this iteration records."""
        self.iter = iteration
        self._latest = {}


def format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


def format_bytes(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024:
            return f"{n:.0f}{unit}" if unit in ("B", "K") else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"
