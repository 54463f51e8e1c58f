"""Tensor (and sequence) parallelism from the SBP the layers declare.

Layers never communicate; each declares the SBP of its parameters and activations in ``module.sbp``.
This module turns the tp entries into one ``parallelize_module`` plan. A split weight with a partial-sum
output becomes ``RowwiseParallel``, one with a split output ``ColwiseParallel``. Replicated layers still
get DTensor parameters, since ``clip_grad_norm_`` refuses a mix of DTensor and plain gradients.

Sequence parallelism keeps the residual stream as this rank's slice of the sequence, so models must be
batch-first with the sequence on dim 1 and take sequence lengths from ``input_ids``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Mapping, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, loss_parallel
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_map

from ..layers.embedding import SBP_SHORTHAND as EMBEDDING_SBP
from ..layers.layer_norm import LayerNorm
from ..layers.linear import SBP_SHORTHAND as LINEAR_SBP
from ..model import tie_weights
from ..utils.errors import UsageError
from ..sbp import LayerSBP, broadcast, hidden, nd_sbp, placements, split

__all__ = ["apply_tensor_parallel", "check_declared_splits", "loss_parallel_context"]

# Plain torch layers cannot declare SBP; each is read as its replicated libai_lite counterpart.
_TORCH_LAYERS = (
    ((nn.LayerNorm, nn.RMSNorm), LayerNorm.sbp),
    ((nn.Embedding,), EMBEDDING_SBP["data"]),
    ((nn.Linear,), LINEAR_SBP["data"]),
)


def declared_sbp(module: nn.Module) -> LayerSBP | None:
    """The SBP ``module`` declares (``module.sbp``), a plain torch layer's default, or None."""
    sbp = getattr(module, "sbp", None)
    if isinstance(sbp, LayerSBP):
        return sbp
    return next((d for types, d in _TORCH_LAYERS if isinstance(module, types)), None)


# The padded vocabulary does not depend on the layout (tokenizer.pad_vocab_size): its divisor is the fix.
_VOCAB_HINT = ("; the vocabulary is padded to a multiple of tokenization.make_vocab_size_divisible_by whatever "
               "the layout: set it to a multiple of {tp} (model.cfg.vocab_size when no tokenizer sets it)")


def _divisors(n: int) -> str:
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ds[0] if len(ds) == 1 else ", ".join(ds[:-1]) + " or " + ds[-1]


def check_declared_splits(model: nn.Module, tp_size: int, model_cfg: Optional[Mapping] = None) -> None:
    """Refuse a tensor-parallel size that does not divide, in whole ``unit`` blocks, every dimension
    ``model``'s layers declare split. The ``UsageError`` names the ``model.cfg`` key when ``model_cfg``
    holds it, else the parameter, and the sizes that work. ``model`` may be on meta."""
    tp = int(tp_size)
    if tp < 1:
        raise UsageError(f"tensor_parallel_size={tp_size} must be at least 1")
    seen: set[int] = set()
    refusals = []  # (is the vocabulary, message): the tokenizer pads the vocabulary, so it goes last
    for name, m in model.named_modules():
        decl = declared_sbp(m)
        if decl is None or decl.weight is None:
            continue
        for p_name, sbp in (("weight", decl.weight), ("bias", decl.bias)):
            param, s = m._parameters.get(p_name), _tp(sbp, False)
            if param is None or not isinstance(s, Shard) or id(param) in seen:
                continue
            seen.add(id(param))
            dim = s.dim % param.ndim
            blocks = param.shape[dim] // decl.unit
            if blocks % tp == 0:
                continue
            if decl.counts and model_cfg is not None and model_cfg.get(decl.counts) == blocks:
                what = f"model.cfg.{decl.counts}={blocks}"
            else:
                whole = "gate/up row pairs" if decl.counts == "ffn_hidden_size" else "whole heads"
                unit = "" if decl.unit == 1 else f" blocks of {decl.unit} ({whole})"
                what = f"dim {dim} of {_join(name, p_name)}: {blocks}{unit}"
            vocab = decl.counts == "vocab_size"
            hint = (_VOCAB_HINT.format(tp=tp) if vocab
                    else f"; use a tensor_parallel_size that divides {blocks} ({_divisors(blocks)})")
            refusals.append((vocab, f"tensor_parallel_size={tp} does not divide {what}{hint}"))
    if refusals:
        raise UsageError(min(refusals, key=lambda r: r[0])[1])


# ---------------------------------------------------------------------------- styles


def _to_dtensor(x: Any, mesh: DeviceMesh, layout: Placement, desired: Placement) -> Any:
    """A plain tensor declared to be ``layout`` on ``mesh`` (or a DTensor), redistributed to ``desired``."""
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (layout,), run_check=False)
    if isinstance(x, DTensor) and x.placements != (desired,):
        x = x.redistribute(placements=(desired,))
    return x


