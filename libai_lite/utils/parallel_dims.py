"""The parallel sizes of a run, decided from ``train.dist`` and the world size before any process group exists:
``ParallelDims`` (torchtitan's name), LiBai's capping rule, the ZeRO settings and each layer's pipeline stage."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from .errors import UsageError

logger = logging.getLogger("libai_lite")

# train.dist.pipeline_schedule's choices: torch.distributed.pipelining's schedules (parallel.pipeline.SCHEDULES).
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")
# Rank r runs stages r and 2 * pp - 1 - r, so the first and last stage share rank 0.
V_SHAPE_SCHEDULES = frozenset({"zbv_zero_bubble", "dualpipev"})
# Run each backward as an input-gradient then a weight-gradient pass.
SPLIT_BACKWARD_SCHEDULES = frozenset({"interleaved_zero_bubble"}) | V_SHAPE_SCHEDULES


@dataclass(frozen=True)
class ParallelDims:
    """The validated layout of a run for ``world_size`` processes: sizes, ZeRO and pipeline options.

    ``ParallelDims.resolve`` is the only place ``train.dist`` and ``train.zero_optimization`` are read; the
    process group's ``Layout`` (``utils.distributed.setup_dist``), the run specification
    (``libai_lite.run_spec``) and the memory planner all start from it.
    """

    world_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    context_parallel_size: int = 1
    tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    zero_stage: int = 0
    offload: bool = False
    pipeline_schedule: str = "1f1b"
    virtual_pipeline_size: int = 1
    custom_pipeline_stage_id: tuple[int, ...] | None = None
    # HSDP: the data-parallel ranks as replicate x shard groups (1: every dp rank shards, plain FSDP/ZeRO).
    data_parallel_replicate_size: int = 1

    @classmethod
    def resolve(cls, world_size: int, dist_cfg, zero_cfg=None) -> ParallelDims:
        """``train.dist`` and ``train.zero_optimization`` for ``world_size`` processes; UsageError when they do
        not fit."""
        dist_cfg = dist_cfg if dist_cfg is not None else {}
        pp, dp, cp, tp = layout_sizes(world_size, dist_cfg)
        zero_stage, offload = zero_settings(zero_cfg)
        virtual = int(dist_cfg.get("virtual_pipeline_size", 1) or 1)
        if virtual < 1:
            raise UsageError(f"train.dist.virtual_pipeline_size={virtual} must be at least 1")
        if virtual > 1 and int(dist_cfg.get("pipeline_parallel_size", 1) or 1) == 1:
            raise UsageError(f"train.dist.virtual_pipeline_size={virtual} splits each pipeline rank's layers into "
                             f"stages, but train.dist.pipeline_parallel_size=1 (no pipeline); set "
                             f"train.dist.pipeline_parallel_size to 2 or more, or virtual_pipeline_size=1")
        if virtual > 1 and pp == 1:
            logger.warning(f"train.dist.virtual_pipeline_size={virtual} has no effect: the pipeline was capped to one "
                           f"stage on {world_size} process(es)")
        custom = dist_cfg.get("custom_pipeline_stage_id", None)
        replicate = hsdp_sizes(dp, dist_cfg, int(zero_stage or 0))[0]
        if replicate > 1 and pp > 1 and int(zero_stage or 0) == 3:
            # Seen on torch 2.11 and 2.13: the last stage's first forward under the pipeline schedule gets a
            # wrong-shaped output when its parameters are resharded after forward over a 2-D mesh.
            raise UsageError(f"HSDP (train.dist.data_parallel_replicate_size={replicate}) with pipeline parallelism "
                             f"(pipeline_parallel_size={pp}) is not supported at ZeRO stage 3; use "
                             f"train.zero_optimization.stage=2, or data_parallel_replicate_size=null with "
                             f"data_parallel_shard_size=null for plain ZeRO-3")
        return cls(world_size, pp, dp, cp, tp, sequence_parallel=bool(dist_cfg.get("sequence_parallel", False)),
                   zero_stage=int(zero_stage or 0), offload=bool(offload),
                   pipeline_schedule=str(dist_cfg.get("pipeline_schedule", "1f1b") or "1f1b"),
                   virtual_pipeline_size=virtual,
                   custom_pipeline_stage_id=tuple(int(s) for s in custom) if custom is not None else None,
                   data_parallel_replicate_size=replicate)

    @property
    def data_parallel_shard_size(self) -> int:
        """The data-parallel ranks each parameter is sharded over: data_parallel_size / replicate size."""
        return self.data_parallel_size // self.data_parallel_replicate_size

    @property
    def hsdp(self) -> bool:
        """Whether the data-parallel ranks form replicate x shard groups (HSDP) rather than one flat group."""
        return self.data_parallel_replicate_size > 1

    def describe_dp(self) -> str:
        """``dp=4``, or under HSDP ``dp 4 = 2 replicate x 2 shard``: what the start-up lines name."""
        if not self.hsdp:
            return f"dp={self.data_parallel_size}"
        return (f"dp {self.data_parallel_size} = {self.data_parallel_replicate_size} replicate x "
                f"{self.data_parallel_shard_size} shard (HSDP)")

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all: ranks x virtual stages per rank."""
        return self.pipeline_parallel_size * self.virtual_pipeline_size

    def stage_of_layer(self, num_layers: int) -> tuple[int, ...]:
        """The pipeline stage of each of ``num_layers`` layers (``layer_stages``); empty without a pipeline."""
        if self.pipeline_parallel_size == 1:
            return ()
        return tuple(layer_stages(num_layers, self.num_stages, self.custom_pipeline_stage_id))

    def sizes(self) -> dict:
        """The four sizes under their ``train.dist`` names (what config.yaml records)."""
        return {"pipeline_parallel_size": self.pipeline_parallel_size, "data_parallel_size": self.data_parallel_size,
                "tensor_parallel_size": self.tensor_parallel_size, "context_parallel_size": self.context_parallel_size,
                "data_parallel_replicate_size": self.data_parallel_replicate_size,
                "data_parallel_shard_size": self.data_parallel_shard_size}


