"""``torch.compile`` per transformer layer (torchtitan's regional compilation), and optionally the loss.

Each layer is compiled in place (``nn.Module.compile``) after tensor parallelism and activation
checkpointing and before FSDP2, so pipeline stages, FSDP2 and checkpointing still see ordinary layer
modules and parameter names and ``state_dict()`` keys do not change. The layers of a stack share their
code, so one compiled graph serves them all: a model compiles once per kind of layer (GPT and Llama 1,
MT5 4: the first layer of each stack computes the position bias), not once per layer. ``loss=True`` also compiles the cross entropy over the logits
(``ParallelCrossEntropyLoss``); a model that fuses its LM head with the cross entropy
(``fused_cross_entropy``) never calls it, nor does a pipeline (its loss runs outside the stages).

On the CPU the inductor backend builds C++ with the machine's compiler; its cache
(``TORCHINDUCTOR_CACHE_DIR``, by default under the temporary directory) makes later runs start fast.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor

from ..layers.loss import ParallelCrossEntropyLoss
from ..utils.errors import UsageError
from .activation_checkpoint import is_checkpointed, transformer_layers

logger = logging.getLogger("libai_lite")


@dataclass(frozen=True)
class CompileOptions:
    """``train.compile``: ``enabled`` compiles every transformer layer; ``loss`` also the cross entropy;
    ``backend`` is torch.compile's (``inductor``, or ``aot_eager``/``eager`` to debug); ``fullgraph``
    makes a graph break inside a layer an error instead of a silent split."""

    enabled: bool = False
    loss: bool = False
    backend: str = "inductor"
    fullgraph: bool = False


def compile_options(cfg: Mapping | None) -> CompileOptions:
    """``train.compile`` (a dict, or None for off) as ``CompileOptions``; UsageError for an unknown key or backend."""
    if not cfg:
        return CompileOptions()
    cfg = dict(cfg)
    known = set(CompileOptions.__dataclass_fields__)
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise UsageError(f"train.compile has no key {unknown[0]!r}; its keys are {', '.join(sorted(known))}")
    options = CompileOptions(**cfg)
    import torch._dynamo

    # Debug and experimental backends are accepted but not suggested.
    if options.enabled and options.backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise UsageError(f"train.compile.backend={options.backend!r} is not a torch.compile backend; use one of "
                         f"{', '.join(torch._dynamo.list_backends())}")
    return options


def apply_compile(model: nn.Module, options: CompileOptions) -> None:
    """Compile ``model``'s transformer layers in place (and its cross entropy with ``options.loss``)."""
    if not options.enabled:
        return
    layers = transformer_layers(model)
    if not layers:
        raise UsageError(f"train.compile found no transformer layers in {type(model).__name__}: it compiles the "
                         f"children of a 'layers' ModuleDict/ModuleList; keep the layers in such a container")
    for layer in layers:
        _compile_target(layer).compile(backend=options.backend, fullgraph=options.fullgraph)
    losses = [m for m in model.modules() if isinstance(m, ParallelCrossEntropyLoss)] if options.loss else []
    for loss in losses:
        loss.compile(backend=options.backend, fullgraph=options.fullgraph)
    logger.info(f"torch.compile ({options.backend}) on {len(layers)} transformer layers"
                + (f" and {len(losses)} cross-entropy losses" if options.loss else ""))


def _compile_target(layer: nn.Module) -> nn.Module:
    """What to compile for one layer: the layer with its checkpoint region, as torchtitan does, except for a
    checkpointed layer with tensor-parallel (DTensor) parameters, whose layer inside the checkpoint is
    compiled instead: torch's AOT autograd cannot yet trace a checkpoint region over DTensors (it tries to
    save the DeviceMesh for backward), so there the checkpoint stays eager around the compiled layer."""
    if is_checkpointed(layer) and any(isinstance(p, DTensor) for p in layer.parameters()):
        return layer._checkpoint_wrapped_module
    return layer
