"""``torch.compile`` of the whole model or per transformer layer (torchtitan's regional compilation), and the loss.

``scope="model"`` compiles the whole model, ``"layers"`` each transformer layer in place, and ``"auto"``
the whole model where nothing needs the layers apart, else the layers. Compilation happens in place after
tensor parallelism and activation checkpointing and before FSDP2, so parameter names do not change. The
trainer's first step runs compiled modules eager so the fast paths inside can probe. Afterwards each
module is a ``FastPath`` whose failure at first call makes it run eager, or without CUDA graphs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..config.settings import read_settings, setting
from ..config.validate import SWITCH
from ..layers.loss import ParallelCrossEntropyLoss
from ..utils.errors import UsageError
from ..utils.fallback import GUARD_CALL, FastPath, check_close, seeded_like, signature_of
from ..utils.parallel_dims import SPLIT_BACKWARD_SCHEDULES
from .activation_checkpoint import is_checkpointed, transformer_layers

logger = logging.getLogger("libai_lite")

SCOPES = ("auto", "model", "layers")
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The modes that replay CUDA graphs, and the same compilation without them (their fallback).
CUDA_GRAPH_MODES = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}


@dataclass(frozen=True)
class CompileOptions:
    """``train.compile``. ``enabled="auto"``, the config's default, turns it on with a CUDA device, since on
    a CPU compiling costs more than it saves; ``automatic`` records that choice."""

    enabled: bool = setting(False, key="train.compile.enabled", doc="true, false, or auto: on with a CUDA device")
    loss: bool = setting(False, key="train.compile.loss", rule=SWITCH, doc="also compile unfused heads' cross entropy")
    backend: str = setting("inductor", key="train.compile.backend", doc="torch.compile's backend (aot_eager to debug)")
    fullgraph: bool = setting(False, key="train.compile.fullgraph", rule=SWITCH,
                              doc="a graph break inside a compiled module is an error")
    scope: str = setting("auto", key="train.compile.scope",
                         doc="model, layers, or auto: the whole model where nothing needs the layers apart")
    mode: str | None = setting(None, key="train.compile.mode", doc="torch.compile's mode (reduce-overhead: CUDA graphs)")
    automatic: bool = setting(False, doc="enabled was auto, and this is what it resolved to")


def compile_options(cfg: Mapping | None, *, cuda: bool | None = None, schedule: str | None = None) -> CompileOptions:
    """``train.compile`` (a dict, or None for off) as ``CompileOptions``, ``enabled="auto"`` resolved: on when
    ``cuda`` (default: a CUDA device is visible) and the pipeline ``schedule`` can run compiled layers;
    UsageError for an unknown key, value or backend."""
    if not cfg:
        return CompileOptions()
    options = read_settings(CompileOptions, cfg, section="train.compile")
    if options.enabled == "auto":
        cuda = torch.cuda.is_available() if cuda is None else cuda
        options = dataclasses.replace(options, automatic=True,
                                      enabled=bool(cuda) and str(schedule).lower() not in SPLIT_BACKWARD_SCHEDULES)
    elif not isinstance(options.enabled, bool):
        raise UsageError(f"train.compile.enabled={options.enabled!r} is not one of true, false, auto")
    import torch._dynamo as dynamo

    if options.scope not in SCOPES:
        raise UsageError(f"train.compile.scope={options.scope!r} is not a scope; use one of {', '.join(SCOPES)}")
    if options.mode not in MODES:
        raise UsageError(f"train.compile.mode={options.mode!r} is not a torch.compile mode; use null or one of "
                         f"{', '.join(m for m in MODES if m)}")

    # Debug and experimental backends are accepted but not suggested.
    if options.enabled and options.backend not in dynamo.list_backends(exclude_tags=()):
        raise UsageError(f"train.compile.backend={options.backend!r} is not a torch.compile backend; use one of "
                         f"{', '.join(dynamo.list_backends())}")
    return options


def uses_cuda_graphs(options: CompileOptions | None) -> bool:
    """Whether ``train.compile`` asks for CUDA graphs (``reduce-overhead``, ``max-autotune``)."""
    return options is not None and options.enabled and options.mode in CUDA_GRAPH_MODES


def check_compile(options: CompileOptions | None, num_accumulation_steps: int, *, replica_size: int,
                  pipeline_parallel_size: int, offload: bool) -> None:
    """Refuse CUDA graphs with gradient accumulation where the gradients are not the trainer's own ``.grad``,
    since a replay would overwrite the gradients the previous micro-batch left in the graph's memory."""
    if not uses_cuda_graphs(options) or num_accumulation_steps <= 1:
        return
    if replica_size > 1 or pipeline_parallel_size > 1 or offload:
        raise UsageError(f"train.compile.mode={options.mode} (CUDA graphs) with {num_accumulation_steps} accumulation "
                         f"steps needs one data-parallel replica, no pipeline and no offload (each replay would "
                         f"overwrite the gradients accumulated in the graphs' memory); use train.compile.mode="
                         f"{CUDA_GRAPH_MODES[options.mode] or 'null'}, or train.num_accumulation_steps=1")


