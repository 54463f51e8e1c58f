"""The planner from a loaded config, as ``tools/train_net.py`` would run it, and the trainer's start-up line."""
from __future__ import annotations

from typing import Mapping

import torch

from ..utils.errors import UsageError
from .estimate import MemoryPlanner
from .settings import PlanSettings, startup_line


def _sample_from_config(cfg, tokenizer, micro: int, dp: int) -> dict:
    """One training sample, as the trainer reads one (``dataset[0]`` of the train loader's dataset)."""
    import tempfile

    from ..config.instantiate import instantiate_with

    loader_cfg = cfg.dataloader.train
    with tempfile.TemporaryDirectory() as tmp:
        # Index caches go to a scratch directory: planning writes nothing beside the data.
        extra = {"cache_dir": tmp} if "cache_dir" in loader_cfg else {}
        if tokenizer is not None and "eod_token_id" in loader_cfg and loader_cfg.eod_token_id is None:
            extra["eod_token_id"] = tokenizer.eod_id  # as the trainer fills it for packed documents
        loaders = instantiate_with(
            loader_cfg, train_valid_test_num_samples=[micro * dp, 0, 0], micro_batch_size=micro,
            eval_micro_batch_size=micro, consumed_samples=0, data_parallel_rank=0, data_parallel_size=dp,
            vocab_size=tokenizer.vocab_size if tokenizer is not None else None, **extra)
        dataset = getattr(loaders[0] if isinstance(loaders, (tuple, list)) else loaders, "dataset", None)
        if dataset is None or len(dataset) == 0:
            raise UsageError("the train loader has no dataset to read a sample from; the memory planner needs one "
                             "training sample to measure activations (check dataloader.train)")
        sample = dataset[0]
    return {k: torch.as_tensor(v) for k, v in sample.items() if v is not None}


def plan_settings(spec, device: str = "cuda") -> PlanSettings:
    """``PlanSettings`` of a resolved run (``libai_lite.run_spec.RunSpec``) on a ``device`` kind."""
    return PlanSettings.from_dims(
        spec.dims, activation_checkpoint_every=spec.activation_checkpoint_every,
        activation_checkpoint_mode=spec.activation_checkpoint_mode, micro_batch_size=spec.batch.micro_batch_size,
        num_microbatches=spec.batch.num_accumulation_steps, amp_dtype=spec.amp_dtype, device=device)


def resolve_for_plan(cfg, world_size: int):
    """``cfg`` resolved as ``tools/train_net.py`` resolves it on ``world_size`` processes (``resolve_run``; no
    data read for counting) and its tokenizer."""
    from ..run_spec import resolve_run, tokenizer_from_config
    from ..utils.parallel_dims import ParallelDims

    if world_size < 1:
        raise UsageError(f"--nproc {world_size} must be at least 1")
    dims = ParallelDims.resolve(world_size, cfg.train.dist, cfg.train.get("zero_optimization"))
    tokenizer = tokenizer_from_config(cfg.get("tokenization"))
    return resolve_run(cfg, dims, tokenizer, data=False), tokenizer


def settings_from_config(cfg, world_size: int, device: str = "cuda") -> PlanSettings:
    """``PlanSettings`` of a loaded config for ``world_size`` processes (``train.dist``, ``train.zero_optimization``,
    batch sizes, ``train.amp``, ``train.activation_checkpoint``, resolved as the trainer resolves them)."""
    return plan_settings(resolve_for_plan(cfg, world_size)[0], device)


def planner_from_config(cfg, world_size: int, device: str = "cuda") -> tuple[MemoryPlanner, PlanSettings]:
    """The planner and settings of a loaded, overridden config, as ``tools/train_net.py`` would run it on
    ``world_size`` processes: the tokenizer's padded vocabulary, one sample of the train data, ``cfg.optim``."""
    spec, tokenizer = resolve_for_plan(cfg, world_size)
    settings = plan_settings(spec, device)
    sample = _sample_from_config(spec.cfg, tokenizer, settings.micro_batch_size, settings.data_parallel_size)
    return _planner_for(spec.cfg, sample), settings


def _planner_for(cfg, sample: Mapping[str, torch.Tensor]) -> MemoryPlanner:
    """A planner for ``cfg.model`` (its vocabulary already padded) trained by ``cfg.optim``."""
    from ..config import instantiate
    from ..config.instantiate import instantiate_with

    optim = cfg.get("optim")
    factory = (lambda params: instantiate_with(optim, params=params)) if optim is not None else None
    params_node = optim.get("params") if optim is not None else None
    groups = ((lambda model: instantiate_with(params_node, model=model))
              if params_node is not None and hasattr(params_node, "get") and params_node.get("_target_") else None)
    return MemoryPlanner(lambda: instantiate(cfg.model), sample, optimizer_factory=factory, param_groups=groups)


def startup_estimate(spec, device: str, sample: Mapping[str, torch.Tensor]) -> str:
    """The line the trainer logs at start-up: the estimate per rank of the run ``spec`` (its ``RunSpec``) on a
    ``device`` kind, from ``sample``, one training sample. Never raises: a run is not stopped by its estimate,
    the line then says why there is none."""
    try:
        return startup_line(_planner_for(spec.cfg, sample).estimate(plan_settings(spec, device)))
    except Exception as e:  # noqa: BLE001 - an estimate that fails must not stop training
        return f"Memory estimate not available ({type(e).__name__}: {e})"
