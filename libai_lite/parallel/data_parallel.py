"""Data parallelism and ZeRO: DDP, ZeroRedundancyOptimizer (ZeRO-1, optimizer offload), FSDP2 (ZeRO-2/3, CPU
offload, mixed precision).

torchtitan style: ``apply_data_parallel`` picks one small function per mode:

| zero_stage | parameters | gradients | optimizer state | torch piece |
| --- | --- | --- | --- | --- |
| 0 | replicated | all-reduced | replicated | `DistributedDataParallel` (FSDP2 `replicate` for DTensors) |
| 1 | replicated | all-reduced | sharded | DDP + `ZeroRedundancyOptimizer` (`build_zero1_optimizer`) |
| 2 | sharded, gathered for fwd+bwd | reduce-scattered | sharded | `fully_shard(reshard_after_forward=False)` |
| 3 | sharded, gathered per layer | reduce-scattered | sharded | `fully_shard(reshard_after_forward=True)` |

``offload=True`` at stage 2/3 adds ``CPUOffloadPolicy`` (parameters, gradients and optimizer state on the host);
at stage 1 it keeps the optimizer state and step on the host (``OffloadedZeroRedundancyOptimizer``, DeepSpeed's
ZeRO-1 + ``offload_optimizer``) while parameters and gradients stay on the device. ``param_dtype`` adds a
``MixedPrecisionPolicy``.
Build the optimizer after ``apply_data_parallel`` (FSDP2 replaces the parameters by sharded DTensors)
and accumulate gradients inside ``no_sync_context``.
"""
from __future__ import annotations

import inspect
import logging
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..layers.moe import Experts
from ..utils.errors import UsageError
from ..converters.activation_checkpoint import transformer_layers

logger = logging.getLogger("libai_lite")


def validate_zero_config(zero_stage: int | None, offload: bool = False, param_dtype: torch.dtype | None = None) -> int:
    """The ZeRO stage as an int (None means 0); UsageError for a stage or combination that does not exist."""
    stage = 0 if zero_stage is None else zero_stage
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise UsageError(f"ZeRO stage {zero_stage!r} does not exist; use 0 (off), 1, 2 or 3")
    if offload and stage == 0:
        raise UsageError("CPU offload moves a ZeRO optimizer's state to the host and ZeRO is off (stage 0); use "
                         "ZeRO stage 1 (optimizer state and step on the host) or 2/3 (parameters and gradients too)")
    if param_dtype is not None and stage < 2:
        raise UsageError(f"param_dtype={param_dtype} (mixed-precision parameters) is an FSDP setting and ZeRO stage "
                         f"{stage} does not use FSDP; use ZeRO stage 2 or 3, or autocast (train.amp) with DDP")
    return stage


def check_zero1(tensor_parallel: bool = False, expert_parallel: bool = False) -> None:
    """Refuse ZeRO stage 1 (DDP + ``ZeroRedundancyOptimizer``, over more than one data-parallel rank) with
    what it cannot hold."""
    why = ("with tensor-parallel DTensor parameters" if tensor_parallel
           else "with expert parallelism: it would overwrite each rank's experts with another's" if expert_parallel
           else None)
    if why:
        raise UsageError(f"ZeRO stage 1 (DDP + ZeroRedundancyOptimizer) cannot run {why}; use "
                         f"train.zero_optimization.stage=2, which also shards gradients and optimizer state")


