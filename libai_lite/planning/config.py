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


def settings_from_config(cfg, world_size: int, device: str = "cuda") -> PlanSettings:
    """``PlanSettings`` from a loaded config (``train.dist``, ``train.zero_optimization``, batch sizes, ``train.amp``,
    ``train.activation_checkpoint``) for ``world_size`` processes; ``cfg.train`` gets its batch sizes resolved."""
    from ..config.resolve import amp_dtype, resolve_batch_sizes
    from ..parallel.activation_checkpoint import check_ac_mode
    from ..utils.distributed import resolve_layout, zero_settings

    if world_size < 1:
        raise UsageError(f"--nproc {world_size} must be at least 1")
    pp, dp, cp, tp = resolve_layout(world_size, cfg.train.dist)
    stage, offload = zero_settings(cfg.train.get("zero_optimization"))
    resolve_batch_sizes(cfg.train, dp)
    ac = cfg.train.get("activation_checkpoint") or {}
    dist_cfg = cfg.train.dist
    custom = dist_cfg.get("custom_pipeline_stage_id", None)
    return PlanSettings(
        world_size=world_size, pipeline_parallel_size=pp, data_parallel_size=dp, tensor_parallel_size=tp,
        sequence_parallel=bool(dist_cfg.get("sequence_parallel", False)), zero_stage=int(stage or 0),
        offload=bool(offload), activation_checkpoint_every=int(ac.get("every_n_layers", 1) or 1) if ac.get("enabled") else 0,
        activation_checkpoint_mode=check_ac_mode(ac.get("mode", "full")),
        micro_batch_size=int(cfg.train.train_micro_batch_size), num_microbatches=int(cfg.train.num_accumulation_steps),
        amp_dtype=amp_dtype(cfg.train.amp), pipeline_schedule=str(dist_cfg.get("pipeline_schedule", "1f1b") or "1f1b"),
        virtual_pipeline_size=int(dist_cfg.get("virtual_pipeline_size", 1) or 1),
        custom_pipeline_stage_id=tuple(custom) if custom is not None else None, context_parallel_size=cp,
        device=device)


def planner_from_config(cfg, world_size: int, device: str = "cuda") -> tuple[MemoryPlanner, PlanSettings]:
    """The planner and settings of a loaded, overridden config, as ``tools/train_net.py`` would run it on
    ``world_size`` processes: the tokenizer's padded vocabulary, one sample of the train data, ``cfg.optim``."""
    from omegaconf import open_dict

    from ..config import instantiate
    from ..tokenizer import pad_vocab_size

    settings = settings_from_config(cfg, world_size, device)
    tokenizer = None
    tok_cfg = cfg.get("tokenization")
    if tok_cfg is not None and tok_cfg.get("tokenizer") is not None:
        tokenizer = instantiate(tok_cfg.tokenizer)
        with open_dict(cfg):
            cfg.model.cfg.vocab_size = pad_vocab_size(tokenizer.vocab_size, tok_cfg.get("make_vocab_size_divisible_by", 128))
    sample = _sample_from_config(cfg, tokenizer, settings.micro_batch_size, settings.data_parallel_size)
    return _planner_for(cfg, sample), settings


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


def startup_estimate(cfg, layout, sample: Mapping[str, torch.Tensor]) -> str:
    """The line the trainer logs at start-up: this run's estimate per rank (``cfg`` resolved as the trainer
    resolved it, ``layout`` its ``Layout``, ``sample`` one training sample). Never raises: a run is not
    stopped by its estimate, the line then says why there is none."""
    try:
        from ..config.resolve import amp_dtype

        ac = cfg.train.get("activation_checkpoint") or {}
        settings = PlanSettings.from_layout(
            layout, activation_checkpoint_every=int(ac.get("every_n_layers", 1) or 1) if ac.get("enabled") else 0,
            activation_checkpoint_mode=str(ac.get("mode", "full")),
            micro_batch_size=int(cfg.train.train_micro_batch_size),
            num_microbatches=int(cfg.train.num_accumulation_steps), amp_dtype=amp_dtype(cfg.train.amp))
        return startup_line(_planner_for(cfg, sample).estimate(settings))
    except Exception as e:  # noqa: BLE001 - an estimate that fails must not stop training
        return f"Memory estimate not available ({type(e).__name__}: {e})"

