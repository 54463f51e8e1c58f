"""torchrun worker for tests/engine/test_host_reads.py: counts the host reads of each ``Trainer.run_step``.

Usage: ``torchrun --nproc_per_node N tests/workers/host_read_worker.py OUT_JSON OVERRIDE...``. Builds the
tiny demo GPT run the way ``tools/train_net.py`` does (``DefaultTrainer``, its hooks included), trains it,
and writes, per rank, each iteration's host reads as ``bench.host_reads.HostReadCounter``
counts them (``float(t)``/``.item()``/``bool(t)``, ``nonzero``, a boolean mask, ...) made inside
``run_step``, the optimizer's own step left out; and, for the hooks after the step (the log period), how
many such reads plus ``tolist`` calls. ``HostReadCounter`` is imported here for the tests that drive these
wrappers in their own process.
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from bench.host_reads import HostReadCounter

__all__ = ["HostReadCounter", "count_log_reads", "count_run_step"]


def count_run_step(trainer, counter: HostReadCounter, record: dict) -> None:
    """Wrap ``trainer.run_step`` (and its optimizer's step, left out) to record the reads of each iteration."""
    run_step, parts = trainer.run_step, getattr(trainer.optimizer, "optimizers", [trainer.optimizer])

    def paused(step):
        def wrapped(*a, **k):
            with counter.paused():
                return step(*a, **k)
        return wrapped

    for o in parts:
        o.step = paused(o.step)
    if parts[0] is not trainer.optimizer:
        trainer.optimizer.step = paused(trainer.optimizer.step)

    def counted():
        counter.reset()
        with counter:
            run_step()
        record.setdefault("steps", {})[trainer.iter] = counter.reads

    trainer.run_step = counted


def count_log_reads(trainer, counter: HostReadCounter, record: dict) -> None:
    """Count the reads (and ``tolist`` calls) the hooks make after each step (the writer's log line)."""
    call_hooks = trainer._call_hooks

    def counted(stage):
        if stage != "after_step":
            return call_hooks(stage)
        # tolist apart: over several ranks gloo's host tensors are listed, which reads no device.
        counter.reset()
        tolist, counter.tolist = counter.tolist, True
        try:
            with counter:
                call_hooks(stage)
        finally:
            counter.tolist = tolist
            reads = [r for r in counter.reads if not r.startswith("Tensor.tolist ")]
            record.setdefault("hooks", {})[trainer.iter] = {"reads": reads, "tolist": counter.counts["tolist"]}

    trainer._call_hooks = counted


def main(out: str, *overrides: str) -> None:
    from libai_lite.config import LazyConfig
    from libai_lite.engine.default import DefaultTrainer
    from libai_lite.engine.launch import default_setup
    from libai_lite.utils.distributed import destroy

    cfg = LazyConfig.apply_overrides(LazyConfig.load("projects/GPT/configs/gpt2_pretrain.py"), list(overrides))
    layout = default_setup(cfg, SimpleNamespace())
    try:
        job = DefaultTrainer(cfg, layout)
        counter, record = HostReadCounter(), {}
        count_run_step(job.trainer, counter, record)
        count_log_reads(job.trainer, counter, record)
        job.train()
        with open(f"{out}.rank{layout.rank}.json", "w") as f:
            json.dump(record, f)
    finally:
        destroy()


if __name__ == "__main__":
    main(*sys.argv[1:])
