"""Data parallelism and ZeRO: DDP, ZeroRedundancyOptimizer (ZeRO-1), FSDP2 (ZeRO-2/3, CPU offload, mixed precision).

torchtitan style: `apply_data_parallel` picks one small function per mode, each using the
torch.distributed feature that implements it:

| zero_stage | parameters | gradients | optimizer state | torch piece |
| --- | --- | --- | --- | --- |
| 0 | replicated | all-reduced | replicated | `DistributedDataParallel` (FSDP2 `replicate` when params are DTensors) |
| 1 | replicated | all-reduced | sharded | DDP + `ZeroRedundancyOptimizer` (`build_zero1_optimizer`) |
| 2 | sharded, gathered for fwd+bwd | reduce-scattered | sharded | `fully_shard(reshard_after_forward=False)` |
| 3 | sharded, gathered per layer | reduce-scattered | sharded | `fully_shard(reshard_after_forward=True)` |

`offload=True` (stage 2/3) adds `CPUOffloadPolicy`, `param_dtype` adds `MixedPrecisionPolicy`.

What the trainer has to do differently (see `no_sync_context`; clipping is `clip_grad.clip_grad_norm_`):
  - build the optimizer *after* `apply_data_parallel` (FSDP2 replaces the parameters by sharded
    DTensors); for stage 1 build it with `build_zero1_optimizer`;
  - accumulate gradients inside `no_sync_context(model, micro == acc - 1)`, which is
    `model.no_sync()` for DDP and `model.set_requires_gradient_sync(is_last)` for FSDP2;
"""
from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..utils.errors import UsageError
from .activation_checkpoint import transformer_layers

logger = logging.getLogger("libai_lite")

ZERO_STAGES = (0, 1, 2, 3)


def validate_zero_config(zero_stage: int | None, offload: bool = False, param_dtype: torch.dtype | None = None) -> int:
    """The ZeRO stage as an int (None means 0); UsageError for a stage or combination that does not exist."""
    stage = 0 if zero_stage is None else zero_stage
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in ZERO_STAGES:
        raise UsageError(f"ZeRO stage {zero_stage!r} does not exist; use 0 (off), 1, 2 or 3")
    if offload and stage < 2:
        raise UsageError(
            f"CPU offload needs parameters and gradients sharded by FSDP, which ZeRO stage {stage} does not do; "
            f"use ZeRO stage 2 or 3 with offload"
        )
    if param_dtype is not None and stage < 2:
        raise UsageError(
            f"param_dtype={param_dtype} (mixed-precision parameters) is an FSDP setting and ZeRO stage {stage} "
            f"does not use FSDP; use ZeRO stage 2 or 3, or autocast (train.amp) with DDP"
        )
    return stage


