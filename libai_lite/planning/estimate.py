"""The planner: static bytes counted on the meta model, activations replayed from a trace, per pipeline rank."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from ..utils.errors import UsageError
from .settings import MemoryEstimate, PlanSettings
from .trace import ActivationTrace, optimizer_step_temporaries, trace_activations



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

    from ..sbp import placements
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



# ------------------------------------------------------------------------------------------------ the planner


class MemoryPlanner:
    """Estimates for one model and training sample under any ``PlanSettings``, reusing the meta model,
    optimizer state ratio and activation traces across layouts.

    ``build()`` returns the model and must work under ``torch.device("meta")`` and ``FakeTensorMode``.
    ``sample`` is one unbatched training sample ``{name: tensor}``. ``optimizer_factory(params)`` defaults
    to AdamW, and ``param_groups(model)`` to one group; ZeRO-1 partitions the groups one after another.
    """

    def __init__(self, build: Callable[[], nn.Module], sample: Mapping[str, torch.Tensor],
                 optimizer_factory: Callable | None = None, param_groups: Callable[[nn.Module], list] | None = None):
        from ..converters.activation_checkpoint import transformer_layers
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
        """Refuse settings the world size or the model cannot take, with the trainer's own checks."""
        from ..parallel.data_parallel import validate_zero_config
        from ..parallel.parallelize import check_model_layout
        from ..parallel.tensor_parallel import check_declared_splits
        from ..utils.parallel_dims import hsdp_sizes, layout_sizes

        # Strict: the planner estimates the sizes it is given, never ones capped to fit the world.
        layout_sizes(s.world_size, {**s.sizes(), "strict_layout": True})
        hsdp_sizes(s.data_parallel_size, {"data_parallel_replicate_size": s.data_parallel_replicate_size},
                   s.zero_stage)
        validate_zero_config(s.zero_stage, s.offload)
        check_declared_splits(self.model, s.tensor_parallel_size)
        check_model_layout(self.model, s.layout(), s.num_microbatches)
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
        from ..model import stage_of_layer
        from ..parallel.pipeline_split import layer_index_of, local_stage_ids, pipeline_module, pipeline_pieces

        pp = s.pipeline_parallel_size
        if pp == 1:
            return [([self.model], None)]
        stages = stage_of_layer(self.model, s)
        out = []
        for rank in range(pp):
            owned = set(local_stage_ids(rank, pp, s.virtual_pipeline_size))
            layers = {i for i, stage in enumerate(stages) if stage in owned}
            modules = [m for _c, key, m in pipeline_pieces(pipeline_module(self.model))
                       if (idx := layer_index_of(m, key)) is None or idx in layers]
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
        fsdp = _zero_stage(s) >= 2
        by_id = {i: ((math.ceil(p.shard_numel(s.data_parallel_shard_size)),) if fsdp else p.shape) for i, p in params}
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
        dp, stage, tp = s.data_parallel_size * s.context_parallel_size, _zero_stage(s), s.tensor_parallel_size
        # FSDP shards over dp_shard x cp: under HSDP each replicate group holds a whole sharded copy.
        shards = s.data_parallel_shard_size * s.context_parallel_size
        # A cp rank keeps about 1/cp of the whole-sequence trace. The gathered keys and values kept for
        # backward and the shared score mask are not counted.
        act_share = 1.0 / s.context_parallel_size
        fsdp = stage >= 2
        # FSDP's CPUOffloadPolicy moves parameters, gradients and the step; ZeRO-1's offload the optimizer only.
        offloaded = s.offload and s.device != "cpu" and fsdp
        optim_offloaded = s.offload and s.device != "cpu" and stage == 1
        local = sum((p.shard_numel(shards) if fsdp else p.numel) * p.element_size for _i, p in params)
        param_b = grad_b = local
        shard_b = local  # the parameter bytes this rank's optimizer steps
        if stage == 1 and dp > 1:
            by_id = {i: p.numel * p.element_size for i, p in params}
            shard_b = _zero1_fullest([[by_id[id(q)] for q in g if id(q) in by_id] for g in self.groups], dp)
        opt_b = shard_b * self.state_ratio
        # DDP keeps its gradient buckets between steps; otherwise gradients appear as backward makes them.
        ddp_buckets = stage < 2 and dp > 1 and tp == 1 and s.pipeline_parallel_size == 1 and self.ep == 1
        units: dict[int | None, list[_Param]] = {}
        for _i, p in params:
            units.setdefault(p.unit, []).append(p)
        # FSDP gathers parameters in the amp dtype (its MixedPrecisionPolicy), else in their own.
        gather_size = torch.empty(0, dtype=s.amp_dtype).element_size() if s.amp_dtype is not None else None
        gathered = {u: sum(p.numel * (gather_size or p.element_size) for p in ps) for u, ps in units.items()}
        grads_of = {u: sum((p.shard_numel(shards) if fsdp else p.numel) * p.element_size for p in ps)
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
        elif optim_offloaded:
            # The shard's host copies of its parameters and gradients, its state and the step's temporaries.
            host = 2 * shard_b + opt_b + self._step_temporaries(params, s)
            constant -= opt_b
            step = param_b + grad_b
        elif s.offload and stage == 1:
            # On a CPU the shard's "host" copies are more of the same memory.
            constant += 2 * shard_b
            step += 2 * shard_b
        num = sum(p.numel for _i, p in params)
        return MemoryEstimate(int(param_b), int(grad_b), int(opt_b), int(activations), int(max(constant + dynamic, step)),
                              int(host), rank, int(num), s)


def _zero_stage(s: PlanSettings) -> int:
    """The ZeRO stage the trainer runs; ZeRO-2/3 over one dp x cp rank without offload trains the plain model."""
    if s.zero_stage >= 2 and s.data_parallel_size * s.context_parallel_size == 1 and not s.offload:
        return 0
    return s.zero_stage
