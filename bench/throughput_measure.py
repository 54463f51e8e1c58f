"""How ``train_throughput.py`` measures: interleaved timed blocks, a per-kind CPU profile of a step, the peak
FLOP/s MFU is taken against."""
from __future__ import annotations

import math
import time

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer reads finished steps."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_blocks(steppers: dict, steps: int, blocks: int, warmup: int, tokens_per_step: int,
               device: torch.device, between=None) -> dict:
    """Tokens/s of each stepper per block, the order flipped every block (A B, B A, ...).

    ``between()`` runs after every block (the CPU peak is re-measured there, so a busy moment at
    the start does not set it).
    """
    for s in steppers.values():
        for _ in range(warmup):
            s.step()
    sync(device)
    names = list(steppers)
    rates = {n: [] for n in names}
    for b in range(blocks):
        for name in (names if b % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            for _ in range(steps):
                steppers[name].step()
            sync(device)
            rates[name].append(steps * tokens_per_step / (time.perf_counter() - start))
        if between is not None:
            between()
    return rates


# ----------------------------------------------------------------------------------- profile
PROFILE_KINDS = ("GEMMs", "attention", "MLP activation", "loss (outside GEMMs)", "optimizer + clipping", "other")
_GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
_CLIP_OPS = {"aten::linalg_vector_norm", "aten::_foreach_norm"}


def _kind(event, tokens: int, ffn: int, vocab: int) -> str:
    """Which kind of work one profiled ATen call is, from its name, its first input and its callers.

    Shapes tell the model's pieces apart without hooks inside either model: ``[tokens, ffn]``
    elementwise work is the MLP activation (HF's ``gelu_new`` is several such calls, ours one),
    ``[tokens, vocab]`` work outside the GEMMs is the loss.
    """
    name = event.name
    if name in _GEMMS:
        return "GEMMs"
    if "scaled_dot_product" in name:
        return "attention"
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("Optimizer."):
            return "optimizer + clipping"
        parent = parent.cpu_parent
    if name in _CLIP_OPS:
        return "optimizer + clipping"
    shape = list(event.input_shapes[0]) if event.input_shapes and event.input_shapes[0] else []
    numel = math.prod(shape) if shape else 0
    if shape and shape[-1] == vocab and numel == tokens * vocab:
        return "loss (outside GEMMs)"
    if shape and shape[-1] == ffn and numel == tokens * ffn and name not in ("aten::copy_", "aten::sum"):
        return "MLP activation"
    return "other"


def profile_steps(steppers: dict, steps: int, tokens: int, ffn: int, vocab: int) -> dict:
    """Self CPU milliseconds per step of each stepper by kind of work (``PROFILE_KINDS``), plus ``total``."""
    from torch.profiler import ProfilerActivity, profile

    out = {name: dict.fromkeys(PROFILE_KINDS + ("total",), 0.0) for name in steppers}
    names = list(steppers)
    for i in range(steps):
        for name in (names if i % 2 == 0 else names[::-1]):
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                steppers[name].step()
            for event in prof.events():
                if not event.name.startswith("aten::"):
                    continue
                ms = event.self_cpu_time_total / 1e3 / steps
                out[name][_kind(event, tokens, ffn, vocab)] += ms
                out[name]["total"] += ms
    return out


# ------------------------------------------------------------------------------------- peaks
def measured_matmul_peak(device: torch.device, dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    """Best FLOP/s of an ``n x n`` matmul on ``device`` over ``reps`` tries (the practical peak)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = 0.0
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = max(best, 2.0 * n**3 / (time.perf_counter() - start))
    return best


class Peak:
    """The device's peak FLOP/s for the training dtype: the datasheet on known GPUs, else measured.

    A measured peak is the best over every ``measure()`` call, so a moment when other jobs held
    the cores does not make MFU look better than it is.
    """

    def __init__(self, device: torch.device, amp_dtype, smoke: bool):
        from libai_lite.utils.flops import device_peak_flops

        self.device, self.amp_dtype = device, amp_dtype
        self.n = 256 if smoke else 2048
        self.sheet = device_peak_flops(device, amp_dtype is not None)
        self.fp32 = self.low = 0.0
        self.measure()

    def measure(self) -> None:
        """Measure the matmul peak(s) once more (no-op with a datasheet figure)."""
        if self.sheet is not None:
            return
        self.fp32 = max(self.fp32, measured_matmul_peak(self.device, torch.float32, self.n))
        if self.amp_dtype is not None:
            self.low = max(self.low, measured_matmul_peak(self.device, self.amp_dtype, self.n))

    @property
    def flops(self) -> float:
        """The peak MFU is taken against."""
        if self.sheet is not None:
            return self.sheet
        return self.low if self.amp_dtype is not None else self.fp32

    @property
    def source(self) -> str:
        """Where the peak comes from, for the report."""
        if self.sheet is not None:
            return f"datasheet ({torch.cuda.get_device_name(self.device)})"
        if self.amp_dtype is None:
            return f"measured fp32 {self.n}x{self.n} matmul, best of the job"
        return (f"measured bf16 {self.n}x{self.n} matmul, best of the job (fp32 matmul: "
                f"{self.fp32 / 1e9:.1f} GFLOP/s)")