def has_dtensor_params(model: nn.Module) -> bool:
    """Whether any parameter is a DTensor (the model is already tensor-parallel)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> DistributedDataParallel:
    """`DistributedDataParallel` over the dp group: full replicas, gradients all-reduced in buckets."""
    device_ids = None
    first = next(model.parameters(), None)
    if first is not None and first.device.type == "cuda":
        device_ids = [first.device.index]
    # Gradients as views into the all-reduce buckets: one gradient-sized buffer per rank, not two.
    return DistributedDataParallel(
        model, device_ids=device_ids, process_group=dp_mesh.get_group(), gradient_as_bucket_view=True
    )


def apply_replicate(model: nn.Module, dp_mesh: DeviceMesh, expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """DDP semantics for a model whose parameters are DTensors on the tp mesh.

    `DistributedDataParallel` only takes plain tensors, so this uses FSDP2's `replicate`
    (`torch.distributed._composable.replicate_with_fsdp`): it composes the dp mesh with the
    parameters' tp mesh into ("dp", "tp") DTensors with `Replicate()` on dp and all-reduces
    gradients over dp, layer by layer. It also answers `set_requires_gradient_sync` like FSDP2.
    With `expert_mesh` (the expert-data-parallel mesh of expert parallelism) MoE experts are
    replicated over it instead (`expert_parallel.replicate_experts`).
    """
    from torch.distributed._composable.replicate_with_fsdp import replicate

    if expert_mesh is not None:
        from .expert_parallel import replicate_experts

        replicate_experts(model, expert_mesh, dp_mesh.size())
    for layer in transformer_layers(model):
        replicate(layer, mesh=dp_mesh)
    replicate(model, mesh=dp_mesh)
    return model


def fsdp_policies(
    offload: bool, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> tuple[MixedPrecisionPolicy, OffloadPolicy]:
    """The FSDP2 mixed-precision and offload policies for these settings."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype if param_dtype else None)
    # Pinned host memory needs an accelerator; on a CPU-only build pinning raises.
    offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    return mp_policy, offload_policy


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """FSDP2 `fully_shard` on each transformer layer, then on the root (embeddings, tied head, norms).

    One group per layer is what bounds ZeRO-3's unsharded parameters to about one layer at a time.
    The last layer is never resharded after forward: backward needs it straight away. With
    `expert_mesh` each MoE layer's experts are first sharded over that expert-data-parallel mesh.
    """
    layers = transformer_layers(model)
    if expert_mesh is not None:
        from .expert_parallel import shard_experts

        shard_experts(model, expert_mesh, dp_mesh.size(), reshard_after_forward, mp_policy, offload_policy)
    for i, layer in enumerate(layers):
        fully_shard(
            layer,
            mesh=dp_mesh,
            reshard_after_forward=reshard_after_forward and i < len(layers) - 1,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        )
    fully_shard(
        model,
        mesh=dp_mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
    )
    return model


