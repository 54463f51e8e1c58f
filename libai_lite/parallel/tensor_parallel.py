"""Tensor (and sequence) parallelism from the layers' declared intent.

The layers in ``libai_lite.layers`` never communicate; they only say how they would be
split (``Linear1D.parallel`` in ``"col" | "row" | "data"``, ``VocabEmbedding.parallel ==
"vocab"``). This module reads that intent and hands one ``parallelize_module`` plan to
``torch.distributed.tensor.parallel`` (torchtitan's shape: one small function per job):

==========================================  ==================================================
declared intent                             plan entry (tp mesh)
==========================================  ==================================================
``VocabEmbedding``                          ``RowwiseParallel(input_layouts=Replicate())``;
                                            output ``Replicate()``, or ``Shard(1)`` (sequence)
                                            with sequence parallelism
``Linear1D(parallel="col")``                ``ColwiseParallel()``
LM head (a "col" ``Linear1D`` tied to a     ``ColwiseParallel(output_layouts=Shard(-1),
``VocabEmbedding`` or named ``lm_head``)    use_local_output=False)``: logits stay a
                                            vocab-sharded DTensor for ``loss_parallel``
                                            (the training loss skips the module and
                                            fuses head and loss on its weight shard)
``Linear1D(parallel="row")``                ``RowwiseParallel()`` (output ``Shard(1)`` with SP)
``nn.Embedding`` with ``parallel="col"``    ``ColwiseParallel()``: the table is split on dim 1.
                                            This is how T5's relative-attention bias
                                            (``[num_buckets, num_heads]``) hands every rank
                                            the bias of exactly its own heads
anything else with parameters (norms,       replicated DTensor parameters; with sequence
position embeddings, ``parallel="data"``)   parallelism norms and dropouts use
                                            ``SequenceParallel`` and replicated embeddings
                                            return their slice of the sequence. A module
                                            marked ``parallel="data"`` is replicated whole,
                                            submodules included; under sequence parallelism
                                            it must be given whole (gathered) activations
==========================================  ==================================================

Every parameter ends up a DTensor on the tp mesh, including the replicated ones: torch's
``clip_grad_norm_`` refuses a mix of DTensor and plain gradients, and one kind of
parameter keeps the optimizer and DCP checkpoints uniform.

Sequence parallelism (Megatron's "Reducing Activation Recomputation") keeps the residual
stream as this rank's slice of the sequence (a plain ``[batch, seq / tp, hidden]``
tensor): row-parallel outputs are reduce-scattered onto it, and the blocks that own
column-parallel layers (attention, MLP) all-gather their inputs first, as torchtitan's
``PrepareModuleInput`` does. Models must therefore be batch-first with the sequence on
dim 1, and must take sequence lengths from ``input_ids`` rather than from hidden states.
"""
from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
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

from ..layers import Linear1D, MultiheadAttention, RMSLayerNorm, VocabEmbedding
from ..utils.errors import UsageError

__all__ = ["apply_tensor_parallel", "check_tensor_parallel", "loss_parallel_context"]

# (config keys tried in order, what the number counts) for each size tp must divide. GPT and
# LiBai's MT5 use the first names, Hugging Face's T5/mT5 the second. T5's per-head width
# (`d_kv`) is deliberately absent: tensor parallelism splits heads, never a head.
_DIVISIBLE = (
    (("num_attention_heads", "num_heads"), "the number of heads"),
    (("hidden_size", "d_model"), "the hidden size"),
    (("ffn_hidden_size", "intermediate_size", "d_ff"), "the feed-forward size"),
    (("vocab_size",), "the padded vocabulary size"),
)

_NORMS = (nn.LayerNorm, nn.RMSNorm, RMSLayerNorm)


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
    tp = int(tp_size)
    if tp < 1:
        raise UsageError(f"tensor_parallel_size={tp_size} must be at least 1")
    for keys, what in _DIVISIBLE:
        key = next((k for k in keys if model_cfg.get(k) is not None), None)
        if key is None:
            continue
        value = int(model_cfg[key])
        if value % tp:
            hint = (
                "; the vocabulary is padded to a multiple of tokenization.make_vocab_size_divisible_by x "
                "tensor_parallel_size, so set model.cfg.vocab_size from the tokenizer"
                if key == "vocab_size"
                else f"; use a tensor_parallel_size that divides {what} ({_divisors(value)})"
            )
            raise UsageError(f"tensor_parallel_size={tp} does not divide model.cfg.{key}={value}{hint}")
    if sequence_parallel and seq_length is not None and int(seq_length) % tp:
        raise UsageError(
            f"tensor_parallel_size={tp} does not divide the sequence length {seq_length}, which sequence "
            f"parallelism splits; use a seq_length that is a multiple of {tp} or turn sequence parallelism off"
        )


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


