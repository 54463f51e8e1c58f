"""Tensor (and sequence) parallelism from the SBP the layers declare.

The layers in ``libai_lite.layers`` never communicate; each declares the SBP of its
parameters and activations (``module.sbp``, a ``libai_lite.parallel.sbp.LayerSBP``, which
``parallel="col" | "row" | "data" | "vocab"`` is shorthand for). This module turns the tp
entries of those declarations into one ``parallelize_module`` plan (torchtitan's shape: one
small function per job):

========================================  ====================================================
declared SBP (tp)                         plan entry (tp mesh)
========================================  ====================================================
weight ``split``, output ``partial_sum``  ``RowwiseParallel(input_layouts=<input>)``, summed
(row ``Linear1D``, ``VocabEmbedding``)    straight into the hidden states' layout (``hidden``)
weight ``split``, output ``split(-1)``    ``ColwiseParallel(input_layouts=<input>)``; a table
(col ``Linear1D``, T5's bias table)       split on dim 1 hands each rank its own heads' bias
the LM head: a col ``nn.Linear`` sharing  ``ColwiseParallel(output_layouts=Shard(-1),
a vocab-split embedding's weight, or      use_local_output=False)`` on the hidden states:
named ``lm_head``                         vocab-sharded logits for ``loss_parallel``
weight ``broadcast``                      replicated DTensor parameters; under sequence
                                          parallelism a layer taking and giving ``hidden`` (a
                                          norm) runs on the slice, one giving ``hidden`` from
                                          whole inputs (positions) returns its slice, and a
                                          module holding submodules is replicated whole
a block (``weight`` None) with input      under sequence parallelism its declared ``args``
``broadcast`` (attention, MLP)            are all-gathered before it runs
========================================  ====================================================

A split torch's styles cannot make (each splits an ``nn.Linear`` or ``nn.Embedding`` weight on
one fixed dimension) is refused; plain torch layers read as their replicated ``libai_lite``
counterparts. Every parameter ends up a DTensor on the tp mesh, replicated ones included:
``clip_grad_norm_`` refuses a mix of DTensor and plain gradients, and one kind of parameter
keeps the optimizer and DCP checkpoints uniform.

Sequence parallelism (Megatron's "Reducing Activation Recomputation") keeps the residual
stream as this rank's slice of the sequence (a plain ``[batch, seq / tp, hidden]`` tensor):
row-parallel outputs are reduce-scattered onto it, and blocks all-gather their inputs first,
as torchtitan's ``PrepareModuleInput`` does. Models must therefore be batch-first with the
sequence on dim 1 and take sequence lengths from ``input_ids``, not from hidden states.
"""
from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_map

from ..layers.embedding import SBP_SHORTHAND as EMBEDDING_SBP
from ..layers.layer_norm import LayerNorm
from ..layers.linear import SBP_SHORTHAND as LINEAR_SBP
from ..utils.errors import UsageError
from .sbp import LayerSBP, broadcast, hidden, nd_sbp, placements, split

__all__ = ["apply_tensor_parallel", "check_declared_splits", "check_tensor_parallel", "loss_parallel_context"]

# (config keys tried in order, what the number counts) for each size tp must divide. GPT and
# LiBai's MT5 use the first names, Hugging Face's T5/mT5 the second. T5's per-head width
# (`d_kv`) is deliberately absent: tensor parallelism splits heads, never a head.
_DIVISIBLE = (
    (("num_attention_heads", "num_heads"), "the number of heads"),
    (("hidden_size", "d_model"), "the hidden size"),
    (("ffn_hidden_size", "intermediate_size", "d_ff"), "the feed-forward size"),
    (("vocab_size",), "the padded vocabulary size"),
)

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


_VOCAB_HINT = ("; the vocabulary is padded to a multiple of tokenization.make_vocab_size_divisible_by x "
               "tensor_parallel_size, so set model.cfg.vocab_size from the tokenizer")


def _tp_size(tp_size) -> int:
    if int(tp_size) < 1:
        raise UsageError(f"tensor_parallel_size={tp_size} must be at least 1")
    return int(tp_size)


def _divisors(n: int) -> str:
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ds[0] if len(ds) == 1 else ", ".join(ds[:-1]) + " or " + ds[-1]