def apply_data_parallel(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    zero_stage: int | None,
    offload: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    tp_enabled: bool = False,
    pipeline: bool = False,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Make `model` data parallel over `dp_mesh` at the given ZeRO stage; returns the module to train.

    Stage 0/1 return a `DistributedDataParallel` wrapper (or, with DTensor parameters, the model
    under FSDP2 `replicate`), or the model itself when dp is 1; stage 1 also needs
    `build_zero1_optimizer`. Stage 2/3 shard in place with FSDP2 (even at dp=1, so offload and
    mixed precision still apply) and return the same module object. Apply tensor parallelism and
    activation checkpointing first. `expert_mesh`: the expert-data-parallel mesh when MoE experts
    are spread over ranks (`expert_parallel.apply_expert_parallel`); experts are then reduced over
    it rather than over `dp_mesh` (stage 0 uses FSDP2 `replicate`, stage 1 is refused).
    """
    stage = validate_zero_config(zero_stage, offload, param_dtype)
    dp_size = dp_mesh.size()
    dtensor_params = tp_enabled or has_dtensor_params(model)
    if stage == 1 and pipeline:
        raise UsageError(
            "ZeRO stage 1 (DDP + ZeroRedundancyOptimizer) cannot run under pipeline parallelism; "
            "use ZeRO stage 2, which also shards optimizer state"
        )
    if stage == 1 and dtensor_params:
        raise UsageError(
            "ZeRO stage 1 (ZeroRedundancyOptimizer) cannot hold tensor-parallel DTensor parameters; "
            "use ZeRO stage 2, which also shards optimizer state, with tensor parallelism"
        )
    if expert_mesh is not None and stage == 1:
        raise UsageError(
            "ZeRO stage 1 (ZeroRedundancyOptimizer) would overwrite each rank's experts with another's; "
            "use ZeRO stage 2 (it also shards gradients) or 0 with expert parallelism"
        )
    if stage in (0, 1):
        if expert_mesh is not None:
            return apply_replicate(model, dp_mesh, expert_mesh)
        if dp_size == 1:
            return model
        # DDP's reducer cannot follow a pipeline schedule's interleaved micro-batch forwards and
        # backwards; FSDP2's replicate (gradient sync per layer) can.
        if dtensor_params or pipeline:
            return apply_replicate(model, dp_mesh)
        return apply_ddp(model, dp_mesh)
    mp_policy, offload_policy = fsdp_policies(offload, param_dtype, reduce_dtype)
    return apply_fsdp(model, dp_mesh, stage == 3, mp_policy, offload_policy, expert_mesh)


class ShardedStateZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
    """ZeRO-1 whose state_dict is this rank's shard under global parameter indices, for DCP.

    Upstream `ZeroRedundancyOptimizer.state_dict()` only works after gathering every rank's state
    to one rank, and its `.state` stays empty, which makes DCP's `get_state_dict` run a fake
    zero-gradient step (advancing Adam's moments and step count) on every save. Here `.state` is
    the local optimizer's state, and `state_dict()` returns the owned parameters' states plus an
    empty entry for every other parameter, so `get_state_dict`/`set_state_dict` with strict
    checks work and DCP writes each state once, from its owner, loadable under any layout.
    """

    @property
    def state(self):
        optim = self.__dict__.get("optim")
        return optim.state if optim is not None else self.__dict__["_wrapper_state"]

    @state.setter
    def state(self, value) -> None:
        # Optimizer.__init__ assigns the (empty) wrapper state before the local optimizer exists.
        self.__dict__["_wrapper_state"] = value

    def state_dict(self) -> dict:
        """This rank's optimizer states keyed by global index; `{}` for parameters other ranks own."""
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        sd = Optimizer.state_dict(self)
        for index in range(len(self._all_params)):
            sd["state"].setdefault(index, {})
        sd["state"] = dict(sorted(sd["state"].items()))
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load the owned parameters' states; entries for other ranks' parameters are ignored.

        Keys may be global indices or, as DCP's `set_state_dict` passes them, parameter names;
        like `Optimizer.load_state_dict`, they are matched to parameters by their position in
        the saved param groups.
        """
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the optimizer state_dict's param groups do not match this optimizer's")
        key_to_param = {
            key: param
            for saved, ours in zip(saved_groups, self.param_groups)
            for key, param in zip(saved["params"], ours["params"])
        }
        owned = {}
        for key, value in state_dict["state"].items():
            param = key_to_param.get(key)
            if value and param is not None and self._param_to_rank[param] == self.rank:
                owned[self._param_to_index[param]] = value
        groups = [
            {**saved, "params": [self._param_to_index[p] for p in ours["params"]]}
            for saved, ours in zip(saved_groups, self.param_groups)
        ]
        super().load_state_dict({"state": owned, "param_groups": groups})


def build_zero1_optimizer(optimizer_cls: type[Optimizer], param_groups, dp_group, **kwargs) -> ZeroRedundancyOptimizer:
    """ZeRO-1: `optimizer_cls` (e.g. AdamW) whose state is sharded over `dp_group`.

    `param_groups` may be a list of dicts (weight-decay groups survive: each rank's local
    optimizer gets its share of every group with the group's settings). `kwargs` are the
    optimizer's defaults (lr, betas, ...). An existing optimizer converts with
    `build_zero1_optimizer(type(opt), opt.param_groups, group, **opt.defaults)`.
    """
    return ShardedStateZeroRedundancyOptimizer(
        list(param_groups), optimizer_class=optimizer_cls, process_group=dp_group, **kwargs
    )


@contextmanager
def _fsdp_gradient_sync(model: FSDPModule, sync: bool):
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        # Back to the default so anything run outside accumulation (eval, a lone step) syncs.
        model.set_requires_gradient_sync(True)


def no_sync_context(model: nn.Module, is_last_microbatch: bool):
    """Context for one micro-batch's forward+backward: reduce gradients only on the last one.

    DDP: `model.no_sync()` on all but the last. FSDP2 (`fully_shard`, `replicate`):
    `set_requires_gradient_sync(is_last_microbatch)`; skipped micro-batches accumulate
    unsharded gradients locally (under ZeRO-2/3 that costs a full gradient copy until the last
    micro-batch reduce-scatters it). Anything else: a no-op.
    """
    if isinstance(model, DistributedDataParallel):
        return nullcontext() if is_last_microbatch else model.no_sync()
    if isinstance(model, FSDPModule):
        return _fsdp_gradient_sync(model, is_last_microbatch)
    return nullcontext()