def wrap_experts(model: nn.Module, edp_mesh: DeviceMesh, dp_size: int, mp_policy=None, offload_policy=None,
                 reshard_after_forward: bool | None = None) -> None:
    """Wrap each MoE layer's experts to reduce over ``edp_mesh`` and average over all dp ranks, with FSDP2
    ``replicate`` when ``reshard_after_forward`` is None, else ``fully_shard``."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for experts in (m for m in model.modules() if isinstance(m, Experts)):
        if reshard_after_forward is None:
            replicate(experts, mesh=edp_mesh, mp_policy=mp_policy or MixedPrecisionPolicy())
        else:
            fully_shard(experts, mesh=edp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                        offload_policy=offload_policy)
        # replicate divides by the factor before its all-reduce (a SUM): gloo-safe as it is.
        experts.set_gradient_divide_factor(float(dp_size))
        if reshard_after_forward is not None and edp_mesh.size() > 1:
            # Any other factor than the group size makes FSDP use NCCL's PREMUL_SUM, which gloo lacks.
            # On a one-rank mesh FSDP divides by itself, so forcing SUM there would divide twice.
            experts.set_force_sum_reduction_for_comms(True)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> DistributedDataParallel:
    """``DistributedDataParallel`` over the dp group: full replicas, gradients all-reduced in buckets."""
    first = next(model.parameters(), None)
    device_ids = [first.device.index] if first is not None and first.device.type == "cuda" else None
    # Gradients as views into the all-reduce buckets: one gradient-sized buffer per rank, not two.
    return DistributedDataParallel(model, device_ids=device_ids, process_group=dp_mesh.get_group(),
                                   gradient_as_bucket_view=True)


def apply_replicate(model: nn.Module, dp_mesh: DeviceMesh, expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """DDP semantics, layer by layer, with FSDP2's ``replicate``: for DTensor (tensor-parallel) parameters,
    which DDP refuses, and for pipeline schedules, whose interleaved micro-batches DDP's reducer cannot
    follow. With ``expert_mesh`` MoE experts are replicated over it instead (``wrap_experts``)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    if expert_mesh is not None:
        wrap_experts(model, expert_mesh, dp_mesh.size())
    for layer in transformer_layers(model):
        replicate(layer, mesh=dp_mesh)
    replicate(model, mesh=dp_mesh)
    return model


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool, mp_policy: MixedPrecisionPolicy,
               offload_policy: OffloadPolicy, expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """FSDP2 ``fully_shard`` on each transformer layer, then on the root (embeddings, tied head, norms).

    A 2-D ``dp_mesh`` ("dp_replicate", "dp_shard") is HSDP, FSDP2's own: parameters sharded over the second
    dimension, gradients reduce-scattered there and all-reduced over the first.
    One group per layer bounds ZeRO-3's unsharded parameters to about one layer at a time. The last
    layer is never resharded after forward: backward needs it straight away. With ``expert_mesh``
    each MoE layer's experts are first sharded over that expert-data-parallel mesh.
    """
    layers = transformer_layers(model)
    if dp_mesh.ndim == 2:
        replicate, shard = dp_mesh.size(0), dp_mesh.size(1)
        logger.info(f"HSDP: FSDP2 shards each parameter over {shard} rank(s) and all-reduces its gradient over "
                    f"{replicate} replica(s) (mesh {dp_mesh.mesh_dim_names})")
    options = dict(mesh=dp_mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    if expert_mesh is not None:
        wrap_experts(model, expert_mesh, dp_mesh.size(), mp_policy, offload_policy, reshard_after_forward)
    for i, layer in enumerate(layers):
        fully_shard(layer, reshard_after_forward=reshard_after_forward and i < len(layers) - 1, **options)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **options)
    return model


def apply_data_parallel(model: nn.Module, dp_mesh: DeviceMesh, zero_stage: int | None, offload: bool = False,
                        param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = torch.float32,
                        tp_enabled: bool = False, pipeline: bool = False,
                        expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """Make ``model`` data parallel over ``dp_mesh`` at the given ZeRO stage; returns the module to train.

    Stage 0/1 wrap it in DDP, or in FSDP2 ``replicate`` for DTensor parameters, pipeline stages and
    experts; stage 1 also needs ``build_zero1_optimizer`` (with ``offload``, also at dp=1). Stage 2/3 shard in
    place with FSDP2, as HSDP over a 2-D ``dp_mesh``. At dp=1 the model runs plain, except with experts at stage
    0/1 or with ``offload`` at 2/3. Apply tensor parallelism and activation checkpointing first. Experts are reduced over ``expert_mesh`` instead of ``dp_mesh`` when given.
    """
    stage = validate_zero_config(zero_stage, offload, param_dtype)
    dp_size = dp_mesh.size()
    if stage < 2 and dp_size > 1 and dp_mesh.ndim > 1:
        raise UsageError(f"HSDP (a {dp_mesh.mesh_dim_names} data-parallel mesh) shards with FSDP and ZeRO stage "
                         f"{stage} does not use it; set train.zero_optimization.stage=3 (or 2)")
    dtensor_params = tp_enabled or any(isinstance(p, DTensor) for p in model.parameters())
    if stage == 1 and (dp_size > 1 or offload):
        check_zero1(dtensor_params, expert_mesh is not None)
    if stage in (0, 1):
        if expert_mesh is not None:
            return apply_replicate(model, dp_mesh, expert_mesh)
        if dp_size == 1:
            return model
        return apply_replicate(model, dp_mesh) if dtensor_params or pipeline else apply_ddp(model, dp_mesh)
    if dp_size == 1 and not offload:
        # FSDP over one rank only adds work; the plain model's checkpoints stay interchangeable with FSDP's.
        logger.info(f"ZeRO stage {stage} at data-parallel size 1 without offload: nothing to shard, training the "
                    f"plain model (no FSDP)")
        return model
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype if param_dtype else None)
    # Pinned host memory needs an accelerator; on a CPU-only build pinning raises.
    offload_policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    return apply_fsdp(model, dp_mesh, stage == 3, mp_policy, offload_policy, expert_mesh)


