"""Activation checkpointing: recompute a transformer layer's activations in backward instead of keeping them.

Apply it after tensor parallelism and before data parallelism (FSDP2 then shards the wrapped layers,
torchtitan's order). The layers are the children of every ``layers`` ModuleDict/ModuleList, or one
whose name ends in ``_layers`` (``encoder_layers``), so stacks and pipeline stages need no registration.
"""
from __future__ import annotations

import logging

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    checkpoint_wrapper,
)

from ..utils.errors import UsageError

logger = logging.getLogger("libai_lite")

LAYER_CONTAINER_NAME = "layers"


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


def apply_activation_checkpointing(model: nn.Module, every_n_layers: int = 1) -> None:
    """Wrap every ``every_n_layers``-th transformer layer (the N-th, 2N-th, ... in order) in place.

    Non-reentrant ``checkpoint_wrapper``, so it composes with FSDP2 and DTensor parameters and keeps
    RNG state for dropout. ``state_dict()`` and DCP strip the wrapper's ``_checkpoint_wrapped_module.``
    prefix, so checkpoints keep their keys; ``named_parameters()`` does show it.
    """
    every_n_layers = int(every_n_layers)
    if every_n_layers < 1:
        raise UsageError(f"activation checkpointing every_n_layers={every_n_layers} must be at least 1 "
                         f"(1 checkpoints every layer)")
    slots = transformer_layer_slots(model)
    if not slots:
        raise UsageError(f"activation checkpointing found no transformer layers in {type(model).__name__}: it "
                         f"wraps the children of a '{LAYER_CONTAINER_NAME}' ModuleDict/ModuleList; keep the layers "
                         f"in such a container")
    wrapped = 0
    for count, (container, key) in enumerate(slots, start=1):
        if count % every_n_layers == 0 and not is_checkpointed(container[key]):
            container[key] = checkpoint_wrapper(container[key], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            wrapped += 1
    logger.info(f"Activation checkpointing on {wrapped} of {len(slots)} transformer layers (every {every_n_layers})")
