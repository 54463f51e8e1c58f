"""Activations measured, not modelled: one forward and backward (and an optimizer step) under ``FakeTensorMode``,
every storage allocated and freed recorded with where it happened."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Mapping, Sequence

import torch
from torch import nn


def optimizer_step_temporaries(optimizer_factory: Callable | None, groups: Sequence[Sequence[tuple[int, ...]]],
                                dtype: torch.dtype = torch.float32) -> int:
    """Peak bytes an optimizer step allocates beyond its state, measured by stepping it on fake parameters of
    these shapes, one list of shapes per parameter group."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    with FakeTensorMode():
        params = [[nn.Parameter(torch.empty(shape, dtype=dtype)) for shape in g] for g in groups if g]
        for p in (p for g in params for p in g):
            p.grad = torch.empty_like(p)
        opt = (optimizer_factory([{"params": g} for g in params]) if optimizer_factory is not None
               else torch.optim.AdamW([{"params": g} for g in params]))
        opt.step()  # allocates the state
        state = {"live": 0, "peak": 0}
        seen = weakref.WeakKeyDictionary()

        def free(nbytes):
            state["live"] -= nbytes

        class _Peak(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        for st in get_untyped_storages(t):
                            if st not in seen:
                                seen[st] = weakref.finalize(st, free, st.nbytes())
                                state["live"] += st.nbytes()
                                state["peak"] = max(state["peak"], state["live"])
                return out

        for t in [*(p for g in params for p in g), *(p.grad for g in params for p in g),
                  *(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v))]:
            for st in get_untyped_storages(t):
                seen[st] = weakref.finalize(st, lambda: None)
        with _Peak():
            opt.step()
    return int(state["peak"])



# ------------------------------------------------------------------------------------------------ activations


@dataclass
class ActivationTrace:
    """One micro-batch's forward+backward as storage allocations and frees, in order.

    ``events``: ``(bytes, layer, unit, split, backward, allocation)``, bytes negative for a free; ``layer``: the
    pipeline layer index of the piece running (None outside every piece); ``unit``: the transformer layer
    (FSDP unit) running, None for the root; ``split``: the tensor lies in a tensor-parallel split region;
    ``backward``: it happened in backward; ``allocation``: the index of the storage's allocation event.
    ``forward_end``: index of the first event after the forward. ``block_inputs``: allocations that were
    the input of a split block, which sequence parallelism gathers whole before the block keeps it.
    """

    events: list[tuple[int, int | None, int | None, bool, bool, int]]
    forward_end: int
    num_units: int
    block_inputs: set[int] = field(default_factory=set)


_aten = torch.ops.aten


def _worst_case_indices(indices):
    """Boolean masks replaced by the long indices of an all-true mask (the largest selection)."""
    out = []
    for idx in indices:
        if isinstance(idx, torch.Tensor) and idx.dtype == torch.bool:
            out += [idx.new_zeros((idx.numel(),), dtype=torch.long) for _ in range(idx.dim())]
        else:
            out.append(idx)
    return out


def _worst_case_dispatch(func, args, kwargs):
    """Run ``func`` on fake tensors; ops whose output size depends on values take their largest size, and a
    value read back to Python (``.item()``, ``.tolist()``) reads 0: fake tensors carry no values."""
    if func is _aten.nonzero.default:
        x = args[0]
        return x.new_empty((x.numel(), x.dim()), dtype=torch.long)
    if func is _aten.masked_select.default:
        return args[0].new_empty((torch.broadcast_shapes(args[0].shape, args[1].shape).numel(),))
    if func is _aten.bincount.default:
        minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
        return args[0].new_zeros((max(int(minlength), 1),), dtype=torch.long if len(args) < 2 or args[1] is None
                                 else args[1].dtype)
    if func is _aten.split_with_sizes.default and sum(args[1]) != args[0].shape[args[2] if len(args) > 2 else 0]:
        # Sizes read back from values (tokens per expert) are unknown: an even share each, balanced routing.
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        total, parts = args[0].shape[dim], len(args[1])
        sizes = [total // parts + (i < total % parts) for i in range(parts)]
        return func(args[0], sizes, dim)
    if func is _aten._local_scalar_dense.default:
        return False if args[0].dtype == torch.bool else 0
    if func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                _aten._index_put_impl_.default):
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            args = (args[0], _worst_case_indices(args[1]), *args[2:])
    return func(*args, **kwargs)


