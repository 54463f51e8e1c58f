"""torchrun worker for tests/engine/test_fp16_overflow.py: trains the tiny demo GPT in fp16 and records, per
rank and step, whether the loss scaler skipped it and whether this rank's weights, optimizer state and learning
rate changed.

Usage: ``torchrun --nproc_per_node N tests/workers/fp16_worker.py OUT_PREFIX OVERRIDE...``; writes
``OUT_PREFIX.rank<r>.json``. Built the way ``tools/train_net.py`` builds a run (``DefaultTrainer`` with its hooks).
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _snapshot(trainer) -> dict[str, torch.Tensor]:
    """Copies of this rank's own weights and optimizer-state tensors, by name."""
    from libai_lite.optim.container import optimizer_parts

    tensors = {f"param {n}": _local(p.detach()).clone() for n, p in trainer.model.named_parameters()}
    for i, o in enumerate(optimizer_parts(trainer.optimizer)):
        for j, state in enumerate(o.state.values()):
            tensors.update({f"optimizer {i} state {j} {k}": _local(v).detach().clone()
                            for k, v in state.items() if isinstance(v, torch.Tensor)})
    return tensors


def _changed(before: dict, after: dict) -> list[str]:
    """What a step changed; state a first step creates counts only where it is not zero (a skipped first step
    still makes AdamW's zero moments and step counter)."""
    return [k for k, v in after.items() if (not torch.equal(before[k], v) if k in before else bool(v.any()))]


def record_steps(trainer, record: dict) -> None:
    """Wrap ``trainer.run_step`` to record each step's skip and what it changed."""
    run_step = trainer.run_step

    def recorded():
        scaler = trainer.grad_scaler
        before = _snapshot(trainer)
        lr = trainer.optimizer.param_groups[0]["lr"]
        # A GradScaler allocates its scale at its first scale(); until then get_scale() is the initial one.
        scale = float(scaler.get_scale()) if scaler is not None else None
        run_step()
        after = _snapshot(trainer)
        changed = _changed(before, after)
        record.setdefault("steps", []).append({
            "iteration": trainer.iter,
            "skipped": scale is not None and float(scaler.get_scale()) < scale,
            "changed": bool(changed),
            "changed_names": changed[:5],
            "finite": all(bool(torch.isfinite(t.float()).all()) for t in after.values()),
            "lr": lr,
        })

    trainer.run_step = recorded


def main(out: str, *overrides: str) -> None:
    from libai_lite.config import LazyConfig
    from libai_lite.engine.default import DefaultTrainer
    from libai_lite.engine.launch import default_setup
    from libai_lite.utils.distributed import destroy

    cfg = LazyConfig.apply_overrides(LazyConfig.load("projects/GPT/configs/gpt2_pretrain.py"), list(overrides))
    layout = default_setup(cfg, SimpleNamespace())
    try:
        job = DefaultTrainer(cfg, layout)
        record: dict = {}
        record_steps(job.trainer, record)
        job.train()
        record["scheduler_position"] = job.trainer.scheduler.last_epoch
        with open(f"{out}.rank{layout.rank}.json", "w") as f:
            json.dump(record, f)
    finally:
        destroy()


if __name__ == "__main__":
    main(*sys.argv[1:])