def check_tensor_parallel(
    model_cfg: Mapping, tp_size: int, sequence_parallel: bool = False, seq_length: int | None = None
) -> None:
    """Refuse, before any work, a tensor-parallel size the model cannot be split by.

    ``tp_size`` must divide the head count, hidden size, feed-forward size and padded
    vocabulary of ``model_cfg`` (GPT, LiBai MT5 or Hugging Face T5 key names; keys a
    model does not have are skipped). With ``sequence_parallel`` it must also divide
    ``seq_length`` when given. Raises ``UsageError`` with one line naming the numbers.
    """
    tp = _tp_size(tp_size)
    for keys, what in _DIVISIBLE:
        key = next((k for k in keys if model_cfg.get(k) is not None), None)
        if key is None:
            continue
        value = int(model_cfg[key])
        if value % tp:
            hint = (
                _VOCAB_HINT
                if key == "vocab_size"
                else f"; use a tensor_parallel_size that divides {what} ({_divisors(value)})"
            )
            raise UsageError(f"tensor_parallel_size={tp} does not divide model.cfg.{key}={value}{hint}")
    if sequence_parallel and seq_length is not None and int(seq_length) % tp:
        raise UsageError(
            f"tensor_parallel_size={tp} does not divide the sequence length {seq_length}, which sequence "
            f"parallelism splits; use a seq_length that is a multiple of {tp} or turn sequence parallelism off"
        )


def check_declared_splits(model: nn.Module, tp_size: int) -> None:
    """Refuse a tensor-parallel size that does not divide every dimension ``model``'s layers declare split.

    ``model`` may live on the meta device. A split dimension must hold a multiple of
    ``tp_size`` whole blocks of its declared ``unit`` (an attention head's width). Raises
    ``UsageError`` with one line naming the parameter, its size and the sizes that work.
    """
    tp = _tp_size(tp_size)
    seen: set[int] = set()
    for name, m in model.named_modules():
        decl = declared_sbp(m)
        if decl is None or decl.weight is None:
            continue
        for p_name, sbp in (("weight", decl.weight), ("bias", decl.bias)):
            param, where = m._parameters.get(p_name), _join(name, p_name)
            s = _tp(sbp, False)
            if param is None or not isinstance(s, Shard) or id(param) in seen:
                continue
            seen.add(id(param))
            dim = s.dim % param.ndim
            blocks = param.shape[dim] // decl.unit
            if blocks % tp == 0:
                continue
            what = f"{blocks}" if decl.unit == 1 else f"{blocks} blocks of {decl.unit} (whole heads)"
            hint = (
                _VOCAB_HINT
                if isinstance(m, nn.Embedding) and dim == 0
                else f"; use a tensor_parallel_size that divides {blocks} ({_divisors(blocks)})"
            )
            raise UsageError(f"tensor_parallel_size={tp} does not divide dim {dim} of {where}: {what}{hint}")


# ---------------------------------------------------------------------------- styles


def _to_dtensor(x: Any, mesh: DeviceMesh, layout: Placement, desired: Placement) -> Any:
    """A plain tensor declared to be ``layout`` on ``mesh`` (or a DTensor), redistributed to ``desired``."""
    if isinstance(x, DTensor):
        return x if x.placements == (desired,) else x.redistribute(placements=(desired,))
    if isinstance(x, torch.Tensor):
        t = DTensor.from_local(x, mesh, (layout,), run_check=False)
        return t if layout == desired else t.redistribute(placements=(desired,))
    return x


class ReplicateParallel(ParallelStyle):
    """Replicate a module's parameters as DTensors and run it on replicated inputs.

    torch has no built-in style for "replicated under tensor parallelism" (torchtitan
    writes the same thing as ``NoParallel``). Parameters are broadcast from the mesh's
    first rank (``distribute_module``), every tensor argument that is not yet a DTensor
    is taken as ``Replicate()``, and outputs come back as local tensors redistributed to
    ``output_layout`` first (``Shard(-2)`` hands a position embedding's output back as
    this rank's slice of the sequence under sequence parallelism).
    """

    def __init__(self, output_layout: Placement = Replicate()):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh)
        rep = Replicate()

        def conv(x):
            return _to_dtensor(x, device_mesh, rep, rep)

        def pre_hook(_mod, args, kwargs):
            return tuple(conv(a) for a in args), {k: conv(v) for k, v in kwargs.items()}

        def post_hook(_mod, _args, output):
            def local(x):
                if not isinstance(x, DTensor):
                    return x
                if x.placements != (self.output_layout,):
                    x = x.redistribute(placements=(self.output_layout,))
                return x.to_local()

            return tree_map(local, output)

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        module.register_forward_hook(post_hook)
        return module

    def __repr__(self) -> str:
        return f"ReplicateParallel(output_layout={self.output_layout})"