class ShardedStateZeroRedundancyOptimizer(ZeroRedundancyOptimizer):
    """ZeRO-1 whose state_dict is this rank's shard under global parameter indices, for DCP.

    Upstream's empty ``.state`` makes DCP's ``get_state_dict`` run a fake step that advances Adam's
    moments on every save. Here ``.state`` is the local optimizer's, and ``state_dict()`` holds the owned
    states plus empty entries, so DCP writes each state once from its owner.
    """

    def _broadcast_params_from_rank(self, rank: int):
        """Upstream's per-parameter broadcast of ``rank``'s updated shard, on the local tensor of a
        replicated DTensor (a pipeline stage under FSDP2 ``replicate``), which ``broadcast`` cannot take."""
        if self.parameters_as_bucket_view:
            return super()._broadcast_params_from_rank(rank)
        src = dist.get_global_rank(self.process_group, rank)
        return [dist.broadcast(_local_tensor(p.data), src=src, group=self.process_group, async_op=True)
                for group in self._partition_parameters()[rank] for p in group["params"]]

    @property
    def state(self):
        optim = self.__dict__.get("optim")
        return optim.state if optim is not None else self.__dict__["_wrapper_state"]

    @state.setter
    def state(self, value) -> None:
        # Optimizer.__init__ assigns the (empty) wrapper state before the local optimizer exists.
        self.__dict__["_wrapper_state"] = value

    def state_dict(self) -> dict:
        """This rank's optimizer states keyed by global index; ``{}`` for parameters other ranks own."""
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        sd = Optimizer.state_dict(self)
        for index in range(len(self._all_params)):
            sd["state"].setdefault(index, {})
        sd["state"] = dict(sorted(sd["state"].items()))
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load the owned parameters' states. Keys may be global indices or, as DCP's ``set_state_dict``
        passes them, parameter names: matched to parameters by position in the saved param groups."""
        super().load_state_dict(self._owned_state_dict(state_dict))

    def _owned_state_dict(self, state_dict: dict) -> dict:
        """``state_dict`` as upstream loads it: the states this rank owns by global index, groups by index."""
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the optimizer state_dict's param groups do not match this optimizer's")
        key_to_param = {key: param for saved, ours in zip(saved_groups, self.param_groups)
                        for key, param in zip(saved["params"], ours["params"])}
        owned = {}
        for key, value in state_dict["state"].items():
            param = key_to_param.get(key)
            if value and param is not None and self._param_to_rank[param] == self.rank:
                owned[self._param_to_index[param]] = value
        groups = [{**saved, "params": [self._param_to_index[p] for p in ours["params"]]}
                  for saved, ours in zip(saved_groups, self.param_groups)]
        return {"state": owned, "param_groups": groups}


class OffloadedZeroRedundancyOptimizer(ShardedStateZeroRedundancyOptimizer):
    """ZeRO-1 whose optimizer state and step live in host memory (DeepSpeed's ZeRO-1 + ``offload_optimizer``).

    The local optimizer steps host copies of this rank's shard of the parameters. Each step copies the shard's
    parameters and its reduced (unscaled, clipped) gradients to the host, steps there, copies the updated
    shard back and broadcasts it as ZeRO-1 does. The device parameters stay the truth: a checkpoint load or
    anything else that writes them is what the next step starts from. Without an accelerator the host copies
    are copies within the same memory, so the same code runs and gives the same numbers.
    """

    def _init_local_optimizer(self) -> None:
        # Pinned host memory needs an accelerator; on a CPU-only build pinning raises.
        self._pin = self._default_device.type != "cpu" and torch.cuda.is_available()
        self._host: dict[torch.Tensor, torch.Tensor] = {}  # device parameter -> its host copy
        self._host_grads: dict[torch.Tensor, torch.Tensor] = {}  # host copy -> its reused gradient buffer
        groups = []
        for group in self._partition_parameters()[self.rank]:
            for p in group["params"]:
                self._host[p] = self._host_buffer(p)
            hosts = [self._host[p] for p in group["params"]]
            groups.append({**group, "params": hosts})
        self.optim = self._optim_constructor(groups, **self._optim_defaults)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)

    def _host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        local = _local_tensor(like.detach())
        return torch.empty(local.shape, dtype=local.dtype, pin_memory=self._pin).copy_(local)

    @property
    def state(self):
        optim = self.__dict__.get("optim")
        if optim is None:
            return self.__dict__["_wrapper_state"]
        # Keyed by the device parameters, as Optimizer.state_dict and DCP look states up; like upstream's
        # defaultdict, a parameter another rank owns reads as no state.
        return defaultdict(dict, {p: optim.state[h] for p, h in self._host.items() if h in optim.state})

    @state.setter
    def state(self, value) -> None:
        self.__dict__["_wrapper_state"] = value

    def _to_host(self) -> None:
        """This shard's parameters and gradients into their host copies (a parameter without one is skipped)."""
        with torch.no_grad():
            for p, h in self._host.items():
                h.copy_(_local_tensor(p.detach()), non_blocking=True)
                if p.grad is None:
                    h.grad = None
                    continue
                buf = self._host_grads.get(h)
                if buf is None:
                    buf = self._host_grads[h] = torch.empty(h.shape, dtype=h.dtype, pin_memory=self._pin)
                h.grad = buf.copy_(_local_tensor(p.grad), non_blocking=True)
        if self._default_device.type == "cuda":
            # The non-blocking copies must have landed before the CPU reads them.
            torch.cuda.current_stream(self._default_device).synchronize()

    def _to_device(self) -> None:
        with torch.no_grad():
            for p, h in self._host.items():
                _local_tensor(p.data).copy_(h, non_blocking=True)

    def step(self, closure=None, **kwargs):
        """Copy the shard to the host, step it there, copy it back, then broadcast every shard (ZeRO-1)."""
        if closure is not None:
            raise ValueError("ZeRO-1 with optimizer offload steps on gradients already computed; it takes no closure")
        self._to_host()
        loss = self._local_step(**kwargs)
        self._to_device()
        if self.world_size > 1:
            self._sync_params()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """Load the owned parameters' states into host memory (DCP's keys as in the parent)."""
        owned = self._owned_state_dict(state_dict)
        for index, value in owned["state"].items():
            host = self._host[self._index_to_param[index]]
            self.optim.state[host] = {k: _host_state(k, v, host) for k, v in value.items()}
        self._sync_param_groups(owned["param_groups"], self.param_groups)
        self._sync_param_groups(self.param_groups, self.optim.param_groups)


def _host_state(key: str, value, host: torch.Tensor):
    if not torch.is_tensor(value):
        return value
    value = _local_tensor(value.detach())
    if key == "step":  # fused CPU AdamW wants a float32 step beside its parameters
        return value.to("cpu", torch.float32)
    return value.to("cpu", host.dtype if value.is_floating_point() else value.dtype)


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        if not all(p.is_replicate() for p in t.placements):
            raise UsageError(f"ZeRO stage 1 cannot broadcast a parameter sharded as {t.placements}; "
                             f"use train.zero_optimization.stage=2")
        return t.to_local()
    return t


def build_zero1_optimizer(optimizer_cls: type[Optimizer], param_groups, dp_group, offload: bool = False,
                          **kwargs) -> ZeroRedundancyOptimizer:
    """ZeRO-1: ``optimizer_cls`` (e.g. AdamW) whose state is sharded over ``dp_group``, kept and stepped in host
    memory with ``offload``; weight-decay groups survive, ``kwargs`` are the optimizer's defaults (lr, betas, ...)."""
    cls = OffloadedZeroRedundancyOptimizer if offload else ShardedStateZeroRedundancyOptimizer
    return cls(list(param_groups), optimizer_class=optimizer_cls, process_group=dp_group, **kwargs)


def zero1_from(optimizer: Optimizer, dp_group, offload: bool = False) -> ZeroRedundancyOptimizer:
    """``build_zero1_optimizer`` of a built optimizer: its class, parameter groups and defaults."""
    # `defaults` can hold entries the constructor does not take (AdamW's decoupled_weight_decay).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return build_zero1_optimizer(type(optimizer), optimizer.param_groups, dp_group, offload=offload, **kwargs)


@contextmanager
def _fsdp_gradient_sync(model: FSDPModule, sync: bool):
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        # Back to the default so anything run outside accumulation (eval, a lone step) syncs.
        model.set_requires_gradient_sync(True)


def no_sync_context(model: nn.Module, is_last_microbatch: bool):
    """Context for one micro-batch's forward+backward that reduces gradients only on the last one: DDP's
    ``no_sync()``, FSDP2's ``set_requires_gradient_sync`` (``fully_shard``, ``replicate``), else a no-op."""
    if isinstance(model, DistributedDataParallel):
        return nullcontext() if is_last_microbatch else model.no_sync()
    if isinstance(model, FSDPModule):
        return _fsdp_gradient_sync(model, is_last_microbatch)
    return nullcontext()
