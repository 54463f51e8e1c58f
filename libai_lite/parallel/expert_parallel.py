"""Expert parallelism: the experts of each MoE layer spread over ``ep_size`` ranks of the data-parallel group.

``"dp"`` is unflattened into ``("edp", "ep")``. Consecutive data-parallel ranks share a layer's experts,
rank ``i`` holding ``[i * E/ep, (i + 1) * E/ep)``; keys stay global, so checkpoints load under any
``ep_size``. Tokens reach the experts by all-to-all. Expert gradients are reduced over ``"edp"`` and
divided by the whole dp size, since each already sums every token its ep group sent it.
"""
from __future__ import annotations

import functools
import logging
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..layers.moe import Experts, MoEConfig, moe_layers
from ..utils.errors import UsageError
from .data_parallel import check_zero1

logger = logging.getLogger("libai_lite")

# (edp mesh, ep process group) of every expert layout built in this process, for clip_grad_norm_.
_EXPERT_MESHES: list[tuple[DeviceMesh, object]] = []
_MESH_CACHE: dict = {}


def check_moe_layout(moe: MoEConfig | None, dp: int, tp: int, zero_stage: int, sequence_parallel: bool) -> None:
    """Refuse, with one line, layouts MoE layers cannot run under."""
    if moe is None:
        return
    ep = moe.ep_size
    if dp % ep:
        raise UsageError(f"model.cfg.moe.ep_size={ep} does not divide the data-parallel size {dp}: experts are "
                         f"spread over data-parallel ranks; use an ep_size that divides {dp} or launch a multiple "
                         f"of {ep} data-parallel ranks")
    if sequence_parallel:
        raise UsageError("MoE layers route whole tokens and cannot take sequence-parallel slices; set "
                         "train.dist.sequence_parallel=False")
    if ep > 1 and tp > 1:
        raise UsageError(f"expert parallelism (model.cfg.moe.ep_size={ep}) with tensor parallelism is not "
                         f"supported; use model.cfg.moe.ep_size=1 with tensor_parallel_size={tp}, or "
                         f"tensor_parallel_size=1")
    if ep > 1 and zero_stage == 1:
        check_zero1(expert_parallel=True)


def build_expert_mesh(mesh: DeviceMesh, ep_size: int) -> DeviceMesh:
    """The ``("pp", "edp", "ep", "tp")`` mesh: ``mesh``'s ``"dp"`` split into ``edp x ep`` (ep ranks consecutive).

    Collective: every rank must call it (it creates the process groups). Cached per mesh and size.
    """
    key = (id(mesh), ep_size)
    if key not in _MESH_CACHE:
        names, shape = list(mesh.mesh_dim_names), list(mesh.mesh.shape)
        i = names.index("dp")
        if shape[i] % ep_size:
            raise UsageError(f"model.cfg.moe.ep_size={ep_size} does not divide the data-parallel size {shape[i]}")
        # Data-parallel rank r is (edp, ep) = divmod(r, ep_size) in row-major unflattening.
        names[i:i + 1], shape[i:i + 1] = ["edp", "ep"], [shape[i] // ep_size, ep_size]
        expert_mesh = DeviceMesh(mesh.device_type, mesh.mesh.reshape(shape), mesh_dim_names=tuple(names))
        _MESH_CACHE[key] = expert_mesh
        _EXPERT_MESHES.append((expert_mesh["edp"], expert_mesh["ep"].get_group()))
    return _MESH_CACHE[key]


def reduce_expert_norm(norm: torch.Tensor, mesh: DeviceMesh | None, norm_type: float) -> torch.Tensor:
    """``norm`` of the gradients on ``mesh``, extended over the other experts of its ep group (fp32) when
    ``mesh`` is an expert-data-parallel mesh, else unchanged. Collective over that group."""
    if mesh is None or tuple(mesh.mesh_dim_names or ()) != ("edp",):
        return norm
    ep_group = next((group for edp, group in _EXPERT_MESHES if edp == mesh), None)
    if ep_group is None:
        return norm
    if math.isinf(norm_type):
        norm = norm.float()
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=ep_group)
        return norm
    norm = norm.float().pow(norm_type)
    dist.all_reduce(norm, group=ep_group)
    return norm.pow(1.0 / norm_type)


def apply_expert_parallel(model: nn.Module, expert_mesh: DeviceMesh) -> list:
    """Keep this rank's share of every MoE layer's experts and give the layers their ep group; returns the
    layers. Call it on the whole model before tensor, activation checkpointing and data parallelism."""
    ep_mesh = expert_mesh["ep"]
    ep_size, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    layers = moe_layers(model)
    for layer in layers:  # MoEConfig has checked that ep_size divides num_experts
        per_rank = layer.num_experts // ep_size
        mine = set(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))
        for key in list(layer.experts.keys()):
            if int(key) not in mine:
                del layer.experts[key]
        layer.dispatch = functools.partial(expert_parallel_forward, group=ep_mesh.get_group(), ep_size=ep_size)
        layer.run_slots = functools.partial(expert_parallel_slots, group=ep_mesh.get_group(), ep_size=ep_size)
        layer.ep_size = ep_size
    if layers:
        logger.info(f"Expert parallel: ep={ep_size}, this rank holds experts {layers[0].local_expert_ids} "
                    f"of {layers[0].num_experts} in each of {len(layers)} MoE layers")
    return layers