class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters as DTensors broadcast from the first rank and run it on inputs laid out
    as ``input_layout`` (replicated by default). Outputs come back local after redistribution to ``output_layout``.
    """

    def __init__(self, output_layout: Placement = Replicate(), input_layout: Placement = Replicate()):
        super().__init__()
        self.output_layout = output_layout
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh)
        layout = self.input_layout

        def pre_hook(_mod, args, kwargs):
            conv = (lambda x: _to_dtensor(x, device_mesh, layout, layout))
            return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}

        def post_hook(_mod, _args, output):
            local = (lambda x: _to_dtensor(x, device_mesh, layout, self.output_layout).to_local()
                     if isinstance(x, DTensor) else x)
            return tree_map(local, output)

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        module.register_forward_hook(post_hook)
        return module


class GatherSequence(ParallelStyle):
    """All-gather a block's sequence-sharded inputs before it runs (sequence parallelism).

    torch's ``PrepareModuleInput`` wants a layout for every positional argument, but attention's
    arguments vary by call site. This gathers only positional ``indices`` and keyword ``names``.
    """

    def __init__(self, indices: tuple[int, ...] = (0,), names: tuple[str, ...] = ()):
        super().__init__()
        self.indices = tuple(indices)
        self.names = tuple(names)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(x):
            t = _to_dtensor(x, device_mesh, Shard(1), Replicate())
            return t.to_local() if isinstance(t, DTensor) else t

        def pre_hook(_mod, args, kwargs):
            args = tuple(gather(a) if i in self.indices else a for i, a in enumerate(args))
            return args, {k: gather(v) if k in self.names else v for k, v in kwargs.items()}

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return module


class _BroadcastSequenceParallel(SequenceParallel):
    """``SequenceParallel`` whose replicated parameters are broadcast from the first rank, since torch's
    wraps each rank's own copy."""

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh):
        for p_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(
                p_name, nn.Parameter(distribute_tensor(param.data, device_mesh, [Replicate()]), param.requires_grad))


# ---------------------------------------------------------------------------- the plan


def _tp(sbp, sequence_parallel: bool) -> Placement | None:
    """The tp placement of a declared nd_sbp (None stays None)."""
    return None if sbp is None else placements(sbp, ("tp",), sequence_parallel)[0]


# What each torch style does to a layer's parameters: (torch layer, the declared output's
# kind) -> (weight SBP, bias SBP). A declaration must agree, since torch cannot split otherwise.
_STYLES = {
    (nn.Linear, "col"): (split(0), split(0)),
    (nn.Linear, "row"): (split(1), broadcast),
    (nn.Embedding, "col"): (split(1), None),
    (nn.Embedding, "row"): (split(0), None),
}


def _split_style(name: str, m: nn.Module, decl: LayerSBP, sp: bool, stream: Placement) -> ParallelStyle:
    """The torch style that realises ``m``'s declared split, or a one-line refusal."""
    weight, out, inp = _tp(decl.weight, sp), _tp(decl.output, sp), _tp(decl.input, sp)
    bias = _tp(decl.bias, sp) if getattr(m, "bias", None) is not None else None
    kind = "row" if isinstance(out, Partial) else "col" if isinstance(out, Shard) else None
    base = next((t for t in (nn.Linear, nn.Embedding) if isinstance(m, t)), None)
    expected = _STYLES.get((base, kind))
    if expected is None or expected[0] != weight or (bias is not None and expected[1] != bias):
        raise UsageError(f"{name} ({type(m).__name__}) declares weight {weight}, bias {bias}, output {out}, a split "
                         f"torch's styles cannot make; declare it with the shorthand of Linear1D or Embedding instead")
    if kind == "row":
        # The partial sums are reduced straight into the hidden states' layout.
        return RowwiseParallel(input_layouts=inp, output_layouts=stream)
    return ColwiseParallel(input_layouts=inp, output_layouts=out, use_local_output=not _is_head(decl))


def _is_head(decl: LayerSBP) -> bool:
    # A column split reading the residual stream itself (not inside a gathering block) is an LM head.
    return decl.input[1] is hidden