class _AcceleratorKernels:
    """Trace on CPU fake tensors as the job's accelerator would run: attention through the flash kernel,
    which keeps no ``[seq, seq]`` scores, and the fused loss's scratch at its accelerator size. Both are
    swapped in as module attributes, so recomputation in backward takes the same path as the forward."""

    def __init__(self, device: str):
        self.device = device
        self.patches: list = []

    def __enter__(self):
        from ..layers import loss

        if self.device == "cpu":
            return self
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            enable_gqa=False):
            if attn_mask is not None and attn_mask.requires_grad:
                # A learned bias (T5's relative positions) needs its gradient: the accelerator's memory-efficient
                # kernel takes it, a flash kernel does not; the math path stands in for it.
                return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
            if enable_gqa and key.shape[-3] != query.shape[-3]:
                repeat = query.shape[-3] // key.shape[-3]
                key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
            return _aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

        original_rows = loss.scratch_rows
        device = torch.device(self.device)
        self.patches = [(torch.nn.functional, "scaled_dot_product_attention", sdpa),
                        (loss, "scratch_rows", original_rows)]
        torch.nn.functional.scaled_dot_product_attention = fused_attention
        loss.scratch_rows = lambda probs: original_rows(SimpleNamespace(device=device, shape=probs.shape))
        return self

    def __exit__(self, *exc):
        for module, name, value in self.patches:
            setattr(module, name, value)
        return False


def _split_regions(model: nn.Module, root: str) -> tuple[dict[str, nn.Module], set[str]]:
    """ModTracker names of the blocks whose interior tensor parallelism splits (those declaring whole inputs
    and holding a split layer: attention, MLP; sequence parallelism gathers their inputs) with the blocks,
    and the names of the layers inside them whose output is whole again (row-split, norms)."""
    from torch.distributed.tensor import Replicate, Shard

    from ..sbp import placements
    from ..parallel.tensor_parallel import declared_sbp

    def splits_weight(m):
        d = declared_sbp(m)
        return d is not None and d.weight is not None and isinstance(placements(d.weight, ("tp",))[0], Shard)

    blocks, whole = {}, set()
    for name, m in model.named_modules():
        decl = declared_sbp(m)
        if decl is None:
            continue
        full = f"{root}.{name}" if name else root
        if decl.weight is None:
            if isinstance(placements(decl.input, ("tp",), True)[0], Replicate) and any(splits_weight(c) for c in m.modules()):
                blocks[full] = m
        elif not isinstance(placements(decl.output, ("tp",))[0], Shard):
            whole.add(full)
    return blocks, whole


def _head_split_sizes(model: nn.Module) -> set[int]:
    """Full sizes of the dimensions split over tp of layers reading the residual stream (an LM head's vocabulary)."""
    from torch.distributed.tensor import Shard

    from ..sbp import hidden, placements
    from ..parallel.tensor_parallel import declared_sbp

    sizes = set()
    for m in model.modules():
        decl = declared_sbp(m)
        weight = m._parameters.get("weight") if decl is not None and decl.weight is not None else None
        if weight is not None and decl.input[1] is hidden and isinstance(tp := placements(decl.weight, ("tp",))[0], Shard):
            sizes.add(weight.shape[tp.dim % weight.ndim])
    return sizes


