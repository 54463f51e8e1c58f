"""The check that keeps NaN and inf weights out of a checkpoint: one reduction on the device, one host read."""
from __future__ import annotations

import math

import torch

from .collectives import gather, world_size


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's own shard: the check needs no communication beyond the one flag gather.
    return t.to_local() if hasattr(t, "to_local") else t


def first_nonfinite_weight(parts) -> str:
    """Collective: the name of a parameter of ``parts`` (the model parts of every rank) holding a NaN or inf
    on some rank, as ``"NAME on rank R"``, or ``""`` when all are finite.

    The largest magnitude per parameter is reduced on its device (``_foreach_norm`` with ord inf, NaN
    propagating), so a rank reads one value back; the names are looked for only when that value is not finite.
    """
    named = [(n, _local(p.detach())) for part in parts for n, p in part.named_parameters()]
    named = [(n, t) for n, t in named if t.is_floating_point() and t.numel() > 0]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for _, t in named:
        groups.setdefault((t.device, t.dtype), []).append(t)
    worst = [torch.stack(torch._foreach_norm(ts, math.inf)).float().max() for ts in groups.values()]
    bad = ""
    if worst and not bool(torch.isfinite(torch.stack([w.to(worst[0].device) for w in worst])).all()):
        bad = next((n for n, t in named if not torch.isfinite(t).all()), "a parameter")
    found = [(rank, name) for rank, name in enumerate(gather(bad)) if name]
    if not found:
        return ""
    rank, name = found[0]
    return f"{name} on rank {rank}" if world_size() > 1 else name