def _under(name: str, prefixes: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan (module name -> style) that ``model``'s declared SBP asks for."""
    sp = sequence_parallel
    stream = _tp(nd_sbp(split(0), hidden), sp)  # where hidden states live between blocks
    plan: dict[str, ParallelStyle] = {}
    owned: set[str] = set()  # modules whose whole subtree's parameters a plan entry distributes
    for name, m in model.named_modules():
        if not name or _under(name, owned):
            continue
        decl = declared_sbp(m)
        if decl is None:
            if any(True for _ in m.parameters(recurse=False)):
                if any(True for _ in m.children()):
                    raise UsageError(f"{name} ({type(m).__name__}) has its own parameters and submodules but "
                                     f"declares no SBP; move the parameters into a leaf layer or set `sbp = "
                                     f"declare(weight=broadcast)` (libai_lite.sbp) on it to replicate it "
                                     f"whole under tensor parallelism")
                plan[name] = ReplicateParallel()
                owned.add(name)
            continue
        if decl.weight is None:
            continue  # a block: its layers declare their own parameters
        out = _tp(decl.output, sp)
        if isinstance(_tp(decl.weight, sp), Shard):
            plan[name] = _split_style(name, m, decl, sp, stream)
        elif sp and _tp(decl.input, sp) == stream and out == stream:
            plan[name] = _BroadcastSequenceParallel(use_local_output=True)
        elif isinstance(out, Shard) and _tp(decl.input, sp) == out:
            # Acting on each rank's slice alone (a per-head norm): DTensor then sums the weight's gradient.
            plan[name] = ReplicateParallel(output_layout=out, input_layout=out)
        else:
            # Under sequence parallelism a replicated lookup joining the hidden states (positions)
            # returns its slice; on -2, since its output may lack the batch dimension.
            plan[name] = ReplicateParallel(output_layout=Shard(-2) if sp and out == stream else Replicate())
        owned.add(name)
    if sp:
        _gather_sequence(model, plan, owned)
    return plan


def _gather_sequence(model: nn.Module, plan: dict[str, ParallelStyle], owned: set[str]) -> None:
    """Sequence-parallel entries: dropouts act on the slice, blocks needing whole inputs gather them."""
    # DTensor dropout keeps shards' masks independent where torch supports it.
    for name, m in model.named_modules():
        if isinstance(m, nn.Dropout) and not _under(name, owned):
            plan[name] = SequenceParallel(use_local_output=True)
    gathered: set[str] = set()
    for name, m in model.named_modules():
        if _under(name, gathered) or _under(name, owned):
            continue
        decl = declared_sbp(m)
        if decl is not None and decl.weight is None:
            needs_whole = _tp(decl.input, True) == broadcast
            indices, names = decl.arg_positions(m.forward)
        elif decl is None:
            # An undeclared block calling column-split linears directly hands them its first input.
            needs_whole = any(isinstance(c, nn.Linear) and isinstance(s := plan.get(_join(name, cn)), ColwiseParallel)
                              and s.use_local_output for cn, c in m.named_children())
            indices, names = (0,), ("hidden_states",)
        else:
            continue
        if needs_whole and not name:
            raise UsageError(f"{type(m).__name__} owns column-parallel layers directly; sequence parallelism gathers a "
                             f"block's inputs, so put them in a submodule (an attention or MLP block)")
        if needs_whole:
            plan[name] = GatherSequence(indices=indices, names=names)
            gathered.add(name)


def check_sequence_parallel_split(length: int, tp: int, what: str = "the sequences") -> None:
    """Refuse a sequence length that sequence parallelism cannot split over ``tp`` ranks; gloo would abort."""
    if tp > 1 and length % tp:
        raise UsageError(f"sequence parallelism splits the sequence over tensor_parallel_size={tp} ranks, but "
                         f"{what} have {length} tokens: use a sequence length divisible by {tp} or set "
                         f"train.dist.sequence_parallel=False")


def _sequence_divides(tp: int):
    """Forward pre-hook refusing token ids ``[batch, seq]`` whose ``seq`` the tp ranks cannot share."""

    def check(module, args, kwargs):
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor) and t.ndim == 2 and not t.is_floating_point():
                check_sequence_parallel_split(t.shape[1], tp, "a batch's sequences")

    return check


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Split ``model`` over the 1-D ``tp_mesh`` as its layers' SBP declares, in place, and return it.

    Tied weights are distributed separately, so ``tie_weights()`` re-ties them on every submodule
    that has it. Run forward and backward under ``loss_parallel_context(True)`` when the model takes
    a cross entropy of vocab-sharded logits.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs the 1-D tp mesh (e.g. mesh['tp']), got {tp_mesh}")
    if tp_mesh.size() == 1:
        return model
    check_declared_splits(model, tp_mesh.size())
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model, sequence_parallel))
    if sequence_parallel:
        model.register_forward_pre_hook(_sequence_divides(tp_mesh.size()), with_kwargs=True)
    for m in model.modules():
        tie_weights(m)
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(f"tensor parallelism left parameters undistributed: {plain[:5]}")
    return model


def loss_parallel_context(enabled: bool):
    """torch's ``loss_parallel()`` (``F.cross_entropy`` of vocab-sharded logits from per-shard max and
    sum-exp) when ``enabled``, else a no-op. Wrap forward AND backward in it."""
    return loss_parallel() if enabled else contextlib.nullcontext()

