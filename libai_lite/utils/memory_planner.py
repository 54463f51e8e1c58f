"""Memory per rank before a job is queued: parameters, gradients, optimizer state, activations and the peak.

Megatron-LM's ``report_theoretical_memory`` and DeepSpeed's ``estimate_zero*`` answer "will it fit" from a
formula written for one architecture. This planner asks the model instead, so a new project needs nothing:

- **static bytes** (parameters, gradients, optimizer state) are counted on the model built on the meta
  device: each parameter's shape and dtype, divided over tensor-parallel ranks where its layer declares a
  split (``libai_lite.parallel.sbp``), over expert-parallel ranks for MoE experts, kept on the pipeline
  stages the splitter gives its ``layer_idx`` (``libai_lite.parallel.pipeline_split``), and sharded over
  data-parallel ranks as the ZeRO stage does it: FSDP2's dim-0 shards (ZeRO-2/3), and for ZeRO-1
  ``ZeroRedundancyOptimizer``'s own greedy partition of whole parameters. Optimizer state per parameter
  byte is measured by stepping the configured optimizer once on a small tensor (AdamW: 2).
- **activations** are measured, not modelled: one forward and backward of the model at the configured
  micro-batch, sequence, autocast dtype and activation checkpointing runs under ``FakeTensorMode`` (shapes
  only: no memory, no arithmetic), and every storage it allocates or frees is recorded with the pipeline
  layer, the transformer layer (FSDP unit) and whether it lies in a tensor-parallel split region.
  Replaying that record with this rank's share (1/tp inside split regions, or everywhere under sequence
  parallelism; only its pipeline stage's layers) gives what the forward keeps for backward and the
  high-water mark of forward+backward. Values that decide a size at run time (a boolean mask's
  selection) take their largest size.

The replay adds what data parallelism holds at each moment: gradients as the backward produces them
(DDP's buckets hold them from the start), and FSDP's gathered parameters (ZeRO-2: every layer from its
forward to the end of backward; ZeRO-3: the layer running and, in backward, the one FSDP2 prefetches, the
last layer from forward to backward, the root's parameters while they are used). The optimizer step's own
temporaries are measured the same way, on fake parameters of the rank's shapes. ``offload`` (ZeRO-2/3) moves parameters, gradients and
optimizer state to host memory, reported as ``host`` beside the device peak. ``suggest`` tries the
cheapest changes in turn (ZeRO stage up, activation checkpointing on, a smaller micro-batch, more tensor
then pipeline parallelism), each checked against the world size and the model and re-estimated.
"""
from __future__ import annotations

import dataclasses
import math
import re
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from .errors import UsageError

GiB = 2**30

_DTYPE_NAMES = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


# ------------------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class PlanSettings:
    """Everything besides the model and its sample that decides memory per rank."""

    world_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    offload: bool = False
    activation_checkpoint_every: int = 0  # 0: off; N: every N-th transformer layer
    activation_checkpoint_mode: str = "full"  # or "selective" (libai_lite.parallel.activation_checkpoint)
    micro_batch_size: int = 1
    num_microbatches: int = 1  # gradient accumulation steps: a pipeline schedule's micro-batches
    amp_dtype: torch.dtype | None = None
    pipeline_schedule: str = "1f1b"
    virtual_pipeline_size: int = 1
    custom_pipeline_stage_id: tuple[int, ...] | None = None
    # Each sample's sequence split over cp ranks: activations divide by it; ZeRO shards over dp x cp.
    context_parallel_size: int = 1
    # "cuda": an accelerator beside host memory, where offload moves state off the device; "cpu": training in
    # host memory, where offload moves nothing (the bench's CPU rows measure exactly that).
    device: str = "cuda"

    def describe(self) -> str:
        """The layout and the memory-relevant switches, in one line."""
        cp = f" cp={self.context_parallel_size}" if self.context_parallel_size > 1 else ""
        parts = [f"pp={self.pipeline_parallel_size} dp={self.data_parallel_size}{cp} tp={self.tensor_parallel_size}"]
        if self.sequence_parallel:
            parts.append("sequence parallel")
        parts.append(f"ZeRO-{self.zero_stage}{' + offload' if self.offload else ''}" if self.zero_stage else "no ZeRO")
        if self.activation_checkpoint_every:
            every = self.activation_checkpoint_every
            parts.append(f"{self.activation_checkpoint_mode} activation checkpointing"
                         + (f" every {every} layers" if every > 1 else ""))
        parts.append(f"micro-batch {self.micro_batch_size}")
        parts.append(_DTYPE_NAMES.get(self.amp_dtype, str(self.amp_dtype)))
        return ", ".join(parts)


