"""FP8 training of the linear layers through torchao's float8 (``train.fp8``), as torchtitan does it.

Eligible ``nn.Linear``s become torchao's ``Float8Linear`` before checkpointing, compilation and FSDP2 see
them. Master weights and parameter names stay, so checkpoints move between FP8 and bf16 runs. Converted
linears are always compiled, since eager casts are separate kernels. A CPU, a GPU below compute
capability 8.9, a missing torchao and tensor parallelism are refused. If a linear fails at first use,
it and every linear not yet used run in high precision from then on, with one warning.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..config.settings import read_settings, setting
from ..config.validate import SWITCH
from ..utils.errors import UsageError
from ..utils.fallback import FastPath, one_line, signature_of

logger = logging.getLogger("libai_lite")

RECIPES = ("tensorwise", "rowwise")
FILTERS = ("auto", "all")


@dataclass(frozen=True)
class Float8Options:
    """``train.fp8``: FP8 linears through torchao."""

    enabled: bool = setting(False, key="train.fp8.enabled", rule=SWITCH, doc="FP8 linears (compute capability 8.9+)")
    recipe: str = setting("tensorwise", key="train.fp8.recipe", doc="torchao's scaling: tensorwise or rowwise")
    skip: tuple[str, ...] = setting(("lm_head",), key="train.fp8.skip",
                                    doc="module-name substrings whose linears stay in high precision")
    filter: str = setting("auto", key="train.fp8.filter",
                          doc="auto: only linears large enough to gain (torchao's thresholds); all: every eligible one")


def float8_options(cfg: Mapping | None) -> Float8Options:
    """``train.fp8`` (a dict, or None for off) as ``Float8Options``; UsageError for an unknown key or recipe."""
    if not cfg:
        return Float8Options()
    options = read_settings(Float8Options, cfg, section="train.fp8")
    if options.recipe not in RECIPES:
        raise UsageError(f"train.fp8.recipe={options.recipe!r} is not a float8 recipe; use one of "
                         f"{', '.join(RECIPES)}")
    if options.filter not in FILTERS:
        raise UsageError(f"train.fp8.filter={options.filter!r} is not a filter; use auto (linears large enough "
                         f"to gain) or all")
    skip = options.skip
    return dataclasses.replace(options, skip=(skip,) if isinstance(skip, str) else tuple(skip or ()))


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
    # Not installed is bad input, refused at setup; installed but failing to import is a fast path failing.
    if importlib.util.find_spec("torchao") is None:
        raise UsageError("train.fp8 needs torchao, which is not installed: pip install -e .[fp8]")


def _torchao_float8():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return Float8LinearConfig, convert_to_float8_training


def large_enough(recipe: str, in_features: int, out_features: int) -> bool:
    """Whether FP8 speeds up a linear of these features under ``recipe``, by torchao's thresholds; below
    them the casts cost more than the faster GEMM saves."""
    k, n = in_features, out_features
    if recipe == "rowwise":
        return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)
    return not (k <= 4096 and n <= 1024)


def fp8_eligible(name: str, module: nn.Module, options: Float8Options) -> bool:
    """Whether ``module`` (at ``name``) becomes a float8 linear: an ``nn.Linear`` with both dimensions
    multiples of 16 (what FP8 GEMMs take), a name matching none of ``options.skip`` and, with
    ``filter="auto"``, large enough to gain (``large_enough``)."""
    # A linear returning its bias apart (skip_bias_add) has a forward Float8Linear does not copy.
    if not (isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
            and not getattr(module, "skip_bias_add", False) and not any(s in name for s in options.skip)):
        return False
    return options.filter == "all" or large_enough(options.recipe, module.in_features, module.out_features)


def apply_float8(module: nn.Module, options: Float8Options, *, compile_backend: str | None = "inductor",
                 fsdp: bool = False) -> int:
    """Swap the eligible linears of ``module`` for torchao's ``Float8Linear`` in place; returns how many.

    ``compile_backend`` compiles each converted linear, None when the caller compiles their layers. With
    ``fsdp`` the tensorwise recipe all-gathers the weights in float8."""
    if not options.enabled:
        return 0
    _torchao()
    names = [n for n, m in module.named_modules() if fp8_eligible(n, m, options)]
    if not names:
        logger.warning(f"train.fp8: no linear layer is large enough to gain from FP8 (filter={options.filter}) "
                       f"or has dimensions divisible by 16; nothing runs in FP8")
        return 0
    path = float8_path(options.recipe)
    try:
        config_cls, convert = _torchao_float8()
        config = config_cls.from_recipe_name(options.recipe)
        if fsdp and options.recipe == "tensorwise":  # torchao's float8 all-gather is tensorwise only
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        convert(module, config=config, module_filter_fn=lambda m, fqn: fp8_eligible(fqn, m, options))
    except Exception as e:  # noqa: BLE001 - a broken torchao install or conversion: train in high precision
        path.fallback_reason = one_line(e)
        logger.warning(f"train.fp8: torchao's float8 conversion failed ({path.fallback_reason}); the linears train "
                       f"in high precision")
        # Linears a failing conversion had already swapped run their high-precision forward.
        for name in names:
            if _is_float8(module.get_submodule(name)):
                guard_float8_linear(module.get_submodule(name), path)
        return 0
    for name in names:
        linear = module.get_submodule(name)
        if compile_backend is not None:
            linear.compile(backend=compile_backend)
        guard_float8_linear(linear, path)
    logger.info(f"train.fp8: {len(names)} linear layers in float8 ({options.recipe} scaling"
                f"{', float8 all-gather' if config.enable_fsdp_float8_all_gather else ''}"
                f"{f', each compiled ({compile_backend})' if compile_backend else ', compiled with their layers'}); "
                f"kept in high precision: {', '.join(options.skip) or 'none'}"
                f"{' and linears too small to gain' if options.filter == 'auto' else ''}")
    return len(names)


def _is_float8(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


def _float8_call(linear, x):
    return (linear._libai_lite_float8 or linear._call_impl)(x)


def high_precision_linear(linear, x):
    """``linear`` (a float8 linear) as the plain ``nn.Linear`` it was: the same weight and bias in their own
    dtype (a weight all-gathered in float8 under FSDP is turned back to it), autocast's GEMM."""
    weight = linear.weight
    if hasattr(weight, "to_original_precision"):
        weight = weight.to_original_precision()
    return nn.functional.linear(x, weight, linear.bias)


