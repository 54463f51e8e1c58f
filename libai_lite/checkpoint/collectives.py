"""The few collectives the checkpoint concerns share: every rank's object, and work spread over the ranks."""
from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from ..utils.distributed import get_rank


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def gather(obj, group=None) -> list:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` without a process group).

    ``group`` spans every rank (the default group, or the background writer's copy of it).
    """
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def spread(fn: Callable, items: list, group=None) -> list:
    """``[fn(item) for item in items]`` on every rank, each rank computing every world-size-th item.

    ``fn`` must not raise: a rank that left the collective would leave the others waiting.
    """
    world, rank = world_size(), get_rank()
    done = {}
    for part in gather({i: fn(items[i]) for i in range(rank, len(items), world)}, group):
        done.update(part)
    return [done[i] for i in range(len(items))]
