"""Activation checkpointing: recompute a transformer layer's activations in backward instead of keeping them.

Apply it after tensor parallelism and before compilation and data parallelism. The layers are the
children of every ModuleDict/ModuleList named ``layers`` or ending in ``_layers``.

``full`` keeps only each layer's input. ``selective`` keeps the outputs of matmuls and attention and
recomputes only the cheap ops between them.
"""
from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..utils.errors import UsageError

logger = logging.getLogger("libai_lite")

LAYER_CONTAINER_NAME = "layers"
AC_MODES = ("full", "selective")


def _selective_save_ops() -> frozenset:
    """The ops whose outputs ``selective`` keeps: every matmul and fused attention, plus the collectives
    that end a tensor-parallel block (recomputing those would repeat the communication in backward).

    Every matmul is kept, so recomputation costs no matmul FLOPs.
    """
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_mm"]
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    ops |= {c10d.reduce_scatter_tensor.default, c10d.all_reduce.default}
    return frozenset(ops)


def _selective_policy(save_ops: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # MUST_SAVE also under torch.compile, whose partitioner might otherwise choose to recompute a matmul.
    return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_context():
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for ``selective`` mode (a fresh pair of
    contexts per call, as checkpoint requires)."""
    return create_selective_checkpoint_contexts(partial(_selective_policy, _selective_save_ops()))


def transformer_layer_slots(model: nn.Module) -> list[tuple[nn.Module, str | int]]:
    """(container, key) of every transformer layer, in model order: the children of ``layers`` containers."""
    slots = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf != LAYER_CONTAINER_NAME and not leaf.endswith("_" + LAYER_CONTAINER_NAME):
            continue
        if isinstance(module, nn.ModuleDict):
            slots += [(module, key) for key in module.keys()]
        elif isinstance(module, nn.ModuleList):
            slots += [(module, i) for i in range(len(module))]
    return slots


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer layers of ``model`` in order (possibly already checkpoint-wrapped)."""
    return [container[key] for container, key in transformer_layer_slots(model)]


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` is a layer wrapped by ``apply_activation_checkpointing``."""
    return isinstance(module, CheckpointWrapper)


def check_ac_mode(mode) -> str:
    """``mode`` if it is one of ``AC_MODES``, else a UsageError naming the key and the choices."""
    if mode not in AC_MODES:
        raise UsageError(f"train.activation_checkpoint.mode={mode!r} is not a mode; use one of "
                         f"{', '.join(AC_MODES)}")
    return mode


def apply_activation_checkpointing(model: nn.Module, every_n_layers: int = 1, mode: str = "full") -> None:
    """Wrap every ``every_n_layers``-th transformer layer (the N-th, 2N-th, ... in order) in place.

    Non-reentrant ``checkpoint_wrapper``, so it composes with FSDP2, DTensor parameters and
    ``torch.compile`` and keeps RNG state for dropout. ``mode``: ``full`` or ``selective`` (see the
    module docstring). ``state_dict()`` and DCP strip the wrapper's ``_checkpoint_wrapped_module.``
    prefix, so checkpoints keep their keys; ``named_parameters()`` does show it.
    """
    check_ac_mode(mode)
    every_n_layers = int(every_n_layers)
    if every_n_layers < 1:
        raise UsageError(f"activation checkpointing every_n_layers={every_n_layers} must be at least 1 "
                         f"(1 checkpoints every layer)")
    slots = transformer_layer_slots(model)
    if not slots:
        raise UsageError(f"activation checkpointing found no transformer layers in {type(model).__name__}: it "
                         f"wraps the children of a '{LAYER_CONTAINER_NAME}' ModuleDict/ModuleList; keep the layers "
                         f"in such a container")
    options = {"context_fn": selective_checkpoint_context} if mode == "selective" else {}
    wrapped = 0
    for count, (container, key) in enumerate(slots, start=1):
        if count % every_n_layers == 0 and not is_checkpointed(container[key]):
            container[key] = checkpoint_wrapper(container[key], checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                **options)
            wrapped += 1
    logger.info(f"Activation checkpointing ({mode}) on {wrapped} of {len(slots)} transformer layers "
                f"(every {every_n_layers})")
