"""``torch.compile`` of the whole model or per transformer layer (torchtitan's regional compilation), and the loss.

The gain on a GPU is in what stays eager between the cuBLAS GEMMs and flash attention: norms, residual
adds, bias-GeLU, the loss, and the launch count. ``scope="model"`` compiles the whole model (one graph
from the embeddings to the loss: the norms fuse with the adds around them across layers, the loss
with the head); ``scope="layers"`` compiles each transformer layer in place. ``scope="auto"`` (the
default) takes the whole model where nothing needs the layers apart: one data-parallel replica (DDP's
buckets and FSDP2's per-layer gathers need the layers' backward apart to overlap), no pipeline (its
stages run the layers one by one), no tensor, context or expert parallelism; else the layers.
Both compile in place (``nn.Module.compile``), after tensor parallelism and activation checkpointing
and before FSDP2, so parameter names and ``state_dict()`` keys do not change. The layers of a stack
share their code, so one compiled graph serves them all: a model compiles once per kind of layer
(GPT and Llama 1, MT5 4: the first layer of each stack computes the position bias), not once per
layer. ``loss=True`` also compiles the cross entropy over the logits (``ParallelCrossEntropyLoss``)
when the layers are compiled apart; a model that fuses its LM head with the cross entropy
(``fused_cross_entropy``) never calls it, nor does a pipeline (its loss runs outside the stages).

``mode``: torch.compile's. ``reduce-overhead`` replays CUDA graphs (one launch per graph; for static
shapes: a fixed micro-batch and sequence length, no dropout RNG outside the graph), ``max-autotune``
also benchmarks GEMM and Triton configurations at compile time, ``max-autotune-no-cudagraphs`` that
without CUDA graphs. CUDA graphs are a GPU feature: on a CPU inductor leaves them out.

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

SCOPES = ("auto", "model", "layers")
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileOptions:
    """``train.compile``: ``enabled``; ``scope`` ``auto``, ``model`` or ``layers`` (see the module docstring);
    ``loss`` also the cross entropy; ``backend`` is torch.compile's (``inductor``, or ``aot_eager``/``eager``
    to debug); ``fullgraph`` makes a graph break an error instead of a silent split; ``mode``
    torch.compile's (None, ``reduce-overhead``: CUDA graphs, ``max-autotune``, ``max-autotune-no-cudagraphs``)."""

    enabled: bool = False
    loss: bool = False
    backend: str = "inductor"
    fullgraph: bool = False
    scope: str = "auto"
    mode: str | None = None


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

    if options.scope not in SCOPES:
        raise UsageError(f"train.compile.scope={options.scope!r} is not a scope; use one of {', '.join(SCOPES)}")
    if options.mode not in MODES:
        raise UsageError(f"train.compile.mode={options.mode!r} is not a torch.compile mode; use null or one of "
                         f"{', '.join(m for m in MODES if m)}")

    # Debug and experimental backends are accepted but not suggested.
    if options.enabled and options.backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise UsageError(f"train.compile.backend={options.backend!r} is not a torch.compile backend; use one of "
                         f"{', '.join(torch._dynamo.list_backends())}")
    return options


def apply_compile(model: nn.Module, options: CompileOptions, whole_model_ok: bool = False) -> str | None:
    """Compile ``model`` in place: whole (``scope="model"``, or ``auto`` where ``whole_model_ok``: nothing
    needs its layers apart) or its transformer layers (and its cross entropy with ``options.loss``).
    Returns what was compiled: ``model``, ``layers`` or None (off)."""
    if not options.enabled:
        return None
    kwargs = dict(backend=options.backend, fullgraph=options.fullgraph, mode=options.mode)
    if options.scope == "model" and not whole_model_ok:
        raise UsageError("train.compile.scope=model needs one data-parallel replica and no pipeline, tensor, "
                         "context or expert parallelism; use train.compile.scope=layers (or auto)")
    if options.scope != "layers" and whole_model_ok:
        model.compile(**kwargs)
        logger.info(f"torch.compile ({options.backend}{f', {options.mode}' if options.mode else ''}) on the whole "
                    f"{type(model).__name__}")
        return "model"
    layers = transformer_layers(model)
    if not layers:
        raise UsageError(f"train.compile found no transformer layers in {type(model).__name__}: it compiles the "
                         f"children of a 'layers' ModuleDict/ModuleList; keep the layers in such a container")
    for layer in layers:
        _compile_target(layer).compile(**kwargs)
    losses = [m for m in model.modules() if isinstance(m, ParallelCrossEntropyLoss)] if options.loss else []
    for loss in losses:
        loss.compile(**kwargs)
    logger.info(f"torch.compile ({options.backend}{f', {options.mode}' if options.mode else ''}) on "
                f"{len(layers)} transformer layers"
                + (f" and {len(losses)} cross-entropy losses" if options.loss else ""))
    return "layers"


def _compile_target(layer: nn.Module) -> nn.Module:
    """What to compile for one layer: the layer with its checkpoint region, as torchtitan does, except for a
    checkpointed layer with tensor-parallel (DTensor) parameters, whose layer inside the checkpoint is
    compiled instead: torch's AOT autograd cannot yet trace a checkpoint region over DTensors (it tries to
    save the DeviceMesh for backward), so there the checkpoint stays eager around the compiled layer."""
    if is_checkpointed(layer) and any(isinstance(p, DTensor) for p in layer.parameters()):
        return layer._checkpoint_wrapped_module
    return layer