class GatherSequence(ParallelStyle):
    """All-gather a block's sequence-sharded inputs before it runs (sequence parallelism).

    torch's ``PrepareModuleInput`` wants one layout per positional argument, but the
    attention's arguments vary by call site (masks and position bias are already whole
    and must not be gathered), so this names the arguments instead: positional ``indices``
    and keyword ``names``. Each named input, a local ``Shard(1)`` slice, is gathered into
    the full local tensor the block's column-parallel layers expect.
    """

    def __init__(self, indices: tuple[int, ...] = (0,), names: tuple[str, ...] = ()):
        super().__init__()
        self.indices = tuple(indices)
        self.names = tuple(names)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        seq, rep = Shard(1), Replicate()

        def gather(x):
            t = _to_dtensor(x, device_mesh, seq, rep)
            return t.to_local() if isinstance(t, DTensor) else t

        def pre_hook(_mod, args, kwargs):
            args = tuple(gather(a) if i in self.indices else a for i, a in enumerate(args))
            kwargs = {k: gather(v) if k in self.names else v for k, v in kwargs.items()}
            return args, kwargs

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"GatherSequence(indices={self.indices}, names={self.names})"


class _BroadcastSequenceParallel(SequenceParallel):
    """``SequenceParallel`` whose replicated parameters are broadcast from the first rank.

    torch's version wraps each rank's own copy (``from_local``), which is only right when
    every rank initialised or loaded identical norm weights; broadcasting makes it so.
    """

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh):
        for p_name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(
                p_name,
                nn.Parameter(distribute_tensor(param.data, device_mesh, [Replicate()]), param.requires_grad),
            )


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


def _split_style(name: str, m: nn.Module, decl: LayerSBP, sp: bool, stream: Placement, head: bool) -> ParallelStyle:
    """The torch style that realises ``m``'s declared split, or a one-line refusal."""
    weight, out = _tp(decl.weight, sp), _tp(decl.output, sp)
    bias = _tp(decl.bias, sp) if getattr(m, "bias", None) is not None else None
    kind = "row" if isinstance(out, Partial) else "col" if isinstance(out, Shard) else None
    base = next((t for t in (nn.Linear, nn.Embedding) if isinstance(m, t)), None)
    expected = _STYLES.get((base, kind))
    if expected is None or expected[0] != weight or (bias is not None and expected[1] != bias):
        raise UsageError(f"{name} ({type(m).__name__}) declares weight {weight}, bias {bias}, output {out}, a split "
                         f"torch's styles cannot make; declare it with the shorthand of Linear1D or Embedding instead")
    if kind == "row":
        # The partial sums are reduced straight into the hidden states' layout.
        return RowwiseParallel(input_layouts=_tp(decl.input, sp), output_layouts=stream)
    if head:
        return ColwiseParallel(input_layouts=stream, output_layouts=out, use_local_output=False)
    return ColwiseParallel(input_layouts=_tp(decl.input, sp), output_layouts=out)


def _lm_head_names(model: nn.Module) -> set[str]:
    """Column-split ``nn.Linear`` layers that produce logits: sharing a vocab-split embedding's weight, or named ``lm_head``."""
    def tp(m):  # the (weight, output) tp SBP ``m`` declares
        d = declared_sbp(m)
        return (None, None) if d is None or d.weight is None else (_tp(d.weight, False), _tp(d.output, False))

    vocab = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and tp(m)[0] == split(0)}
    return {name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and tp(m)[0] == split(0) and isinstance(tp(m)[1], Shard)
            and (id(m.weight) in vocab or name.rsplit(".", 1)[-1] == "lm_head")}


