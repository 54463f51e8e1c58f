"""Model FLOPs and device peaks, for the TFLOP/s and MFU the trainer logs."""
from __future__ import annotations

import torch

# Dense peaks in FLOP/s from the vendors' datasheets: (bf16/fp16 tensor core, tf32/fp32).
_GPU_PEAKS = {
    "H200": (989e12, 494.7e12),
    "H100": (989e12, 494.7e12),
    "A100": (312e12, 156e12),
    "A800": (312e12, 156e12),
    "L40S": (362e12, 183e12),
    "A10": (125e12, 62.5e12),
    "L4": (121e12, 60e12),
    "V100": (125e12, 15.7e12),
}


def device_peak_flops(device: torch.device, low_precision: bool) -> float | None:
    """Datasheet peak of `device` for the training dtype, or None when unknown (CPUs, unlisted GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, full) in _GPU_PEAKS.items():
        if key in name:
            return half if low_precision else full
    return None


def transformer_flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_length: int) -> float:
    """Training FLOPs per token, forward and backward: 6N + 12·L·H·T (PaLM's appendix B)."""
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_length
