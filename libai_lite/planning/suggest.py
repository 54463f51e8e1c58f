"""``suggest``: the cheapest change of settings whose re-estimated peak fits the device."""
from __future__ import annotations

import dataclasses

from ..utils.errors import UsageError
from .estimate import MemoryPlanner
from .settings import MemoryEstimate, PlanSettings



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
    """The settings ``suggest`` tries, in order. First each single change alone, cheapest kind first: ZeRO,
    activation checkpointing, a smaller micro-batch with the same global batch, then more tensor or pipeline
    parallelism. Then the kinds stacked, each on the previous kinds' strongest setting."""
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
        if new.hsdp:
            # The replicate groups stay; each holds what the new data-parallel size leaves.
            out.append("train.dist.data_parallel_shard_size=null")
    return " ".join(out)