def hsdp_sizes(dp: int, dist_cfg, zero_stage: int) -> tuple[int, int]:
    """(replicate, shard) sizes of the ``dp`` data-parallel ranks from ``train.dist.data_parallel_replicate_size``
    and ``data_parallel_shard_size`` (torchtitan's degrees; either null is what the other leaves, both null plain
    FSDP: replicate 1, shard dp); UsageError when they do not split ``dp`` or HSDP is asked without FSDP."""
    replicate, shard = dist_cfg.get("data_parallel_replicate_size", None), dist_cfg.get("data_parallel_shard_size", None)
    for name, value in (("data_parallel_replicate_size", replicate), ("data_parallel_shard_size", shard)):
        if value is not None and int(value) < 1:
            raise UsageError(f"train.dist.{name}={value} must be at least 1, or null")
    if replicate is None and shard is None:
        return 1, dp
    if replicate is not None and shard is not None:
        replicate, shard = int(replicate), int(shard)
        if replicate * shard != dp:
            raise UsageError(f"train.dist.data_parallel_replicate_size({replicate}) x data_parallel_shard_size({shard}) "
                             f"= {replicate * shard} is not the data-parallel size {dp}; set one of them to null so "
                             f"the other's share of the {dp} data-parallel ranks is derived, or give sizes whose "
                             f"product is {dp}")
    else:
        given, name = (int(replicate), "data_parallel_replicate_size") if replicate is not None \
            else (int(shard), "data_parallel_shard_size")
        if dp % given:
            raise UsageError(f"train.dist.{name}={given} does not divide the data-parallel size {dp}; use a divisor "
                             f"of {dp}, or launch a multiple of {given} data-parallel ranks")
        replicate, shard = (given, dp // given) if replicate is not None else (dp // given, given)
    if replicate > 1 and zero_stage not in (2, 3):
        raise UsageError(f"HSDP (train.dist.data_parallel_replicate_size={replicate} x data_parallel_shard_size="
                         f"{shard}) shards with FSDP, and ZeRO stage {zero_stage} does not use it; set "
                         f"train.zero_optimization.enabled=True with stage=3 (or 2), or "
                         f"train.dist.data_parallel_replicate_size=null with data_parallel_shard_size=null")
    return replicate, shard


def layout_sizes(world_size: int, dist_cfg) -> tuple[int, int, int, int]:
    """(pp, dp, cp, tp) for ``world_size`` processes from `train.dist`, LiBai's way; UsageError if they don't fit.

    Left null, the data-parallel size is world / (pp x cp x tp), so one recipe runs on any process count.
    A world smaller than the model parallelism caps tensor size at the world and pipeline size at what
    remains, as LiBai does (context parallelism is never capped; ``capped_sizes`` reports it);
    ``train.dist.strict_layout=True`` refuses instead. An explicit data-parallel size must fit the world.
    """
    configured = {name: int(dist_cfg.get(name, 1) or 1) for name in _MODEL_DIMS}
    cp = int(dist_cfg.get("context_parallel_size", 1) or 1)
    for name, value in (*configured.items(), ("context_parallel_size", cp)):
        if value < 1:
            raise UsageError(f"train.dist.{name}={value} must be at least 1")
    used = capped_sizes(world_size, configured)
    if used != configured and bool(dist_cfg.get("strict_layout", False)):
        need = " x ".join(f"{n}({v})" for n, v in configured.items() if v > 1)
        raise UsageError(f"train.dist asks for {need} = {_product(configured)} processes but {world_size} were "
                         f"launched (train.dist.strict_layout=True); launch at least {_product(configured)} "
                         f"processes or set train.dist.strict_layout=False to have the sizes capped")
    tp, pp = used["tensor_parallel_size"], used["pipeline_parallel_size"]
    model = pp * cp * tp
    named = f"pipeline_parallel_size({pp}) x " + (f"context_parallel_size({cp}) x " if cp > 1 else "") + \
        f"tensor_parallel_size({tp})"
    fits = world_size % model == 0
    dp = dist_cfg.get("data_parallel_size", None)
    if dp is None and not fits:
        raise UsageError(f"world size {world_size} is not divisible by {named}; launch a multiple of {model} "
                         f"processes or change train.dist")
    dp = world_size // model if dp is None else int(dp)
    if dp * model != world_size:
        fix = world_size // model if fits else "null"
        with_cp = f" x context_parallel_size({cp})" if cp > 1 else ""
        raise UsageError(f"train.dist layout data_parallel_size({dp}) x tensor_parallel_size({tp}) x "
                         f"pipeline_parallel_size({pp}){with_cp} = {dp * model} does not match the world size "
                         f"{world_size}; launch {dp * model} processes or set train.dist.data_parallel_size={fix}")
    return pp, dp, cp, tp


# The model-parallel dimensions in LiBai's capping order: tensor first, then pipeline. Context parallelism
# is not capped: it is chosen for a sequence length, and a run without it would not fit where it was meant to.
_MODEL_DIMS = ("tensor_parallel_size", "pipeline_parallel_size")


def _product(sizes: dict) -> int:
    out = 1
    for v in sizes.values():
        out *= v
    return out


def capped_sizes(world_size: int, configured: dict) -> dict:
    """The model-parallel sizes a world of ``world_size`` processes can hold: each of ``_MODEL_DIMS`` in turn
    capped at what the sizes before it leave (LiBai: tp = min(tp, world), pp = min(pp, world // tp))."""
    used, left = {}, world_size
    for name in _MODEL_DIMS:
        used[name] = max(1, min(configured[name], left))
        left = max(1, left // used[name])
    return used


def describe_capping(world_size: int, dist_cfg) -> str | None:
    """The start-up warning for sizes ``layout_sizes`` capped to fit ``world_size``, or None."""
    configured = {name: int(dist_cfg.get(name, 1) or 1) for name in _MODEL_DIMS}
    used = capped_sizes(world_size, configured)
    changed = [f"{name} {configured[name]} -> {used[name]}" for name in _MODEL_DIMS if used[name] != configured[name]]
    if not changed:
        return None
    return (f"train.dist: {', '.join(changed)} to fit the {world_size} launched process(es) (LiBai's rule: model "
            f"parallel sizes are capped at the world size; train.dist.strict_layout=True refuses instead)")


def layer_stages(num_layers: int, num_stages: int, custom_stage_ids: Sequence[int] | None = None) -> list[int]:
    """Stage of each layer: an even split (earlier stages take the remainder) or the user's list.

    ``num_stages`` counts every stage of the pipeline: pipeline_parallel_size x stages per rank.
    """
    pp = num_stages
    if custom_stage_ids is not None:
        ids = [int(s) for s in custom_stage_ids]
        if len(ids) != num_layers:
            raise UsageError(f"train.dist.custom_pipeline_stage_id has {len(ids)} entries for {num_layers} layers; "
                             f"give one stage id per layer")
        if ids != sorted(ids) or set(ids) != set(range(pp)):
            raise UsageError(f"train.dist.custom_pipeline_stage_id={ids} must be non-decreasing and use every "
                             f"stage 0..{pp - 1}")
        return ids
    if num_layers < pp:
        raise UsageError(f"the pipeline's {pp} stages (pipeline_parallel_size x stages per rank) are more stages "
                         f"than the model's {num_layers} layers; use at most {num_layers} pipeline stages")
    base, extra = divmod(num_layers, pp)
    return [s for s in range(pp) for _ in range(base + (s < extra))]


def zero_settings(zero_cfg) -> tuple[int, bool]:
    """(ZeRO stage, offload) from ``train.zero_optimization``; ``validate_zero_config`` checks the pair."""
    if not zero_cfg:
        return 0, False
    # Offload asked without ZeRO is kept, so the parallel code refuses it rather than ignore it.
    offload = bool(zero_cfg.get("offload", False))
    return (zero_cfg.get("stage", 1) if zero_cfg.get("enabled", False) else 0), offload
