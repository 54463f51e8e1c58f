"""One gradient clipper for every layout: plain, DDP, FSDP2/ZeRO, tensor, pipeline and expert parallel.

``torch.nn.utils.clip_grad_norm_`` fails on DTensor gradients of different meshes and knows nothing of
pipeline stages or a tied weight held twice. Here the norm is taken per mesh, other ranks' experts and
stages are added, and scaling works shard by shard.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .expert_parallel import reduce_expert_norm


def scale_grads_(params: Iterable[torch.Tensor], coef: float | torch.Tensor) -> None:
    """Multiply every gradient by ``coef`` in place, shard by shard: one scalar is right for any placement,
    and local shards let gradients of different meshes go through together (one DTensor foreach refuses)."""
    by_device: dict = {}
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            by_device.setdefault(g.device, []).append(g)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(device) if torch.is_tensor(coef) else coef)


def _mesh_norms(grads: list[torch.Tensor], norm_type: float, error_if_nonfinite: bool) -> list[torch.Tensor]:
    """One norm per (mesh, placements) group of gradients, DTensor reductions finished, experts included."""
    groups: dict = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    norms = []
    for key, group in groups.items():
        norm = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        # Expert parallelism: the other experts' gradients live on the other ranks of the ep group.
        norms.append(reduce_expert_norm(norm, key[0] if key else None, norm_type))
    return norms


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    pp_group=None,
    exclude_from_norm: Iterable[torch.Tensor] = (),
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the gradients' global norm to ``max_norm``, inf only measuring; returns the norm before
    clipping, a 0-d fp32 tensor equal on every rank. ``exclude_from_norm`` gradients are scaled but not
    counted. Nothing is read back to the host unless ``error_if_nonfinite``.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    skip = {id(p) for p in exclude_from_norm}
    norm_type = float(norm_type)
    grads = [p.grad for p in params if id(p) not in skip]
    device = (grads[0].to_local() if isinstance(grads[0], DTensor) else grads[0]).device if grads else "cpu"
    norms = [n.to(device=device, dtype=torch.float32) for n in _mesh_norms(grads, norm_type, error_if_nonfinite)]
    inf = math.isinf(norm_type)
    stacked = torch.stack(norms) if norms else torch.zeros(1, device=device)
    total = stacked.max() if inf else stacked.pow(norm_type).sum()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        if dist.get_backend(pp_group) == "nccl" and total.device.type != "cuda":
            total = total.cuda()
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=pp_group)
    if not inf:
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {float(total)}")
    # An infinite max_norm only measures: multiplying every gradient by 1 would be a wasted pass.
    if params and not math.isinf(max_norm):
        scale_grads_(params, torch.clamp(float(max_norm) / (total + 1e-6), max=1.0))
    return total
