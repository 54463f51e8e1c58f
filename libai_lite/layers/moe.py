"""Mixture-of-experts feed-forward layer: a learned router sends each token to its top-k experts.

Switch (top-1) and GShard (top-2) routing with an fp32 router. Top-1 weights the chosen expert by its
probability; top-k > 1 renormalises the k chosen ones. Every expert is an ordinary ``MLP`` and takes at
most ``ceil(capacity_factor * tokens * k / num_experts)`` assignments; dropped ones contribute nothing.
The load-balancing loss ``num_experts * sum_e f_e * P_e`` is 1 at perfect balance.

A drop-in for ``MLP``; ``collect_moe_outputs(model)`` adds its loss and statistics to the output dict.
In a pipeline stage the layer back-propagates its own auxiliary loss (``backprop_aux_loss``). Expert
parallelism keeps only this rank's experts, keyed by global index, and sets ``dispatch``.

DeepSeek-style options: sigmoid routing balanced by a per-expert bias instead of (or beside) the loss,
moved after each optimizer step (``update_router_biases``), and shared experts; on CUDA in bf16 the
experts run as grouped GEMMs behind a ``FastPath`` whose plain path is the per-expert loop.
"""
from __future__ import annotations

import contextlib
import difflib
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..model import LOSS, MEAN
from ..utils.errors import UsageError
from .experts import Experts
from .init_methods import InitMethod
from .mlp import MLP
from .router import Router, Routing, load_balancing_loss, route


# Router choices: Switch/GShard's softmax, DeepSeek-V3's sigmoid scores with a balancing bias.
ROUTERS = ("softmax", "sigmoid_bias")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class MoEConfig:
    """``model.cfg.moe``: which feed-forward layers become mixtures of experts, and how they route.

    Each token goes to ``top_k`` of ``num_experts``, spread over ``ep_size`` data-parallel ranks.
    ``capacity_factor`` is a multiple of the balanced load, None for no limit. Every ``every_n_layers``-th
    feed-forward layer of a stack is an MoE layer. ``jitter_noise`` multiplies the router input by
    ``U(1 - eps, 1 + eps)`` while training. ``ffn_hidden_size`` is each expert's width, None for the model's
    (fine-grained recipes such as Qwen3-MoE run many narrow experts).

    ``router="sigmoid_bias"`` is DeepSeek-V3's routing: sigmoid scores, top-k chosen on scores plus a
    per-expert bias that ``update_router_biases`` moves by ``bias_update_rate`` after each optimizer step
    towards balanced loads (auxiliary-loss-free balancing; set ``aux_loss_weight=0`` for none at all).
    ``num_shared_experts`` adds a dense MLP of ``shared_expert_intermediate_size`` features (default
    that many times the experts') that every token passes through. ``grouped_gemm`` runs the experts (exact
    sizes or fixed slots) as grouped GEMMs on CUDA in bf16 (``torch._grouped_mm``, guarded; the loop elsewhere).
    """

    enabled: bool = False
    num_experts: int = 8
    top_k: int = 1
    ep_size: int = 1
    capacity_factor: Optional[float] = 1.25
    aux_loss_weight: float = 0.01
    every_n_layers: int = 2
    jitter_noise: float = 0.0
    ffn_hidden_size: Optional[int] = None
    router: str = "softmax"
    bias_update_rate: float = 1e-3
    num_shared_experts: int = 0
    shared_expert_intermediate_size: Optional[int] = None
    grouped_gemm: bool = True

    def __post_init__(self):
        for name in ("num_experts", "top_k", "ep_size", "every_n_layers"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or int(value) != value or int(value) < 1:
                shown = "null" if value is None else repr(value)
                raise UsageError(f"model.cfg.moe.{name}={shown} must be a positive integer")
            setattr(self, name, int(value))
        if self.ffn_hidden_size is not None:
            value = self.ffn_hidden_size
            if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 1:
                raise UsageError(f"model.cfg.moe.ffn_hidden_size={value!r} must be a positive integer (or null for "
                                 f"the model's ffn_hidden_size)")
            self.ffn_hidden_size = int(value)
        if self.top_k > self.num_experts:
            raise UsageError(f"model.cfg.moe.top_k={self.top_k} is more than num_experts={self.num_experts}; "
                             f"use top_k <= num_experts (1 or 2 are the usual choices)")
        if self.num_experts % self.ep_size:
            raise UsageError(f"model.cfg.moe.ep_size={self.ep_size} does not divide num_experts={self.num_experts}; "
                             f"use an ep_size that divides the number of experts")
        if self.capacity_factor is not None and not float(self.capacity_factor) > 0:
            raise UsageError(f"model.cfg.moe.capacity_factor={self.capacity_factor} must be positive (or null for "
                             f"no capacity limit)")
        if float(self.aux_loss_weight) < 0:
            raise UsageError(f"model.cfg.moe.aux_loss_weight={self.aux_loss_weight} must be >= 0")
        if not 0.0 <= float(self.jitter_noise) < 1.0:
            raise UsageError(f"model.cfg.moe.jitter_noise={self.jitter_noise} must be in [0, 1)")
        if self.router not in ROUTERS:
            close = difflib.get_close_matches(str(self.router), ROUTERS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(map(repr, ROUTERS))}"
            raise UsageError(f"model.cfg.moe.router={self.router!r} is not a router; {hint}")
        if not _number(self.bias_update_rate) or float(self.bias_update_rate) < 0:
            raise UsageError(f"model.cfg.moe.bias_update_rate={self.bias_update_rate!r} must be a number >= 0 "
                             f"(DeepSeek-V3 uses 1e-3; 0 keeps the routing bias fixed)")
        self.bias_update_rate = float(self.bias_update_rate)
        value = self.num_shared_experts
        if not _number(value) or int(value) != value or int(value) < 0:
            raise UsageError(f"model.cfg.moe.num_shared_experts={value!r} must be an integer >= 0 (0: none)")
        self.num_shared_experts = int(value)
        size = self.shared_expert_intermediate_size
        if size is not None and (not _number(size) or int(size) != size or int(size) < 1):
            raise UsageError(f"model.cfg.moe.shared_expert_intermediate_size={size!r} must be a positive integer "
                             f"(or null: num_shared_experts times the experts' ffn size)")
        if size is not None and self.num_shared_experts == 0:
            raise UsageError(f"model.cfg.moe.shared_expert_intermediate_size={size} is set without shared experts; "
                             f"set model.cfg.moe.num_shared_experts >= 1 or leave the size null")
        if not isinstance(self.grouped_gemm, bool):
            raise UsageError(f"model.cfg.moe.grouped_gemm={self.grouped_gemm!r} must be True or False")

    @classmethod
    def from_mapping(cls, cfg: Optional[Mapping[str, Any]]) -> "MoEConfig":
        """Build from ``model.cfg.moe`` (a dict, DictConfig, MoEConfig or None); unknown keys are refused."""
        if cfg is None:
            return cls()
        if isinstance(cfg, MoEConfig):
            return cfg
        given = dict(cfg)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(sorted(known))}"
            raise UsageError(f"unknown key model.cfg.moe.{key}; {hint}")
        return cls(**given)

    def is_moe_layer(self, index_in_stack: int) -> bool:
        """Whether the feed-forward of the ``index_in_stack``-th layer (0-based) of a stack is an MoE layer."""
        return self.enabled and (index_in_stack + 1) % self.every_n_layers == 0


