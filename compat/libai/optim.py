"""OneFlow's optimizers as LiBai configs name them (``flow.optim.AdamW``), built as PyTorch's.

OneFlow's Adam/AdamW take ``do_bias_correction`` (True by default, as PyTorch always corrects);
``False`` has no PyTorch counterpart and is refused. ``fused`` is PyTorch's, on by default here as in
``configs/common/optim.py``.
"""
from __future__ import annotations

from typing import Any

import torch

from libai_lite.utils.errors import UsageError

__all__ = ["Adam", "AdamW", "SGD"]


def _check_bias_correction(name: str, do_bias_correction: bool) -> None:
    if not do_bias_correction:
        raise UsageError(f"optim.do_bias_correction=False: PyTorch's {name} always corrects the moment "
                         f"estimates' bias; set optim.do_bias_correction=True")


def AdamW(params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,  # noqa: N802
          amsgrad: bool = False, do_bias_correction: bool = True, fused: Any = True, **others: Any):
    """OneFlow's ``flow.optim.AdamW``: ``torch.optim.AdamW`` (decoupled weight decay in both)."""
    _check_bias_correction("AdamW", do_bias_correction)
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                             amsgrad=amsgrad, fused=fused, **others)


def Adam(params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,  # noqa: N802
         amsgrad: bool = False, do_bias_correction: bool = True, fused: Any = True, **others: Any):
    """OneFlow's ``flow.optim.Adam``: ``torch.optim.Adam``."""
    _check_bias_correction("Adam", do_bias_correction)
    return torch.optim.Adam(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                            amsgrad=amsgrad, fused=fused, **others)


SGD = torch.optim.SGD