@contextlib.contextmanager
def _first_call_builds_backward():
    # Build the backward with the forward, so its errors surface in the guarded first call.
    start = time.perf_counter()
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=torch.is_grad_enabled()):
        yield
    took = time.perf_counter() - start
    if took >= 1.0:  # a layer that reuses its sibling's graph takes milliseconds: not worth a line
        logger.info(f"torch.compile built a graph in {took:.1f} s (forward and backward)")


def _module_signature(module, *args, **kwargs):
    return id(module), signature_of(*args, **kwargs)


def _call_compiled(attr):
    def call(module, *args, **kwargs):
        return getattr(module, attr)(*args, **kwargs)
    return call


def _call_eager(module, *args, **kwargs):
    return module._call_impl(*args, **kwargs)


def _comparable(module: nn.Module) -> bool:
    """Whether a probe may run ``module`` forward and backward beside the step: not where FSDP2's hooks would
    reduce the probe's gradients into ``.grad``, nor where a layer's backward records the step's statistics."""
    from torch.distributed.fsdp import FSDPModule

    from ..layers.moe import MoELayer

    return not any(isinstance(m, (FSDPModule, MoELayer)) for m in module.modules())


def _draws_random_numbers(module: nn.Module) -> bool:
    # Compiled and eager dropout draw different numbers from the same seed: compared without it.
    return module.training and any(
        (isinstance(m, nn.Dropout) and m.p > 0) or any(
            "dropout" in k and isinstance(v, float) and v > 0 for k, v in vars(m).items())
        for m in module.modules())


def _run_for_comparison(call, module: nn.Module, args: tuple, kwargs: dict, keep_on_host: bool):
    """``call(*args, **kwargs)`` on detached inputs, then backward with seeded output gradients: (floating outputs,
    gradients of the inputs and of ``module``'s parameters), none accumulated into ``.grad``."""
    from torch.utils._pytree import tree_flatten, tree_map

    leaves = []

    def detach(x):
        if not isinstance(x, torch.Tensor):
            return x
        y = x.detach()
        if x.requires_grad:
            y.requires_grad_(True)
            leaves.append(y)
        return y

    out = call(*tree_map(detach, args), **tree_map(detach, kwargs))
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    wanted = [t for t in outs if t.requires_grad]
    params = [p for p in module.parameters() if p.requires_grad]
    grads = []
    if wanted and (leaves or params):
        grads = list(torch.autograd.grad(wanted, leaves + params, [seeded_like(t) for t in wanted], allow_unused=True))
    local = [(g.to_local() if isinstance(g, DTensor) else g) for g in grads]
    outs = [(t.to_local() if isinstance(t, DTensor) else t).detach() for t in outs]
    if keep_on_host:  # a GPU holds one set of gradients beside the step's, not two
        local, outs = [g if g is None else g.cpu() for g in local], [t.cpu() for t in outs]
    return outs, local


def _compare_with_eager(fn, args, kwargs):
    """``FastPath`` probe of a compiled module (``args[0]``): its outputs and gradients against the eager module's
    on the same inputs (``MismatchError`` beyond the compute dtype's rounding). False where ``_comparable`` says
    it cannot run; ``GUARD_CALL`` where dropout was off for it, so the real first call is a graph of its own."""
    module, inputs = args[0], args[1:]
    if not torch.is_grad_enabled() or not _comparable(module):
        return False
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    random = _draws_random_numbers(module)
    with _first_call_builds_backward():
        if random:
            module.eval()
        try:
            fast = _run_for_comparison(lambda *a, **k: fn(module, *a, **k), module, inputs, kwargs,
                                       keep_on_host=device.type == "cuda")
            try:
                plain = _run_for_comparison(lambda *a, **k: _call_eager(module, *a, **k), module, inputs, kwargs,
                                            keep_on_host=False)
            except torch.OutOfMemoryError:
                return GUARD_CALL  # nothing to compare with: the compiled call stands
        finally:
            if random:
                module.train()
    names = [f"output {i}" for i in range(len(fast[0]))]
    for what, got, want in zip(names, fast[0], plain[0]):
        check_close(got, want, f"its {what}", "the eager module", dtype)
    for i, (got, want) in enumerate(zip(fast[1], plain[1])):
        check_close(got, want, f"its gradient {i}", "the eager module", dtype)
    return GUARD_CALL if random else True