def _lm_head_names(model: nn.Module) -> set[str]:
    """Column-parallel Linear1D layers that produce logits: tied to a VocabEmbedding or named ``lm_head``."""
    vocab_weights = {id(m.weight) for m in model.modules() if isinstance(m, VocabEmbedding)}
    return {
        name
        for name, m in model.named_modules()
        if isinstance(m, Linear1D)
        and m.parallel == "col"
        and (id(m.weight) in vocab_weights or name.rsplit(".", 1)[-1] == "lm_head")
    }


def _under(name: str, prefixes: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan (module name -> style) that ``model``'s declared intent asks for."""
    sp = sequence_parallel
    heads = _lm_head_names(model)
    plan: dict[str, ParallelStyle] = {}
    owned: set[str] = set()  # modules whose whole subtree's parameters a plan entry distributes

    def put(name: str, style: ParallelStyle) -> None:
        plan[name] = style
        owned.add(name)

    for name, m in model.named_modules():
        if not name or _under(name, owned):
            continue
        intent = getattr(m, "parallel", None)
        if isinstance(m, VocabEmbedding):
            put(name, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()))
        elif name in heads:
            put(name, ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                      output_layouts=Shard(-1), use_local_output=False))
        elif isinstance(m, nn.Linear) and intent == "col":
            put(name, ColwiseParallel())
        elif isinstance(m, nn.Linear) and intent == "row":
            put(name, RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()))
        elif isinstance(m, nn.Embedding) and intent == "col":
            put(name, ColwiseParallel())
        elif isinstance(m, nn.Embedding) and name.rsplit(".", 1)[-1] == "relative_attention_bias":
            raise UsageError(
                f"{name} is a per-head relative attention bias left replicated, but attention under tensor "
                f"parallelism needs this rank's heads only; set `{name}.parallel = \"col\"` in the model so it "
                f"is split over heads"
            )
        elif sp and isinstance(m, _NORMS):
            put(name, _BroadcastSequenceParallel(use_local_output=True))
        elif sp and isinstance(m, nn.Embedding):
            # Replicated embeddings (positions, token types) are added to the residual
            # stream, which holds this rank's slice of the sequence: their dim -2.
            put(name, ReplicateParallel(output_layout=Shard(-2)))
        elif intent == "data" or isinstance(m, (nn.Linear, nn.Embedding) + _NORMS):
            put(name, ReplicateParallel())
        elif any(True for _ in m.parameters(recurse=False)):
            if any(True for _ in m.children()):
                raise UsageError(
                    f"{name} ({type(m).__name__}) has its own parameters and submodules but declares no "
                    f"parallel intent; move the parameters into a leaf layer or set `parallel = \"data\"` "
                    f"on it to replicate it whole under tensor parallelism"
                )
            put(name, ReplicateParallel())

    if sp:
        # Activations are sharded on the sequence between blocks: dropouts act on the
        # slice (DTensor dropout keeps shards' masks independent where torch supports
        # it), and every block that owns column-parallel layers gathers its inputs once.
        for name, m in model.named_modules():
            if isinstance(m, nn.Dropout) and not _under(name, owned):
                plan[name] = SequenceParallel(use_local_output=True)
        gathered: set[str] = set()
        for name, m in model.named_modules():
            if _under(name, gathered) or _under(name, {n for n in owned if n}):
                continue
            owns_col = any(
                isinstance(c, nn.Linear) and getattr(c, "parallel", None) == "col"
                and (f"{name}.{cn}" if name else cn) not in heads
                for cn, c in m.named_children()
            )
            if not owns_col:
                continue
            if isinstance(m, MultiheadAttention):
                style = GatherSequence(indices=(0, 2), names=("hidden_states", "encoder_states"))
            else:
                style = GatherSequence(indices=(0,), names=("hidden_states",))
            if not name:
                raise UsageError(
                    f"{type(m).__name__} owns column-parallel layers directly; sequence parallelism gathers a "
                    f"block's inputs, so put them in a submodule (an attention or MLP block)"
                )
            plan[name] = style
            gathered.add(name)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Split ``model`` over the 1-D ``tp_mesh`` as its layers declare, in place, and return it.

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
