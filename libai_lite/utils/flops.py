"""Model FLOPs, device peaks, and the TFLOP/s and MFU the trainer logs."""
from __future__ import annotations

import re

import torch

# Dense datasheet peaks in TFLOP/s per GPU: (device-name pattern, bf16/fp16 with fp32 accumulation, tf32,
# plain fp32). The first match wins, so a variant precedes its family. fp32 accumulation is what training
# uses; V100 and T4 list their fp16 figure and no tf32.
_GPU_PEAKS: tuple[tuple[str, float, float, float], ...] = (
    (r"\bGH200\b", 989.4, 494.7, 67.0),
    (r"\bGB200\b", 2500.0, 1250.0, 80.0),
    (r"\bB200\b", 2250.0, 1125.0, 75.0),
    (r"\bH200\b.*\bNVL\b", 835.5, 417.5, 60.0),
    (r"\bH200\b", 989.4, 494.7, 67.0),
    (r"\bH100\b.*\bPCIe\b", 756.0, 378.0, 51.0),
    (r"\bH100\b.*\bNVL\b", 835.5, 417.5, 60.0),
    (r"\bH100\b", 989.4, 494.7, 67.0),
    (r"\bH800\b.*\bPCIe\b", 756.0, 378.0, 51.0),
    (r"\bH800\b", 989.4, 494.7, 67.0),
    (r"\bH20\b", 148.0, 74.0, 44.0),
    (r"\bA100\b", 312.0, 156.0, 19.5),
    (r"\bA800\b", 312.0, 156.0, 19.5),
    (r"\bA40\b", 149.7, 74.8, 37.4),
    (r"\bA30\b", 165.0, 82.0, 10.3),
    (r"\bA10\b", 125.0, 62.5, 31.2),
    (r"\bL40S\b", 362.05, 183.0, 91.6),
    (r"\bL40\b", 181.05, 90.5, 90.5),
    (r"\bL4\b", 121.0, 60.0, 30.3),
    (r"\bRTX 6000 Ada\b", 364.25, 182.1, 91.1),
    (r"\bRTX A6000\b", 154.8, 77.4, 38.7),
    (r"\bRTX 5090\b", 209.5, 104.8, 104.8),
    (r"\bRTX 4090\b", 165.2, 82.6, 82.6),
    (r"\bRTX 3090\b", 71.0, 35.6, 35.6),
    (r"\bV100\b", 125.0, 15.7, 15.7),
    (r"\bT4\b", 65.0, 8.1, 8.1),
    (r"\bMI300X\b", 1307.4, 653.7, 163.4),
    (r"\bMI325X\b", 1307.4, 653.7, 163.4),
)
PRECISIONS = ("bf16", "tf32", "fp32")


def gpu_peak_tflops(name: str, precision: str) -> float | None:
    """Datasheet dense peak in TFLOP/s of the GPU called ``name`` (``torch.cuda.get_device_name``) for
    ``precision`` (one of ``PRECISIONS``), or None for a GPU the table does not list."""
    column = PRECISIONS.index(precision) + 1
    for row in _GPU_PEAKS:
        if re.search(row[0], name, flags=re.IGNORECASE):
            return row[column]
    return None


def matmul_precision(low_precision: bool) -> str:
    """What the training step's matmuls run in: bf16/fp16 under autocast, else tf32 when torch is allowed
    to use it for fp32 matmuls (off by default), else plain fp32."""
    if low_precision:
        return "bf16"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"


def device_peak_flops(device: torch.device, low_precision: bool, peak_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of `device` for the training dtype: ``peak_tflops`` (``train.peak_tflops``) when given,
    else the datasheet figure for the device's name; None when unknown (CPUs, unlisted GPUs)."""
    if peak_tflops:
        return float(peak_tflops) * 1e12
    if device.type != "cuda":
        return None
    tflops = gpu_peak_tflops(torch.cuda.get_device_name(device), matmul_precision(low_precision))
    return None if tflops is None else tflops * 1e12


def transformer_flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_length: int) -> float:
    """Training FLOPs per token, forward and backward: 6N + 12·L·H·T (PaLM's appendix B)."""
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_length


def achieved_tflops(samples_per_sec: float, flops_per_sample: float, world_size: int,
                    peak_flops: float | None) -> tuple[float, float | None]:
    """``(TFLOP/s per rank, MFU)`` of a run doing ``samples_per_sec`` samples of ``flops_per_sample`` training
    FLOPs each over ``world_size`` ranks; MFU, the fraction of ``peak_flops`` (``device_peak_flops``),
    is None when the peak is unknown."""
    tflops = samples_per_sec * flops_per_sample / world_size / 1e12
    return tflops, (tflops * 1e12 / peak_flops if peak_flops else None)
