"""Loading DCP checkpoints that store a gated MLP's gate and up projections as two weights.

Such a checkpoint stores ``...mlp.dense_h_to_4h.<kind>`` (the gate) and ``...mlp.dense_h_to_4h_linear.<kind>``
(the up projection), optimizer moments included, where the model has one ``dense_h_to_4h`` of ``2 * ffn``
interleaved rows. The fused name is the gate's, so the optimizer's step and param groups load unchanged.
``Checkpointer.load`` reads both halves and joins them into the model's (possibly sharded) tensors.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from ..layers.mlp import LEGACY_UP, join_gate_up

_FUSED = ".dense_h_to_4h."


def _up_key(key: str) -> str | None:
    """The old up projection's key for a fused key (model or optimizer), or None for another tensor."""
    if _FUSED not in key:
        return None
    head, tail = key.rsplit(_FUSED, 1)
    return f"{head}.{LEGACY_UP}.{tail}"


def _legacy(meta: dict, section: str, key: str, shape) -> tuple | None:
    """The stored half shape when ``section.key`` was written as two halves of ``shape``, else None."""
    up = _up_key(key)
    gate_meta, up_meta = meta.get(f"{section}.{key}"), meta.get(f"{section}.{up}") if up else None
    if gate_meta is None or up_meta is None or not hasattr(gate_meta, "size") or not hasattr(up_meta, "size"):
        return None
    half = tuple(gate_meta.size)
    if half != tuple(up_meta.size) or not half or tuple(shape) != (2 * half[0], *half[1:]):
        return None
    return half


def model_view(meta: dict, own: dict) -> dict:
    """``own`` (model FQN -> tensor) as the old checkpoint lays it out: each fused tensor as its two
    halves (meta tensors of the stored shape), for the shape and key checks."""
    out = dict(own)
    for key, t in own.items():
        half = _legacy(meta, "model", key, t.shape) if isinstance(t, torch.Tensor) else None
        if half is not None:
            out[key] = out[_up_key(key)] = torch.empty(half, device="meta")
    return out


def stand_ins(meta: dict, state: dict) -> dict:
    """Replace, in ``state`` (``{"model": ..., "optim": ...}`` of flat keys), every fused tensor the checkpoint
    holds as two halves by whole stand-ins for both; returns ``{(section, key): the replaced tensor}``."""
    out = {}
    for section in ("model", "optim"):
        for key, target in list(state.get(section, {}).items()):
            half = _legacy(meta, section, key, target.shape) if isinstance(target, torch.Tensor) else None
            if half is None:
                continue
            local = target.to_local() if isinstance(target, DTensor) else target
            stored = meta[f"{section}.{key}"].properties.dtype
            for k in (key, _up_key(key)):
                state[section][k] = torch.empty(half, dtype=stored, device=local.device)
            out[(section, key)] = target
    return out


def join_loaded(state: dict, replaced: dict) -> None:
    """After ``dcp.load``: join each pair of loaded halves into the tensor ``stand_ins`` replaced, in place
    (its shard, for a DTensor), and put that tensor back in ``state``."""
    for (section, key), target in replaced.items():
        up = state[section].pop(_up_key(key))
        whole = join_gate_up(state[section][key], up)
        with torch.no_grad():
            if isinstance(target, DTensor):
                # Every rank holds the whole tensor: each keeps its own shard, no communication.
                shard = distribute_tensor(whole.to(target.dtype), target.device_mesh, target.placements,
                                          src_data_rank=None)
                target.to_local().copy_(shard.to_local())
            else:
                target.copy_(whole)
        state[section][key] = target
