"""FP8 training of the linear layers through torchao's float8 (``train.fp8``), as torchtitan does it.

Every ``nn.Linear`` of the model whose dimensions FP8 GEMMs take (multiples of 16) and whose name
matches none of ``skip`` (the LM head by default: its logits feed the loss, where FP8's 3-bit
mantissa costs accuracy for little speed) becomes torchao's ``Float8Linear``: inputs, weights and
gradients are cast to float8 with dynamic scales (``tensorwise``: one scale per tensor; ``rowwise``:
one per row, more accurate, slower) and multiplied by the tensor cores' FP8 GEMM. Master weights,
optimizer state and checkpoints stay in their own dtype, and parameter names do not change, so
checkpoints move between FP8 and bf16 runs. The conversion runs before activation checkpointing,
compilation and FSDP2 see the layers.

FP8 GEMMs need an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); a CPU run
is refused in one line. Tensor parallelism with FP8 would need torchao's float8 tensor-parallel
styles in place of our SBP plan and is refused too.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..utils.errors import UsageError

logger = logging.getLogger("libai_lite")

RECIPES = ("tensorwise", "rowwise")


@dataclass(frozen=True)
class Float8Options:
    """``train.fp8``: ``enabled``; ``recipe`` ``tensorwise`` or ``rowwise``; ``skip``: module-name
    substrings whose linears stay in high precision."""

    enabled: bool = False
    recipe: str = "tensorwise"
    skip: tuple[str, ...] = ("lm_head",)


def float8_options(cfg: Mapping | None) -> Float8Options:
    """``train.fp8`` (a dict, or None for off) as ``Float8Options``; UsageError for an unknown key or recipe."""
    if not cfg:
        return Float8Options()
    cfg = dict(cfg)
    known = set(Float8Options.__dataclass_fields__)
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise UsageError(f"train.fp8 has no key {unknown[0]!r}; its keys are {', '.join(sorted(known))}")
    if cfg.get("recipe", "tensorwise") not in RECIPES:
        raise UsageError(f"train.fp8.recipe={cfg['recipe']!r} is not a float8 recipe; use one of {', '.join(RECIPES)}")
    skip = cfg.get("skip", Float8Options.skip)
    cfg["skip"] = (skip,) if isinstance(skip, str) else tuple(skip or ())
    return Float8Options(**cfg)


def check_float8(options: Float8Options, device: torch.device, tensor_parallel_size: int) -> None:
    """Refuse, in one line and before any work, an FP8 run this machine or layout cannot do."""
    if not options.enabled:
        return
    if device.type != "cuda":
        raise UsageError(f"train.fp8.enabled=True needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9 "
                         f"or newer: Ada, Hopper, Blackwell); this run is on {device.type}: turn train.fp8 off")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise UsageError(f"train.fp8.enabled=True needs compute capability 8.9 or newer; "
                         f"{torch.cuda.get_device_name(device)} has {major}.{minor}: turn train.fp8 off (bf16 instead)")
    if tensor_parallel_size > 1:
        raise UsageError("train.fp8 does not compose with tensor parallelism yet; use "
                         "train.dist.tensor_parallel_size=1 (ZeRO and pipeline parallelism work) or turn train.fp8 off")
    _torchao()


def _torchao():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise UsageError("train.fp8 needs torchao, which is not installed: pip install -e .[fp8]") from e
    return Float8LinearConfig, convert_to_float8_training


def fp8_eligible(name: str, module: nn.Module, skip: tuple[str, ...]) -> bool:
    """Whether ``module`` (at ``name``) becomes a float8 linear: an ``nn.Linear`` with both dimensions
    multiples of 16 (what FP8 GEMMs take) and a name matching none of ``skip``."""
    # A linear returning its bias apart (skip_bias_add) has a forward Float8Linear does not copy.
    return (isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
            and not getattr(module, "skip_bias_add", False) and not any(s in name for s in skip))


def apply_float8(module: nn.Module, options: Float8Options) -> int:
    """Swap the eligible linears of ``module`` for torchao's ``Float8Linear`` in place; returns how many."""
    if not options.enabled:
        return 0
    config_cls, convert = _torchao()
    names = [n for n, m in module.named_modules() if fp8_eligible(n, m, options.skip)]
    if not names:
        logger.warning("train.fp8: no linear layer has dimensions divisible by 16; nothing runs in FP8")
        return 0
    convert(module, config=config_cls.from_recipe_name(options.recipe),
            module_filter_fn=lambda m, fqn: fp8_eligible(fqn, m, options.skip))
    logger.info(f"train.fp8: {len(names)} linear layers in float8 ({options.recipe} scaling); "
                f"kept in high precision: {', '.join(options.skip) or 'none'}")
    return len(names)