def trace_activations(build: Callable[[], nn.Module], batch: Mapping[str, torch.Tensor], *,
                      amp_dtype: torch.dtype | None = None, activation_checkpoint_every: int = 0,
                      activation_checkpoint_mode: str = "full", device: str = "cpu") -> ActivationTrace:
    """Forward ``build()`` on one micro-batch ``batch`` and back-propagate its declared losses under
    ``FakeTensorMode``, recording every storage allocated and freed. Parameter gradients are dropped as they
    are made, since the caller counts them with the static bytes. ``device`` is the job's device kind."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from ..layers.flex_attention import attention_backend
    from ..model import output_metrics
    from ..converters.activation_checkpoint import apply_activation_checkpointing, transformer_layers
    from ..parallel.pipeline_split import layer_index_of, pipeline_module, pipeline_pieces

    with FakeTensorMode() as fake:
        model = build()
        if activation_checkpoint_every:
            apply_activation_checkpointing(model, activation_checkpoint_every, activation_checkpoint_mode)
        fake_batch = {k: fake.from_tensor(v) if torch.is_tensor(v) else v for k, v in batch.items()}
    root = type(model).__name__
    names = {id(m): f"{root}.{n}" if n else root for n, m in model.named_modules()}
    blocks, whole = _split_regions(model, root)
    heads = _head_split_sizes(model)
    piece_layer = {names[id(m)]: idx for _c, key, m in pipeline_pieces(pipeline_module(model))
                   if (idx := layer_index_of(m, key)) is not None}
    units = transformer_layers(model)
    unit_of = {names[id(m)]: i for i, m in enumerate(units)}
    # Activation checkpointing wraps a layer: what runs inside is the wrapped module.
    for table in (piece_layer, unit_of):
        table.update({f"{k}._checkpoint_wrapped_module": v for k, v in list(table.items())})
    param_shapes = {(tuple(p.shape), p.dtype) for p in model.parameters()}
    losses = [name for name, metric in output_metrics(model).items() if metric.backward]
    events: list = []
    live = weakref.WeakKeyDictionary()  # storage -> (bytes, tag, allocation index, finalizer recording its free)
    block_inputs: set[int] = set()
    tracker = ModTracker()

    def watch(st, nbytes, tag, index):
        live[st] = (nbytes, tag, index, weakref.finalize(st, events.append, (-nbytes, *tag, index)))

    def mark_inputs(_module, args, kwargs):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                for st in get_untyped_storages(t):
                    if (entry := live.get(st)) is not None and entry[0]:
                        block_inputs.add(entry[2])

    class _Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = _worst_case_dispatch(func, args, kwargs or {})
            parents = tracker.parents
            tag = (next((piece_layer[p] for p in parents if p in piece_layer), None),
                   next((unit_of[p] for p in parents if p in unit_of), None),
                   any(p in blocks for p in parents) and not any(p in whole for p in parents),
                   tracker.is_bw)
            if (tag[3] and func is _aten.add.Tensor and isinstance(out, torch.Tensor)
                    and (tuple(out.shape), out.dtype) in param_shapes and isinstance(args[0], torch.Tensor)
                    and (old := live.get(args[0].untyped_storage())) is not None and old[0] and old[3].alive):
                # Autograd sums the gradients of a weight used twice (a tied embedding and head) into the
                # first one in place; on fake tensors it allocates a new one. The sum takes the first's bytes.
                old[3].detach()
                watch(out.untyped_storage(), old[0], old[1], old[2])
                return out
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    # The loss over a vocabulary-split head is this rank's slice of the vocabulary, wherever it
                    # is computed: a tensor with a vocabulary-sized end is split.
                    t_tag = tag if tag[2] or not t.dim() or {t.shape[0], t.shape[-1]}.isdisjoint(heads) else (
                        tag[0], tag[1], True, tag[3])
                    for st in get_untyped_storages(t):
                        if st not in live:
                            events.append((st.nbytes(), *t_tag, len(events)))
                            watch(st, st.nbytes(), t_tag, len(events) - 1)
            return out

    # What exists before the forward (parameters, buffers, the batch) is no activation: views of it
    # pass through the recorder and must not count.
    for t in [*model.parameters(), *model.buffers(), *(v for v in fake_batch.values() if torch.is_tensor(v))]:
        for st in get_untyped_storages(t):
            live[st] = (0, None, None, weakref.finalize(st, lambda: None))
    autocast = torch.autocast("cpu", dtype=amp_dtype, enabled=amp_dtype is not None)
    # Dense attention even where flex is forced: flex's operator has no rule under the recorder, and its
    # failure there left the run's first real flex call failing too.
    with fake, _AcceleratorKernels(device), tracker, _Record(), attention_backend("dense"):
        handles = [p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
                   for p in model.parameters() if p.requires_grad]
        handles += [m.register_forward_pre_hook(mark_inputs, with_kwargs=True) for m in blocks.values()]
        with autocast:
            out = model(**fake_batch)
        # What the trainer back-propagates: the sum of the outputs the model declares as losses.
        loss = sum(out[name] for name in losses if name in out)
        del out
        forward_end = len(events)
        loss.backward()
        del loss
        for h in handles:
            h.remove()
    return ActivationTrace(events, forward_end, len(units), block_inputs)

