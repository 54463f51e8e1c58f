"""Pure readings of a loaded config that ``libai_lite.run_spec.resolve_run`` combines: batch sizes and the
autocast dtype, with nothing built and nothing written."""
from __future__ import annotations

import torch

from ..utils.errors import UsageError

AMP_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def amp_dtype(amp_cfg) -> torch.dtype | None:
    """The autocast dtype ``train.amp`` asks for, or None (fp32)."""
    if not amp_cfg.get("enabled", False):
        return None
    name = str(amp_cfg.get("dtype", "bf16"))
    if name not in AMP_DTYPES:
        raise UsageError(f"train.amp.dtype={name!r} is not supported; use 'bf16' or 'fp16'")
    return AMP_DTYPES[name]


def batch_sizes(train_cfg, dp_size: int) -> tuple[int, int, int]:
    """(micro, global, accumulation) from ``train``, global = micro x dp x accumulation, whichever one is left out
    (null) filled in; UsageError when the three given do not agree."""
    micro = train_cfg.get("train_micro_batch_size")
    global_batch = train_cfg.get("global_batch_size")
    acc = train_cfg.get("num_accumulation_steps")
    if micro is None and global_batch is None:
        raise UsageError("set train.train_micro_batch_size or train.global_batch_size")

    def divide_global(by: int, what: str) -> int:
        if global_batch % by:
            raise UsageError(f"train.global_batch_size={global_batch} is not divisible by {what}; pick sizes with "
                             f"global = micro x dp x accumulation")
        return global_batch // by

    if micro is None:
        acc = acc or 1
        micro = divide_global(dp_size * acc, f"data_parallel_size({dp_size}) x num_accumulation_steps({acc})")
    elif global_batch is None:
        acc = acc or 1
        global_batch = micro * dp_size * acc
    elif acc is None:
        acc = divide_global(micro * dp_size, f"train_micro_batch_size({micro}) x data_parallel_size({dp_size})")
    if micro * dp_size * acc != global_batch:
        raise UsageError(
            f"train.global_batch_size={global_batch} != train_micro_batch_size({micro}) x "
            f"data_parallel_size({dp_size}) x "
            f"num_accumulation_steps({acc}) = {micro * dp_size * acc}; set one of them to null to have it inferred"
        )
    if micro < 1 or acc < 1:
        raise UsageError(f"batch sizes must be positive (micro {micro}, accumulation {acc})")
    return int(micro), int(global_batch), int(acc)