@dataclass
class MemoryEstimate:
    """Bytes on the fullest rank (the pipeline stage with the largest peak).

    ``params``, ``grads`` and ``optimizer`` are what the rank keeps between steps (in host memory under
    offload, then also counted in ``host``); ``activations`` what the forward keeps for backward, for every
    micro-batch a pipeline schedule holds at once; ``peak`` the device high-water mark of a training step.
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    peak: int
    host: int = 0
    stage: int = 0
    num_parameters: int = 0
    settings: PlanSettings = field(default_factory=PlanSettings)
    notes: tuple[str, ...] = ()

    @property
    def static(self) -> int:
        """Parameters + gradients + optimizer state on the rank."""
        return self.params + self.grads + self.optimizer


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"16 GB"``, ``"512MiB"``, ``"1e9"`` -> bytes (GB/MB are decimal, GiB/MiB binary)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([KMGT]i?B?|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise UsageError(f"device memory {text!r} is not a size; write it like 80GiB, 16GB or 512MiB")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper().rstrip("B") or "B"
    scale = {"B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(value * scale)


def gib(n: float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{n / GiB:.2f} GiB"


# ------------------------------------------------------------------------------------------------ static bytes


@dataclass
class _Param:
    shape: tuple[int, ...]  # this rank's tensor-parallel slice
    element_size: int
    ep: int  # 1, or the expert-parallel size for an expert's parameter (the rank holds 1/ep of the experts)
    unit: int | None  # index of the transformer layer (FSDP unit) holding it; None: the root

    @property
    def numel(self) -> float:
        return math.prod(self.shape) / self.ep

    def shard_numel(self, dp: int) -> float:
        """Elements of one FSDP2 shard: dim 0 padded up to a multiple of ``dp`` (``fully_shard``'s ``Shard(0)``)."""
        if not self.shape:
            return 1.0 / self.ep
        return math.ceil(self.shape[0] / dp) * math.prod(self.shape[1:]) / self.ep


def _tp_splits(model: nn.Module) -> dict[int, int]:
    """id(parameter) -> the dimension its layer declares split over tensor-parallel ranks."""
    from torch.distributed.tensor import Shard

    from ..parallel.sbp import placements
    from ..parallel.tensor_parallel import declared_sbp

    out = {}
    for m in model.modules():
        decl = declared_sbp(m)
        if decl is None or decl.weight is None:
            continue
        for p_name, sbp in (("weight", decl.weight), ("bias", decl.bias)):
            param = m._parameters.get(p_name)
            if param is not None and sbp is not None and isinstance(tp := placements(sbp, ("tp",))[0], Shard):
                out[id(param)] = tp.dim % param.ndim
    return out


def _zero1_fullest(groups: Sequence[Sequence[float]], dp: int) -> float:
    """Elements on the fullest rank under ``ZeroRedundancyOptimizer``: per param group, largest parameter first,
    each to the rank with the fewest elements so far (its ``_partition_parameters``)."""
    sizes = [0.0] * dp
    for group in groups:
        for n in sorted(group, reverse=True):
            r = min(range(dp), key=sizes.__getitem__)
            sizes[r] += n
    return max(sizes)


def optimizer_state_ratio(optimizer_factory: Callable[[list], torch.optim.Optimizer] | None = None) -> float:
    """Optimizer state bytes per parameter byte, measured by one step on a small tensor (AdamW: 2.0).
    ``optimizer_factory(params)`` builds the optimizer; None means AdamW."""
    p = nn.Parameter(torch.zeros(256))
    opt = optimizer_factory([p]) if optimizer_factory is not None else torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    opt.step()
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.numel() == p.numel()) / (p.numel() * p.element_size())