class _AuxLossInBackward(torch.autograd.Function):
    """Identity on the layer output whose backward adds the weighted auxiliary loss's gradient and records
    the micro-batch's statistics. Recording in backward counts each micro-batch once under checkpointing."""

    @staticmethod
    def forward(ctx, output, aux_loss, layer, stats):
        ctx.layer, ctx.stats = layer, stats
        ctx.aux_value = aux_loss.detach()
        return output

    @staticmethod
    def backward(ctx, grad_output):
        layer = ctx.layer
        layer.step_records.append(dict(ctx.stats, aux=layer.aux_loss_weight * ctx.aux_value))
        grad_aux = torch.full_like(ctx.aux_value, layer.aux_loss_weight * layer.aux_grad_scale)
        return grad_output, grad_aux, None, None


class MoELayer(nn.Module):
    """Routed mixture of ``MLP`` experts with the ``MLP`` interface: ``forward(hidden_states) -> hidden_states``.

    Arguments after ``moe`` are the ``MLP``'s, used for every expert. After each forward,
    ``aux_loss`` (unweighted), ``aux_loss_weight`` and ``stats`` (assignments, dropped assignments,
    max/mean expert load; detached) describe it; see ``collect_moe_outputs``.
    """

    def __init__(self, moe: MoEConfig, hidden_size: int, ffn_hidden_size: int,
                 init_method: Optional[InitMethod] = None, layer_idx: int = 0, **mlp_options):
        super().__init__()
        moe = MoEConfig.from_mapping(moe)
        self.moe_config = moe
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.capacity_factor = None if moe.capacity_factor is None else float(moe.capacity_factor)
        self.aux_loss_weight = float(moe.aux_loss_weight)
        self.layer_idx = layer_idx
        expert_size = moe.ffn_hidden_size or ffn_hidden_size
        self.router = Router(hidden_size, moe.num_experts, init_method=init_method,
                             jitter_noise=moe.jitter_noise, layer_idx=layer_idx)
        self.experts = Experts({
            str(e): MLP(hidden_size, expert_size, init_method=init_method, layer_idx=layer_idx, **mlp_options)
            for e in range(moe.num_experts)
        })
        self.experts.grouped_gemm = moe.grouped_gemm
        self.router_kind = moe.router
        self.bias_update_rate = moe.bias_update_rate
        if moe.router == "sigmoid_bias":
            # A buffer: saved in checkpoints, moved by update_router_biases, never by the optimizer.
            self.register_buffer("expert_bias", torch.zeros(moe.num_experts, dtype=torch.float32))
            # Assignments per expert in this rank's training forwards since the last bias update.
            self.register_buffer("expert_load", torch.zeros(moe.num_experts, dtype=torch.long), persistent=False)
        else:
            self.expert_bias = self.expert_load = None
        # Off while a pipeline stage runs on torch's placeholder inputs (paused_load_counting).
        self.count_load = True
        self.shared_experts = None
        if moe.num_shared_experts:
            shared = moe.shared_expert_intermediate_size or moe.num_shared_experts * expert_size
            self.shared_experts = MLP(hidden_size, shared, init_method=init_method, layer_idx=layer_idx, **mlp_options)
        # Replaced by libai_lite.parallel.expert_parallel to exchange tokens over the expert-parallel group.
        self.dispatch = _local_experts
        self.run_slots = _local_slots
        self.ep_size = 1
        self.aux_loss: Optional[torch.Tensor] = None
        self.stats: dict = {}
        self.aux_loss_in_backward = False
        self.aux_grad_scale = 1.0
        self.step_records: list[dict] = []

    def backprop_aux_loss(self, grad_scale: float) -> None:
        """Back-propagate the weighted auxiliary loss, times the fp16 loss scale ``grad_scale``, from this
        layer's output and record statistics in ``step_records``, since a pipeline stage returns no loss."""
        self.aux_loss_in_backward = True
        self.aux_grad_scale = float(grad_scale)
        self.step_records = []

    @property
    def local_expert_ids(self) -> list[int]:
        """Global indices of the experts this rank holds, in order."""
        return [int(k) for k in self.experts.keys()]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` ``[..., hidden]`` -> the experts' weighted outputs, same shape."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        routing = route(self.router(x), self.top_k, self.capacity_factor, self.router_kind, self.expert_bias)
        if self.expert_load is not None and self.training and torch.is_grad_enabled() and self.count_load:
            # Recomputation under activation checkpointing counts a micro-batch twice in every layer it
            # recomputes; the update takes only the sign of each expert's distance from the mean, which that keeps.
            self.expert_load.add_(routing.load)
        aux_loss = load_balancing_loss(routing.probs, routing.load)
        # Fixed slots avoid a host read but need equal token counts on every expert-parallel rank, which the
        # built-in loaders give in training; evaluation may batch each rank to its own length.
        if self.capacity_factor is not None and (self.run_slots is _local_slots or torch.is_grad_enabled()):
            out = self._fixed_capacity(x, routing)
        else:
            out = self._variable(x, routing)
        assignments = routing.expert_index.numel()
        load = routing.load.float()
        # Tensors, read when the trainer logs (a float() here would stall the GPU every layer).
        self.stats = {"assignments": assignments, "dropped": assignments - routing.keep.sum(),
                      "load_max": (load.max() / load.mean()).detach()}
        out = out.view(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        if not self.aux_loss_in_backward:
            self.aux_loss = aux_loss
        elif torch.is_grad_enabled():
            out = _AuxLossInBackward.apply(out, aux_loss, self, self.stats)
        return out

    def _fixed_capacity(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The experts on ``[capacity, hidden]`` zero-filled slots each, so no shape depends on the routing.
        Dropped assignments go to one spare slot whose output is never read."""
        num_experts, capacity, k = self.num_experts, routing.capacity, self.top_k
        keep = routing.keep.reshape(-1)
        flat_expert = routing.expert_index.reshape(-1)
        slot = torch.where(keep, flat_expert * capacity + routing.position.reshape(-1), num_experts * capacity)
        token_of = torch.arange(keep.numel(), device=x.device) // k
        slots = x.new_zeros(num_experts * capacity + 1, x.shape[-1]).index_add_(0, slot, x.index_select(0, token_of))
        expert_out = self.run_slots(self.experts, slots[:-1], capacity)
        expert_out = torch.cat([expert_out, expert_out.new_zeros(1, expert_out.shape[-1])])
        gates = (routing.gates.reshape(-1) * keep).to(expert_out.dtype)
        weighted = (expert_out.index_select(0, slot) * gates.unsqueeze(1)).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, weighted)

    def _variable(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The experts on exactly their kept tokens: sizes read back to the host (no capacity limit, or
        expert-parallel evaluation, whose all-to-all takes host split sizes)."""
        kept = routing.keep.reshape(-1).nonzero().squeeze(1)
        flat_expert = routing.expert_index.reshape(-1)
        # Kept assignments grouped by expert; within an expert, in token order.
        order = kept[torch.argsort(flat_expert[kept], stable=True)]
        token_of = order // self.top_k
        tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).index_add_(
            0, flat_expert[order], torch.ones_like(order))
        dispatched = x.index_select(0, token_of)
        expert_out = self.dispatch(self.experts, dispatched, tokens_per_expert)
        gates = routing.gates.reshape(-1).index_select(0, order).to(expert_out.dtype)
        weighted = (expert_out * gates.unsqueeze(1)).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, weighted)

    def extra_repr(self) -> str:
        cf = "none" if self.capacity_factor is None else f"{self.capacity_factor:g}"
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, capacity_factor={cf}, router={self.router_kind}, "
                f"local_experts={self.local_expert_ids}, ep_size={self.ep_size}, layer_idx={self.layer_idx}")


def _local_experts(experts: Experts, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    return experts(tokens, tokens_per_expert.tolist())


def _local_slots(experts: Experts, slots: torch.Tensor, capacity: int) -> torch.Tensor:
    return experts.run_fixed(slots, capacity)


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """Every ``MoELayer`` in ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


# How the trainer treats the entries ``collect_moe_outputs`` adds to a model's outputs.
MOE_METRICS = {"moe_aux_loss": LOSS, "moe_dropped_frac": MEAN, "moe_load_max": MEAN}


def collect_moe_outputs(model: nn.Module) -> dict:
    """The MoE entries of a model's output dict from the layers' last forward, ``{}`` when dense.
    ``moe_aux_loss`` sums the weighted losses, ``moe_dropped_frac`` is dropped over all assignments, and
    ``moe_load_max`` is the largest max/mean expert load before capacity. Statistics cover this rank."""
    layers = [m for m in moe_layers(model) if m.aux_loss is not None]
    if not layers:
        return {}
    aux = sum(m.aux_loss_weight * m.aux_loss for m in layers)
    assignments = sum(m.stats["assignments"] for m in layers)
    dropped = sum(m.stats["dropped"] for m in layers)
    out = {
        "moe_aux_loss": aux,
        "moe_dropped_frac": (dropped / max(assignments, 1)).float(),
        "moe_load_max": torch.stack([m.stats["load_max"] for m in layers]).amax().float(),
    }
    for m in layers:
        # The graph behind the aux loss is released once the wrapper holds it.
        m.aux_loss = None
    return out


def update_router_biases(model: nn.Module, group=None, skip: Optional[torch.Tensor] = None) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3), after an optimizer step: each ``sigmoid_bias`` layer's
    ``expert_bias += bias_update_rate * sign(mean load - load)``, the loads counted since the last update and
    summed over ``group`` (the data-parallel group: the global batch; one all-reduce for all layers). ``skip``
    (a 0-d tensor, 1 for a skipped step) leaves the biases unchanged without a host read."""
    layers = [m for m in moe_layers(model) if m.expert_load is not None]
    if not layers:
        return
    loads = torch.stack([m.expert_load for m in layers])
    if group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)
    loads = loads.float()
    step = torch.sign(loads.mean(dim=1, keepdim=True) - loads)
    if skip is not None:
        step = step * (1 - skip.to(step.device).float())
    for m, s in zip(layers, step):
        m.expert_bias.add_(m.bias_update_rate * s)
        m.expert_load.zero_()


@contextlib.contextmanager
def paused_load_counting(module: nn.Module):
    """No ``sigmoid_bias`` layer of ``module`` counts its load inside (forwards that are not training data)."""
    layers = moe_layers(module)
    saved = [m.count_load for m in layers]
    for m in layers:
        m.count_load = False
    try:
        yield
    finally:
        for m, was in zip(layers, saved):
            m.count_load = was


def router_bias_after_optimizer_step(optimizer, module: nn.Module, group=None) -> bool:
    """Have ``optimizer`` run ``update_router_biases(module, group)`` after each of its steps (skipped where
    the trainer's ``found_inf`` says the step was); returns whether ``module`` has any ``sigmoid_bias`` layer."""
    if not any(m.expert_load is not None for m in moe_layers(module)):
        return False
    optimizer.register_step_post_hook(
        lambda opt, *_: update_router_biases(module, group, getattr(opt, "found_inf", None)))
    return True


def inactive_expert_parameters(model: nn.Module) -> int:
    """Expert parameters a token does not use, ``(E - k) / E`` of each MoE layer's experts (for FLOPs;
    call it on the whole model, before expert parallelism removes other ranks' experts)."""
    total = 0
    for m in moe_layers(model):
        per_layer = sum(p.numel() for p in m.experts.parameters())
        total += per_layer * (m.num_experts - m.top_k) // m.num_experts
    return total