def float8_path(recipe: str) -> FastPath:
    """The fast path of a model's float8 linears: ``(linear, x)``, probed forward and backward at each linear's
    first use, the high-precision linear where one failed."""
    return FastPath(f"train.fp8 (torchao float8 linears, {recipe} scaling)", _float8_call, high_precision_linear,
                    signature=lambda linear, x: (id(linear), signature_of(x)),
                    plain_name="the high-precision linear (same weights)")


def guard_float8_linear(linear: nn.Module, path: FastPath) -> None:
    """Call the float8 ``linear`` (compiled or not) through ``path``. Under a compiled layer dynamo traces the
    linear's own ``_call_impl``; this guard runs where the linear is called eagerly."""
    linear._libai_lite_float8 = linear._compiled_call_impl
    linear._compiled_call_impl = lambda x: path(linear, x)


def float8_after_optimizer_step(optimizer, module: nn.Module) -> bool:
    """Have ``optimizer`` precompute the float8 scales of ``module``'s FSDP-sharded float8 weights after
    each step, in one all-reduce; returns whether there were any."""
    from torch.distributed.tensor import DTensor

    # Without a float8 conversion torchao was never imported; importing it now would only cost time.
    if "torchao" not in sys.modules:
        return False
    try:
        from torchao.float8.fsdp_utils import (
            WeightWithDynamicFloat8CastTensor,
            precompute_float8_dynamic_scale_for_fsdp,
        )
    except ImportError:
        return False
    if not any(isinstance(p, DTensor) and isinstance(p._local_tensor, WeightWithDynamicFloat8CastTensor)
               for p in module.parameters()):
        return False
    optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(module))
    return True