def expert_parallel_forward(experts: Experts, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, *, group,
                            ep_size: int) -> torch.Tensor:
    """An ``MoELayer.dispatch``: send ``tokens`` (sorted by global expert, ``tokens_per_expert`` ``[E]`` rows
    each) to their experts' ranks, run the local experts, and return their outputs in the order of
    ``tokens``. Differentiable: backward runs the two all-to-alls in reverse."""
    import torch.distributed._functional_collectives as funcol

    num_experts = tokens_per_expert.numel()
    local = num_experts // ep_size
    send_counts = tokens_per_expert.to(torch.int64).contiguous()
    recv_counts = torch.empty_like(send_counts)
    # recv_counts[src * local + i]: rows rank src sends to this rank's i-th expert.
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits = send_counts.view(ep_size, local).sum(1).tolist()
    recv_matrix = recv_counts.view(ep_size, local)
    recv_splits = recv_matrix.sum(1).tolist()
    received = funcol.all_to_all_single_autograd(tokens, recv_splits, send_splits, group)
    # Received rows come grouped (source rank, local expert); the experts want (local expert, source).
    segment_expert = torch.arange(ep_size * local, device=tokens.device) % local
    row_expert = torch.repeat_interleave(segment_expert, recv_counts)
    perm = torch.argsort(row_expert, stable=True)
    out = experts(received.index_select(0, perm), recv_matrix.sum(0).tolist())
    out = out.index_select(0, torch.argsort(perm))
    return funcol.all_to_all_single_autograd(out, send_splits, recv_splits, group)


def expert_parallel_slots(experts: Experts, slots: torch.Tensor, capacity: int, *, group, ep_size: int) -> torch.Tensor:
    """An ``MoELayer.run_slots``: send ``slots`` ``[experts * capacity, hidden]`` to their experts' ranks and
    the outputs back in the same layout, with equal pieces so no size is read to the host. Every rank must
    route the same number of tokens. Differentiable."""
    import torch.distributed._functional_collectives as funcol

    local = slots.shape[0] // (capacity * ep_size)
    # Rank r receives the slots of its `local` experts from every rank: (source rank, local expert, slot).
    received = funcol.all_to_all_single_autograd(slots.contiguous(), None, None, group)
    per_expert = received.view(ep_size, local, capacity, -1).transpose(0, 1).reshape(local * ep_size * capacity, -1)
    out = experts.run_fixed(per_expert, ep_size * capacity)
    back = out.view(local, ep_size, capacity, -1).transpose(0, 1).reshape(ep_size * local * capacity, -1)
    return funcol.all_to_all_single_autograd(back.contiguous(), None, None, group)


class PipelineMoE:
    """The MoE layers of this rank's pipeline stages, each back-propagating its own auxiliary loss.
    ``step_metrics`` combines their per-micro-batch records over the pipeline group, a collective."""

    def __init__(self, stage_modules, pp_group, n_microbatches: int, device: torch.device):
        self.layers = [m for module in stage_modules for m in moe_layers(module)]
        self.pp_group = pp_group if pp_group is not None and dist.get_world_size(pp_group) > 1 else None
        self.n_microbatches = int(n_microbatches)
        self.device = device
        present = torch.tensor([len(self.layers)], device=device)
        if self.pp_group is not None:
            dist.all_reduce(present, group=self.pp_group)
        self.enabled = bool(present.item())

    def begin_step(self, loss_scale: float) -> None:
        """Before a step's schedule runs: the auxiliary losses' gradients scaled like the main loss's."""
        for m in self.layers:
            m.backprop_aux_loss(loss_scale)

    def step_metrics(self) -> dict:
        """``moe_aux_loss`` (already in the gradients), ``moe_dropped_frac``, ``moe_load_max`` of the step
        on every pipeline rank; ``{}`` for a dense model."""
        if not self.enabled:
            return {}
        n = self.n_microbatches
        sums = torch.zeros(n, 3, dtype=torch.float64, device=self.device)  # aux, assignments, dropped
        load_max = torch.zeros(n, dtype=torch.float64, device=self.device)
        for m in self.layers:
            # The last n, since torch's first step also runs the last stage on placeholder inputs.
            for i, r in enumerate(m.step_records[-n:]):
                sums[i, 0] += r["aux"].double()
                sums[i, 1] += r["assignments"]
                sums[i, 2] += r["dropped"]
                load_max[i] = torch.maximum(load_max[i], torch.as_tensor(r["load_max"], dtype=load_max.dtype,
                                                                          device=load_max.device))
            m.step_records = []
        if self.pp_group is not None:
            dist.all_reduce(sums, group=self.pp_group)
            dist.all_reduce(load_max, op=dist.ReduceOp.MAX, group=self.pp_group)
        return {
            "moe_aux_loss": sums[:, 0].mean().float(),
            "moe_dropped_frac": (sums[:, 2] / sums[:, 1].clamp(min=1)).mean().float(),
            "moe_load_max": load_max.mean().float(),
        }
