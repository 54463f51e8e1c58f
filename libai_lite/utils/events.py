"""What the trainer and its hooks record each iteration, and how the log line formats times and sizes."""
from __future__ import annotations

import datetime

import torch


def _kept(value):
    # A device value stays on the device: reading it here would stall the GPU's queue every step.
    return value.detach() if torch.is_tensor(value) else float(value)


def read_scalars(rows: list[dict]) -> list[dict[str, float]]:
    """``rows`` with every tensor value read back as a float: one device-to-host copy per device.

    float64 holds every fp32/bf16/fp16/fp64 value exactly, so the floats are the ones ``float(t)``
    gives, whichever step they came from.
    """
    by_device: dict = {}
    for i, row in enumerate(rows):
        for k, v in row.items():
            if torch.is_tensor(v):
                by_device.setdefault(v.device, []).append((i, k, v))
    out = [dict(row) for row in rows]
    for entries in by_device.values():
        values = torch.stack([v.reshape(()).to(torch.float64) for _, _, v in entries]).tolist()
        for (i, k, _), value in zip(entries, values):
            out[i][k] = value
    return out


class EventStorage:
    """The scalars recorded for the current iteration (the writer hook keeps its own window).

    Values may be device tensors (0-d): they are read back only by ``read_scalars``, at the log period.
    """

    def __init__(self, start_iter: int = 0):
        self.iter = start_iter
        self._latest: dict = {}

    def put_scalar(self, name: str, value) -> None:
        self._latest[name] = _kept(value)

    def put_scalars(self, **kwargs) -> None:
        self._latest.update((k, _kept(v)) for k, v in kwargs.items())

    def latest(self) -> dict:
        """This iteration's values, floats or 0-d tensors (``read_scalars`` turns them into floats)."""
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