def _under(name: str, prefixes: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan (module name -> style) that ``model``'s declared SBP asks for."""
    sp = sequence_parallel
    stream = _tp(nd_sbp(split(0), hidden), sp)  # where hidden states live between blocks
    heads = _lm_head_names(model)
    plan: dict[str, ParallelStyle] = {}
    owned: set[str] = set()  # modules whose whole subtree's parameters a plan entry distributes

    def put(name: str, style: ParallelStyle) -> None:
        plan[name] = style
        owned.add(name)

    for name, m in model.named_modules():
        if not name or _under(name, owned):
            continue
        decl = declared_sbp(m)
        if decl is None:
            if any(True for _ in m.parameters(recurse=False)):
                if any(True for _ in m.children()):
                    raise UsageError(
                        f"{name} ({type(m).__name__}) has its own parameters and submodules but declares no SBP; "
                        f"move the parameters into a leaf layer or set `sbp = declare(weight=broadcast)` "
                        f"(libai_lite.parallel.sbp) on it to replicate it whole under tensor parallelism"
                    )
                put(name, ReplicateParallel())
            continue
        if decl.weight is None:
            continue  # a block: its layers declare their own parameters
        weight, out = _tp(decl.weight, sp), _tp(decl.output, sp)
        if isinstance(weight, Shard):
            put(name, _split_style(name, m, decl, sp, stream, name in heads))
        elif isinstance(m, nn.Embedding) and name.rsplit(".", 1)[-1] == "relative_attention_bias":
            raise UsageError(
                f"{name} is a per-head relative attention bias left replicated, but attention under tensor "
                f"parallelism needs this rank's heads only; set `{name}.parallel = \"col\"` in the model so it "
                f"is split over heads"
            )
        elif sp and _tp(decl.input, sp) == stream and out == stream:
            put(name, _BroadcastSequenceParallel(use_local_output=True))
        else:
            # Under sequence parallelism a replicated lookup joining the hidden states (positions)
            # returns its slice; on -2, since its output may lack the batch dimension.
            put(name, ReplicateParallel(output_layout=Shard(-2) if sp and out == stream else Replicate()))

    if sp:
        _gather_sequence(model, plan, owned, heads)
    return plan


def _gather_sequence(model: nn.Module, plan: dict[str, ParallelStyle], owned: set[str], heads: set[str]) -> None:
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
            needs_whole = any(
                isinstance(c, nn.Linear) and isinstance(plan.get(_join(name, cn)), ColwiseParallel)
                and _join(name, cn) not in heads
                for cn, c in m.named_children()
            )
            indices, names = (0,), ("hidden_states",)
        else:
            continue
        if needs_whole and not name:
            raise UsageError(
                f"{type(m).__name__} owns column-parallel layers directly; sequence parallelism gathers a "
                f"block's inputs, so put them in a submodule (an attention or MLP block)"
            )
        if needs_whole:
            plan[name] = GatherSequence(indices=indices, names=names)
            gathered.add(name)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Split ``model`` over the 1-D ``tp_mesh`` as its layers' SBP declares, in place, and return it.

    Builds the plan of ``tensor_parallel_plan``, applies it with ``parallelize_module``,
    then re-ties shared weights (``tie_weights()`` on every submodule that has it; tied
    layers are distributed separately). A mesh of one rank leaves the model untouched.
    Forward and backward must run under ``loss_parallel_context(True)`` when the model
    computes a cross entropy on the vocab-sharded logits.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs the 1-D tp mesh (e.g. mesh['tp']), got {tp_mesh}")
    if tp_mesh.size() == 1:
        return model
    plan = tensor_parallel_plan(model, sequence_parallel)
    parallelize_module(model, tp_mesh, plan)
    for m in model.modules():
        tie = getattr(m, "tie_weights", None)
        if callable(tie):
            tie()
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(f"tensor parallelism left parameters undistributed: {plain[:5]}")
    return model


def loss_parallel_context(enabled: bool):
    """``torch.distributed.tensor.parallel.loss_parallel()`` when ``enabled``, else a no-op context.

    Wrap forward AND backward in it (the trainer's micro-batch step, and evaluation's
    forward): it makes ``F.cross_entropy`` on vocab-sharded logits compute the softmax
    from per-shard max and sum-exp, so no rank ever holds the full-vocabulary logits.
    """
    return loss_parallel() if enabled else contextlib.nullcontext()