def optimizer_step_temporaries(optimizer_factory: Callable | None, groups: Sequence[Sequence[tuple[int, ...]]],
                                dtype: torch.dtype = torch.float32) -> int:
    """Peak bytes an optimizer step allocates beyond its state (a for-loop AdamW: about one parameter's size;
    foreach: a group's; fused: none), measured by stepping it on fake parameters of these shapes (one list
    of shapes per parameter group)."""
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
    """Trace on CPU fake tensors as the job's accelerator would run: attention through the fused (flash)
    kernel, which keeps no ``[seq, seq]`` scores whatever the dropout (the CPU picks the math path under
    attention dropout), and the fused loss's softmax scratch at its accelerator size. Both are swapped in
    for the trace only, as module attributes, so activation checkpointing's recomputation in backward
    takes the same path as the forward."""

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

        scratch_rows = loss._scratch_rows
        device = torch.device(self.device)
        self.patches = [(torch.nn.functional, "scaled_dot_product_attention", sdpa),
                        (loss, "_scratch_rows", scratch_rows)]
        torch.nn.functional.scaled_dot_product_attention = fused_attention
        loss._scratch_rows = lambda probs: scratch_rows(SimpleNamespace(device=device, shape=probs.shape))
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

    from ..parallel.sbp import placements
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

    from ..parallel.sbp import hidden, placements
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
    """Forward ``build()`` on ``batch`` (real tensors of one micro-batch) and back-propagate its loss under
    ``FakeTensorMode`` (the sum of its declared losses, as the trainer does), recording every storage allocated and freed (``ActivationTrace``). Parameters'
    gradients are dropped as soon as they are made: the caller counts them with the static bytes. ``device``:
    the job's device kind; for an accelerator the kernels it would pick stand in (``_AcceleratorKernels``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mod_tracker import ModTracker
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from ..model import output_metrics
    from ..parallel.activation_checkpoint import apply_activation_checkpointing, transformer_layers
    from ..parallel.pipeline_split import _layer_of, _pieces, pipeline_module

    with FakeTensorMode() as fake:
        model = build()
        if activation_checkpoint_every:
            apply_activation_checkpointing(model, activation_checkpoint_every, activation_checkpoint_mode)
        fake_batch = {k: fake.from_tensor(v) if torch.is_tensor(v) else v for k, v in batch.items()}
    root = type(model).__name__
    names = {id(m): f"{root}.{n}" if n else root for n, m in model.named_modules()}
    blocks, whole = _split_regions(model, root)
    heads = _head_split_sizes(model)
    piece_layer = {names[id(m)]: idx for _c, key, m in _pieces(pipeline_module(model))
                   if (idx := _layer_of(m, key)) is not None}
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
    with fake, _AcceleratorKernels(device), tracker, _Record():
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


# ------------------------------------------------------------------------------------------------ the planner


class MemoryPlanner:
    """Estimates for one model and training sample under any ``PlanSettings``; the meta model, the optimizer's
    state ratio and the activation traces are built once and reused (``suggest`` estimates many layouts).

    ``build()`` returns the model; it is called under ``torch.device("meta")`` and under ``FakeTensorMode``.
    ``sample``: one unbatched training sample ``{name: tensor}`` (a micro-batch stacks copies of it).
    ``optimizer_factory(params)``: the optimizer (None: AdamW). ``param_groups(model)``: its parameter groups,
    which ZeRO-1 partitions one after another (None: one group).
    """

    def __init__(self, build: Callable[[], nn.Module], sample: Mapping[str, torch.Tensor],
                 optimizer_factory: Callable | None = None, param_groups: Callable[[nn.Module], list] | None = None):
        from ..parallel.activation_checkpoint import transformer_layers
        from ..parallel.parallelize import model_moe_config

        self.build, self.sample = build, dict(sample)
        with torch.device("meta"):
            self.model = build()
        self.optimizer_factory = optimizer_factory
        self.state_ratio = optimizer_state_ratio(optimizer_factory)
        self._step_temps: dict = {}
        groups = param_groups(self.model) if param_groups is not None else [list(self.model.parameters())]
        self.groups = [list(g["params"]) if isinstance(g, Mapping) else list(g) for g in groups]
        self.tp_splits = _tp_splits(self.model)
        moe = model_moe_config(self.model)
        self.ep = moe.ep_size if moe is not None else 1
        from ..layers.moe import Experts

        self.experts = {id(p) for m in self.model.modules() if isinstance(m, Experts) for p in m.parameters()}
        self.unit_of = {id(p): i for i, layer in enumerate(transformer_layers(self.model)) for p in layer.parameters()}
        self._traces: dict = {}

    # ---------------------------------------------------------------- checks
    def check(self, s: PlanSettings) -> None:
        """Refuse, in one line, settings the world size or the model cannot take (as the trainer would)."""
        from ..model import pipeline_num_layers, supports_pipeline
        from ..parallel.context_parallel import check_context_parallel
        from ..parallel.data_parallel import validate_zero_config
        from ..parallel.expert_parallel import check_moe_layout
        from ..parallel.parallelize import model_moe_config
        from ..parallel.tensor_parallel import check_declared_splits
        from .distributed import layer_stages

        cp = s.context_parallel_size
        product = s.pipeline_parallel_size * s.data_parallel_size * cp * s.tensor_parallel_size
        if product != s.world_size:
            raise UsageError(f"data_parallel_size({s.data_parallel_size}) x tensor_parallel_size({s.tensor_parallel_size})"
                             f" x pipeline_parallel_size({s.pipeline_parallel_size})"
                             + (f" x context_parallel_size({cp})" if cp > 1 else "")
                             + f" = {product} does not match the world size {s.world_size}; change --nproc or train.dist")
        validate_zero_config(s.zero_stage, s.offload)
        check_declared_splits(self.model, s.tensor_parallel_size)
        check_context_parallel(self.model, cp, s.pipeline_parallel_size, model_moe_config(self.model) is not None)
        check_moe_layout(model_moe_config(self.model), s.data_parallel_size, s.tensor_parallel_size, s.zero_stage,
                         s.sequence_parallel)
        if s.pipeline_parallel_size > 1:
            if not supports_pipeline(self.model):
                raise UsageError(f"{type(self.model).__name__} does not support pipeline parallelism (no "
                                 f"pipeline_module()); set train.dist.pipeline_parallel_size=1")
            layer_stages(pipeline_num_layers(self.model), s.pipeline_parallel_size * s.virtual_pipeline_size,
                         s.custom_pipeline_stage_id)
        if s.micro_batch_size < 1:
            raise UsageError(f"train.train_micro_batch_size={s.micro_batch_size} must be at least 1")

    # ---------------------------------------------------------------- pieces
    def trace(self, micro_batch: int, amp: torch.dtype | None, ac_every: int, ac_mode: str,
              device: str) -> ActivationTrace:
        """The activation trace of one micro-batch of ``micro_batch`` samples (cached)."""
        key = (micro_batch, amp, ac_every, ac_mode if ac_every else None, device)
        if key not in self._traces:
            batch = {k: v.unsqueeze(0).expand(micro_batch, *v.shape).contiguous() if torch.is_tensor(v) else v
                     for k, v in self.sample.items()}
            self._traces[key] = trace_activations(self.build, batch, amp_dtype=amp, activation_checkpoint_every=ac_every,
                                                  activation_checkpoint_mode=ac_mode, device=device)
        return self._traces[key]

    def _stages(self, s: PlanSettings) -> list[tuple[list[nn.Module], set[int] | None]]:
        """(modules, pipeline layers) each pipeline rank keeps, cut as ``pipeline_split`` cuts them."""
        from ..model import pipeline_num_layers
        from ..parallel.pipeline_split import _layer_of, _pieces, local_stage_ids, pipeline_module
        from .distributed import layer_stages

        pp = s.pipeline_parallel_size
        if pp == 1:
            return [([self.model], None)]
        stage_of_layer = layer_stages(pipeline_num_layers(self.model), pp * s.virtual_pipeline_size,
                                      s.custom_pipeline_stage_id)
        out = []
        for rank in range(pp):
            owned = set(local_stage_ids(rank, pp, s.virtual_pipeline_size))
            layers = {i for i, stage in enumerate(stage_of_layer) if stage in owned}
            modules = [m for _c, key, m in _pieces(pipeline_module(self.model))
                       if (idx := _layer_of(m, key)) is None or idx in layers]
            out.append((modules, layers))
        return out

    def _params(self, modules: list[nn.Module], tp: int) -> list[tuple[int, _Param]]:
        seen, out = set(), []
        for module in modules:
            for p in module.parameters():
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                shape = list(p.shape)
                if tp > 1 and id(p) in self.tp_splits:
                    shape[self.tp_splits[id(p)]] //= tp
                ep = self.ep if id(p) in self.experts else 1
                out.append((id(p), _Param(tuple(shape), p.element_size(), ep, self.unit_of.get(id(p)))))
        return out

    def _step_temporaries(self, params: list[tuple[int, _Param]], s: PlanSettings) -> int:
        """What this rank's optimizer step allocates beyond its state, on the shapes the rank steps."""
        fsdp = s.zero_stage >= 2
        by_id = {i: ((math.ceil(p.shard_numel(s.data_parallel_size)),) if fsdp else p.shape) for i, p in params}
        shapes = tuple(tuple(by_id[id(q)] for q in g if id(q) in by_id) for g in self.groups)
        if shapes not in self._step_temps:
            self._step_temps[shapes] = optimizer_step_temporaries(self.optimizer_factory, shapes)
        return self._step_temps[shapes]

    # ---------------------------------------------------------------- the estimate
    def estimate(self, settings: PlanSettings) -> MemoryEstimate:
        """Bytes per rank under ``settings`` (checked first): the pipeline rank with the largest peak."""
        self.check(settings)
        trace = self.trace(settings.micro_batch_size, settings.amp_dtype, settings.activation_checkpoint_every,
                           settings.activation_checkpoint_mode, settings.device)
        stages = self._stages(settings)
        best = None
        for rank, (modules, layers) in enumerate(stages):
            est = self._estimate_stage(settings, trace, rank, self._params(modules, settings.tensor_parallel_size),
                                       layers)
            if best is None or est.peak > best.peak:
                best = est
        if self.experts:
            best.notes += ("MoE routing is taken as balanced and without drops: each expert gets an even share of "
                           "the tokens (the shape-only trace has no values to route by)",)
        return best

    def _estimate_stage(self, s: PlanSettings, trace: ActivationTrace, rank: int, params: list[tuple[int, _Param]],
                        layers: set[int] | None) -> MemoryEstimate:
        # Gradients are reduced, and ZeRO shards, over dp x cp: every cp rank holds the whole parameters.
        dp, stage, tp = s.data_parallel_size * s.context_parallel_size, s.zero_stage, s.tensor_parallel_size
        # The trace is of whole sequences; a cp rank keeps about 1/cp of it: its [local, whole] attention
        # scores are 1/cp of the [whole, whole] ones. Not counted: the keys and values each attention
        # gathers whole and keeps for backward (2 x seq x kv width per layer) and the one [local, whole]
        # score mask the layers share (libai_lite/parallel/context_parallel.py).
        act_share = 1.0 / s.context_parallel_size
        fsdp = stage >= 2
        offloaded = s.offload and s.device != "cpu"
        local = sum((p.shard_numel(dp) if fsdp else p.numel) * p.element_size for _i, p in params)
        param_b = grad_b = local
        if stage == 1 and dp > 1:
            by_id = {i: p.numel * p.element_size for i, p in params}
            opt_b = _zero1_fullest([[by_id[id(q)] for q in g if id(q) in by_id] for g in self.groups], dp) * self.state_ratio
        else:
            opt_b = local * self.state_ratio
        # DDP keeps its gradient buckets between steps; otherwise gradients appear as backward makes them.
        ddp_buckets = stage < 2 and dp > 1 and tp == 1 and s.pipeline_parallel_size == 1 and self.ep == 1
        units: dict[int | None, list[_Param]] = {}
        for _i, p in params:
            units.setdefault(p.unit, []).append(p)
        # FSDP gathers parameters in the amp dtype (its MixedPrecisionPolicy), else in their own.
        gather_size = torch.empty(0, dtype=s.amp_dtype).element_size() if s.amp_dtype is not None else None
        gathered = {u: sum(p.numel * (gather_size or p.element_size) for p in ps) for u, ps in units.items()}
        grads_of = {u: sum((p.shard_numel(dp) if fsdp else p.numel) * p.element_size for p in ps)
                    for u, ps in units.items()}
        g_root = gathered.get(None, 0)
        layer_units = sorted(u for u in units if u is not None)
        last_unit = layer_units[-1] if layer_units else None
        all_layers = sum(gathered[u] for u in layer_units)
        last_layer = max((e[1] for e in trace.events if e[1] is not None), default=0)

        live = grads_live = gathered_so_far = 0.0  # this stage's activations and temporaries; gradients; ZeRO-2
        seen_fwd: set = set()
        lowest_bw = trace.num_units  # the earliest layer backward has reached
        current_layer = 0  # work outside every piece goes with the piece that ran last (the loss with the head)
        retained = high = 0.0
        for i, (nbytes, layer, unit, split, backward, allocation) in enumerate(trace.events):
            if i == trace.forward_end:
                retained, current_layer = live, last_layer
            current_layer = layer if layer is not None else current_layer
            if layers is None or current_layer in layers:
                # Sequence parallelism splits the residual stream too, but the blocks gather their input whole.
                sp_split = s.sequence_parallel and allocation not in trace.block_inputs
                live += nbytes * (1.0 / tp if tp > 1 and (split or sp_split) else 1.0) * act_share
            if backward:
                # Backward runs the layers last to first (hooks interleave the tags of neighbours): every layer
                # after the earliest one seen in backward is done, its gradients made.
                while unit is not None and unit < lowest_bw:
                    lowest_bw -= 1
                    if lowest_bw + 1 in grads_of and not ddp_buckets and not offloaded:
                        grads_live += grads_of[lowest_bw + 1]
            elif unit is not None and unit not in seen_fwd:
                seen_fwd.add(unit)
                gathered_so_far += gathered.get(unit, 0)
            extra = 0.0
            if stage == 2:
                # reshard_after_forward=False: a layer stays gathered from its forward to the end of backward.
                extra = g_root + (all_layers if backward else gathered_so_far)
            elif stage == 3:
                # The root (embeddings, head) while the forward runs and again in backward; the running layer, and
                # in backward the one before it, whose all-gather FSDP2 prefetches; the last layer, never
                # resharded after forward, until its backward is done.
                extra = g_root if i < trace.forward_end or backward else 0.0
                if unit is not None:
                    extra += gathered.get(unit, 0.0) + (gathered.get(unit - 1, 0.0) if backward else 0.0)
                if last_unit in seen_fwd and last_unit <= lowest_bw and unit != last_unit:
                    extra += gathered[last_unit]
            high = max(high, live + grads_live + extra)
        if trace.forward_end >= len(trace.events):
            retained = live
        in_flight = 1
        if layers is not None:
            # Micro-batches whose forward ran and whose backward has not: 1F1B keeps (pp - rank) on pipeline
            # rank `rank` (per virtual stage when interleaved), GPipe all of them.
            if s.pipeline_schedule == "gpipe":
                in_flight = s.num_microbatches
            else:
                virtual = s.virtual_pipeline_size if s.pipeline_schedule == "interleaved_1f1b" else 1
                in_flight = min(s.pipeline_parallel_size - rank, s.num_microbatches) * virtual
            in_flight = max(1, in_flight)
        activations = retained * in_flight
        dynamic = high + retained * (in_flight - 1)
        constant = param_b + opt_b + (grad_b if ddp_buckets else 0)
        # The optimizer step: every gradient present, plus what the step allocates for itself.
        step = param_b + grad_b + opt_b + self._step_temporaries(params, s)
        host = 0
        if offloaded:
            # FSDP's CPUOffloadPolicy: shards, gradients and the optimizer step live in host memory.
            host, constant, step = step, 0, 0
        num = sum(p.numel for _i, p in params)
        return MemoryEstimate(int(param_b), int(grad_b), int(opt_b), int(activations), int(max(constant + dynamic, step)),
                              int(host), rank, int(num), s)