def compile_paths(options: CompileOptions) -> FastPath:
    """The fast path every module compiled under ``options`` is called through: ``module`` first, then its
    arguments; torch.compile's code (CUDA graphs first where the mode has them), eager where it fails."""
    mode = CUDA_GRAPH_MODES.get(options.mode, options.mode)
    backend = options.backend if isinstance(options.backend, str) else type(options.backend).__name__
    path = FastPath(f"train.compile (backend {backend}{f', mode {mode}' if mode else ''})",
                    _call_compiled("_libai_lite_compiled"), _call_eager, signature=_module_signature,
                    probe=_compare_with_eager, first_call=_first_call_builds_backward, plain_name="the eager module")
    if options.mode not in CUDA_GRAPH_MODES:
        return path
    return FastPath(f"CUDA graphs (train.compile.mode={options.mode})", _call_compiled("_libai_lite_cuda_graphs"), path,
                    signature=_module_signature, probe=None, first_call=_first_call_builds_backward, first_uses=3,
                    plain_name=f"the same compilation without CUDA graphs (mode {mode or 'default'})")


def compile_module(module: nn.Module, options: CompileOptions, path: FastPath) -> None:
    """``module.compile(...)`` with ``options``, its calls going through ``path`` (``compile_paths``): the
    compiled call where it works, the eager module where it failed at first use."""
    kwargs = dict(backend=options.backend, fullgraph=options.fullgraph)
    mode = CUDA_GRAPH_MODES.get(options.mode, options.mode)
    module._libai_lite_compiled = torch.compile(module._call_impl, mode=mode, **kwargs)
    if options.mode in CUDA_GRAPH_MODES:
        module._libai_lite_cuda_graphs = torch.compile(module._call_impl, mode=options.mode, **kwargs)
    # nn.Module calls _compiled_call_impl when set (what module.compile() sets); dynamo tracing an enclosing
    # module calls the module's own _call_impl and never this guard.
    def call(*args, **kwargs):
        if _eager_steps:
            return module._call_impl(*args, **kwargs)
        return path(module, *args, **kwargs)
    module._compiled_call_impl = call


_eager_steps = 0


@contextlib.contextmanager
def compiled_modules_eager():
    """Compiled modules run eager inside, so the fast paths within them can probe on real tensors, which
    they cannot do under dynamo. It spans a whole step so recomputation runs the same code as forward."""
    global _eager_steps
    _eager_steps += 1
    try:
        yield
    finally:
        _eager_steps -= 1


def apply_compile(model: nn.Module, options: CompileOptions, whole_model_ok: bool = False) -> str | None:
    """Compile ``model`` in place, whole or per transformer layer, behind a fast path that falls back to
    eager. Returns ``"model"``, ``"layers"`` or None when off."""
    if not options.enabled:
        return None
    if options.scope == "model" and not whole_model_ok:
        raise UsageError("train.compile.scope=model needs one data-parallel replica and no pipeline, tensor, "
                         "context or expert parallelism; use train.compile.scope=layers (or auto)")
    path = compile_paths(options)
    if options.scope != "layers" and whole_model_ok:
        compile_module(model, options, path)
        logger.info(f"torch.compile ({options.backend}{f', {options.mode}' if options.mode else ''}) on the whole "
                    f"{type(model).__name__}")
        return "model"
    layers = transformer_layers(model)
    if not layers and options.automatic:
        logger.info(f"train.compile=auto: {type(model).__name__} has no transformer layers to compile; it runs eager")
        return None
    if not layers:
        raise UsageError(f"train.compile found no transformer layers in {type(model).__name__}: it compiles the "
                         f"children of a 'layers' ModuleDict/ModuleList; keep the layers in such a container")
    for layer in layers:
        compile_module(_compile_target(layer), options, path)
    losses = [m for m in model.modules() if isinstance(m, ParallelCrossEntropyLoss)] if options.loss else []
    if losses and any(isinstance(p, DTensor) for p in model.parameters()):
        # Compiled over vocabulary-parallel logits (loss_parallel) it computes losses off by several percent.
        logger.warning("train.compile.loss: the cross entropy stays eager under tensor parallelism, where its "
                       "compiled vocabulary-parallel form computes wrong losses")
        losses = []
    for loss in losses:
        compile_module(loss, options, path)
    logger.info(f"torch.compile ({options.backend}{f', {options.mode}' if options.mode else ''}) on "
                f"{len(layers)} transformer layers"
                + (f" and {len(losses)} cross-entropy losses" if options.loss else ""))
    return "layers"


def _compile_target(layer: nn.Module) -> nn.Module:
    """The layer with its checkpoint region, or for a checkpointed layer with DTensor parameters the inner
    layer, since AOT autograd cannot trace a checkpoint region over DTensors."""
    if is_checkpointed(layer) and any(isinstance(p, DTensor) for p in layer.parameters()):
        return layer._checkpoint_wrapped_module
    return layer