# ------------------------------------------------------------------------------------------------ suggestions


def _changes(base: PlanSettings, world_size: int, num_microbatches: int, micro_batch: int) -> list[list[PlanSettings]]:
    """Per kind of change, cheapest kind first, its settings from ``base`` in increasing strength."""
    zero = [dataclasses.replace(base, zero_stage=stage) for stage in range(base.zero_stage + 1, 4)]
    ac = ([dataclasses.replace(base, activation_checkpoint_every=1, activation_checkpoint_mode="full")]
          if (base.activation_checkpoint_every, base.activation_checkpoint_mode) != (1, "full") else [])
    micro, smaller = base.micro_batch_size, []
    while micro > 1:
        micro //= 2
        # More accumulation steps keep the global batch.
        smaller.append(dataclasses.replace(base, micro_batch_size=micro,
                                           num_microbatches=num_microbatches * micro_batch // micro))
    parallel = []
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        more, size = [], getattr(base, key) * 2
        while size <= world_size:
            tp = size if key == "tensor_parallel_size" else base.tensor_parallel_size
            pp = size if key == "pipeline_parallel_size" else base.pipeline_parallel_size
            cp = base.context_parallel_size
            if world_size % (tp * pp * cp) == 0:
                more.append(dataclasses.replace(base, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                data_parallel_size=world_size // (tp * pp * cp),
                                                custom_pipeline_stage_id=None))
            size *= 2
        parallel.append(more)
    return [zero, ac, smaller, *parallel]


def candidate_changes(s: PlanSettings) -> list[PlanSettings]:
    """The settings ``suggest`` tries, in order: each single change alone, cheapest kind first (ZeRO stage up,
    activation checkpointing on, the micro-batch halved down to 1 with more accumulation steps for the same
    global batch, tensor then pipeline parallelism doubled with the data-parallel size shrinking to keep the
    world size), then the kinds stacked, each on the previous kinds' strongest setting, for a model that
    needs several."""
    out = [c for kind in _changes(s, s.world_size, s.num_microbatches, s.micro_batch_size) for c in kind]
    current = s
    for i in range(3):  # ZeRO, activation checkpointing, micro-batch: each on the previous ones' strongest
        kind = _changes(current, s.world_size, s.num_microbatches, s.micro_batch_size)[i]
        out += kind
        current = kind[-1] if kind else current
    for kind in _changes(current, s.world_size, s.num_microbatches, s.micro_batch_size)[3:]:
        out += kind  # more tensor or more pipeline parallelism on top of all three
    seen, unique = set(), []
    for c in out:
        if c not in seen and c != s:
            seen.add(c)
            unique.append(c)
    return unique


def suggest(planner: MemoryPlanner, settings: PlanSettings, device_memory: int) -> tuple[str, MemoryEstimate] | None:
    """The first change of ``candidate_changes`` (cheapest first) that is valid for the world size and the model
    and whose re-estimated peak fits in ``device_memory``: ``(overrides, estimate)``, or None."""
    for candidate in candidate_changes(settings):
        try:
            est = planner.estimate(candidate)
        except UsageError:
            continue  # not a layout this model or world takes (a split that does not divide, ...)
        if est.peak <= device_memory:
            return _overrides_from(settings, candidate), est
    return None


def _overrides_from(old: PlanSettings, new: PlanSettings) -> str:
    """Config overrides turning ``old`` into ``new``."""
    out = []
    if new.zero_stage != old.zero_stage:
        out += ["train.zero_optimization.enabled=True", f"train.zero_optimization.stage={new.zero_stage}"]
    if (new.activation_checkpoint_every, new.activation_checkpoint_mode) != (
            old.activation_checkpoint_every, old.activation_checkpoint_mode):
        out += ["train.activation_checkpoint.enabled=True",
                f"train.activation_checkpoint.every_n_layers={new.activation_checkpoint_every}"]
        if new.activation_checkpoint_mode != old.activation_checkpoint_mode:
            out.append(f"train.activation_checkpoint.mode={new.activation_checkpoint_mode}")
    if new.micro_batch_size != old.micro_batch_size:
        out += [f"train.train_micro_batch_size={new.micro_batch_size}",
                f"train.num_accumulation_steps={new.num_microbatches}"]
    if new.tensor_parallel_size != old.tensor_parallel_size:
        out.append(f"train.dist.tensor_parallel_size={new.tensor_parallel_size}")
    if new.pipeline_parallel_size != old.pipeline_parallel_size:
        out.append(f"train.dist.pipeline_parallel_size={new.pipeline_parallel_size}")
    if (new.data_parallel_size != old.data_parallel_size
            and (new.tensor_parallel_size, new.pipeline_parallel_size) != (old.tensor_parallel_size, old.pipeline_parallel_size)):
        out.append("train.dist.data_parallel_size=null")
    return " ".join(out)


# ------------------------------------------------------------------------------------------------ from a config


def _sample_from_config(cfg, tokenizer, micro: int, dp: int) -> dict:
    """One training sample, as the trainer reads one (``dataset[0]`` of the train loader's dataset)."""
    import tempfile

    from ..config.instantiate import instantiate_with

    loader_cfg = cfg.dataloader.train
    with tempfile.TemporaryDirectory() as tmp:
        # Index caches go to a scratch directory: planning writes nothing beside the data.
        extra = {"cache_dir": tmp} if "cache_dir" in loader_cfg else {}
        loaders = instantiate_with(
            loader_cfg, train_valid_test_num_samples=[micro * dp, 0, 0], micro_batch_size=micro,
            eval_micro_batch_size=micro, consumed_samples=0, data_parallel_rank=0, data_parallel_size=dp,
            vocab_size=tokenizer.vocab_size if tokenizer is not None else None, **extra)
        dataset = getattr(loaders[0] if isinstance(loaders, (tuple, list)) else loaders, "dataset", None)
        if dataset is None or len(dataset) == 0:
            raise UsageError("the train loader has no dataset to read a sample from; the memory planner needs one "
                             "training sample to measure activations (check dataloader.train)")
        sample = dataset[0]
    return {k: torch.as_tensor(v) for k, v in sample.items() if v is not None}


def settings_from_config(cfg, world_size: int, device: str = "cuda") -> PlanSettings:
    """``PlanSettings`` from a loaded config (``train.dist``, ``train.zero_optimization``, batch sizes, ``train.amp``,
    ``train.activation_checkpoint``) for ``world_size`` processes; ``cfg.train`` gets its batch sizes resolved."""
    from ..engine.amp import amp_dtype
    from ..engine.launch import resolve_batch_sizes
    from ..parallel.activation_checkpoint import check_ac_mode
    from .distributed import _zero_settings, resolve_layout

    if world_size < 1:
        raise UsageError(f"--nproc {world_size} must be at least 1")
    pp, dp, cp, tp = resolve_layout(world_size, cfg.train.dist)
    stage, offload = _zero_settings(cfg.train.get("zero_optimization"))
    resolve_batch_sizes(cfg.train, dp)
    ac = cfg.train.get("activation_checkpoint") or {}
    dist_cfg = cfg.train.dist
    custom = dist_cfg.get("custom_pipeline_stage_id", None)
    return PlanSettings(
        world_size=world_size, pipeline_parallel_size=pp, data_parallel_size=dp, tensor_parallel_size=tp,
        sequence_parallel=bool(dist_cfg.get("sequence_parallel", False)), zero_stage=int(stage or 0),
        offload=bool(offload), activation_checkpoint_every=int(ac.get("every_n_layers", 1) or 1) if ac.get("enabled") else 0,
        activation_checkpoint_mode=check_ac_mode(ac.get("mode", "full")),
        micro_batch_size=int(cfg.train.train_micro_batch_size), num_microbatches=int(cfg.train.num_accumulation_steps),
        amp_dtype=amp_dtype(cfg.train.amp), pipeline_schedule=str(dist_cfg.get("pipeline_schedule", "1f1b") or "1f1b"),
        virtual_pipeline_size=int(dist_cfg.get("virtual_pipeline_size", 1) or 1),
        custom_pipeline_stage_id=tuple(custom) if custom is not None else None, context_parallel_size=cp,
        device=device)


def planner_from_config(cfg, world_size: int, device: str = "cuda") -> tuple[MemoryPlanner, PlanSettings]:
    """The planner and settings of a loaded, overridden config, as ``tools/train_net.py`` would run it on
    ``world_size`` processes: the tokenizer's padded vocabulary, one sample of the train data, ``cfg.optim``."""
    from omegaconf import open_dict

    from ..config import instantiate
    from ..tokenizer import pad_vocab_size

    settings = settings_from_config(cfg, world_size, device)
    tokenizer = None
    tok_cfg = cfg.get("tokenization")
    if tok_cfg is not None and tok_cfg.get("tokenizer") is not None:
        tokenizer = instantiate(tok_cfg.tokenizer)
        with open_dict(cfg):
            cfg.model.cfg.vocab_size = pad_vocab_size(tokenizer.vocab_size, tok_cfg.get("make_vocab_size_divisible_by", 128))
    sample = _sample_from_config(cfg, tokenizer, settings.micro_batch_size, settings.data_parallel_size)
    return _planner_for(cfg, sample), settings


def _planner_for(cfg, sample: Mapping[str, torch.Tensor]) -> MemoryPlanner:
    """A planner for ``cfg.model`` (its vocabulary already padded) trained by ``cfg.optim``."""
    from ..config import instantiate
    from ..config.instantiate import instantiate_with

    optim = cfg.get("optim")
    factory = (lambda params: instantiate_with(optim, params=params)) if optim is not None else None
    params_node = optim.get("params") if optim is not None else None
    groups = ((lambda model: instantiate_with(params_node, model=model))
              if params_node is not None and hasattr(params_node, "get") and params_node.get("_target_") else None)
    return MemoryPlanner(lambda: instantiate(cfg.model), sample, optimizer_factory=factory, param_groups=groups)


def startup_estimate(cfg, layout, sample: Mapping[str, torch.Tensor]) -> str:
    """The line the trainer logs at start-up: this run's estimate per rank (``cfg`` resolved as the trainer
    resolved it, ``layout`` its ``Layout``, ``sample`` one training sample). Never raises: a run is not
    stopped by its estimate, the line then says why there is none."""
    try:
        from ..engine.amp import amp_dtype

        ac = cfg.train.get("activation_checkpoint") or {}

        settings = PlanSettings(
            world_size=layout.world_size, pipeline_parallel_size=layout.pipeline_parallel_size,
            data_parallel_size=layout.data_parallel_size, tensor_parallel_size=layout.tensor_parallel_size,
            sequence_parallel=layout.sequence_parallel, zero_stage=int(layout.zero_stage or 0), offload=layout.offload,
            activation_checkpoint_every=int(ac.get("every_n_layers", 1) or 1) if ac.get("enabled") else 0,
            activation_checkpoint_mode=str(ac.get("mode", "full")),
            micro_batch_size=int(cfg.train.train_micro_batch_size),
            num_microbatches=int(cfg.train.num_accumulation_steps), amp_dtype=amp_dtype(cfg.train.amp),
            pipeline_schedule=layout.pipeline_schedule, virtual_pipeline_size=layout.virtual_pipeline_size,
            custom_pipeline_stage_id=(tuple(layout.custom_pipeline_stage_id)
                                      if layout.custom_pipeline_stage_id is not None else None),
            context_parallel_size=layout.context_parallel_size, device=layout.device.type)
        return startup_line(_planner_for(cfg, sample).estimate(settings))
    except Exception as e:  # noqa: BLE001 - an estimate that fails must not stop training
        return f"Memory estimate not available ({type(e).__name__}: {e})"


def format_estimate(est: MemoryEstimate) -> str:
    """The table ``tools/estimate_memory.py`` prints: GiB per rank, one row per kind of memory."""
    rows = [("parameters", est.params), ("gradients", est.grads), ("optimizer state", est.optimizer),
            ("activations", est.activations), ("peak (device)", est.peak)]
    if est.host:
        rows.append(("host (offloaded)", est.host))
    where = f" (pipeline rank {est.stage}, the fullest)" if est.settings.pipeline_parallel_size > 1 else ""
    lines = [f"{est.num_parameters / 1e6:.1f}M parameters per rank before ZeRO sharding{where}; {est.settings.describe()}",
             f"{'per rank':18s}{'GiB':>10s}"]
    lines += [f"{name:18s}{value / GiB:10.3f}" for name, value in rows]
    lines += [f"note: {n}" for n in est.notes]
    if est.settings.device != "cpu":
        lines.append("note: the peak counts tensors (torch.cuda.max_memory_allocated); the CUDA context and the "
                     "allocator's cache take some of the device besides")
    return "\n".join(lines)


def startup_line(est: MemoryEstimate) -> str:
    """The one line the trainer logs at start-up."""
    s = est.settings
    return (f"Memory estimate per rank ({s.describe()}): params {gib(est.params)}, grads {gib(est.grads)}, "
            f"optimizer {gib(est.optimizer)}, activations {gib(est.activations)}, peak {gib(est.peak)}"
            + (f", offloaded to host {gib(est.host)}" if est.host else "") + " (tools/estimate_memory.py)")
