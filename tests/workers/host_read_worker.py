"""torchrun worker for tests/engine/test_host_reads.py: counts the host reads of each ``Trainer.run_step``.

Usage: ``torchrun --nproc_per_node N tests/workers/host_read_worker.py OUT_JSON OVERRIDE...``. Builds the
tiny demo GPT run the way ``tools/train_net.py`` does (``DefaultTrainer``, its hooks included), trains it,
and writes, per rank, each iteration's host reads: the ATen calls that copy a device value back to the
host (``aten._local_scalar_dense`` behind ``float(t)``/``.item()``/``bool(t)``, ``nonzero``,
``masked_select``, indexing with a boolean mask) made inside ``run_step``, the optimizer's own step left
out; and, for the hooks after the step (the log period), how many such reads plus ``tolist`` calls.
"""
from __future__ import annotations

import json
import sys
import traceback
from contextlib import contextmanager
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.equal.default}
_MASKED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


def _masked_fill(self, indices, value, accumulate=False) -> bool:
    # torch's index_put_ turns `t[mask] = scalar` into masked_fill_ (canDispatchToMaskedFill in
    # TensorAdvancedIndexing.cpp): one boolean mask on self's device, a one-element CPU value.
    masks = [i for i in indices if i is not None]
    return (not accumulate and value.numel() == 1 and value.device.type == "cpu" and len(masks) == 1
            and masks[0].dtype in (torch.bool, torch.uint8) and masks[0].device == self.device)


def _is_read(func, args) -> bool:
    if func in _READS:
        return True
    if func in _MASKED:
        # A boolean mask's selection has a data-dependent size: its count is read back.
        if not any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            return False
        return func is aten.index.Tensor or not _masked_fill(*args)
    return False


class HostReadCounter(TorchDispatchMode):
    """Records each host read (op name, the innermost project frame, the innermost frames) while counting is on."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and _is_read(func, args):
            # The innermost project frame, then the three innermost frames of all (often inside torch).
            stack = traceback.extract_stack()[:-1]
            ours = [f for f in stack if "libai_lite" in f.filename or "projects" in f.filename]
            where = [f"{f.filename.split('/')[-1]}:{f.lineno}" for f in (ours[-1:] + stack[-3:])]
            self.reads.append(f"{func} at {' < '.join(where)}")
        return func(*args, **(kwargs or {}))

    @contextmanager
    def paused_here(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def count_run_step(trainer, counter: HostReadCounter, record: dict) -> None:
    """Wrap ``trainer.run_step`` (and its optimizer's step, left out) to record the reads of each iteration."""
    run_step, parts = trainer.run_step, getattr(trainer.optimizer, "optimizers", [trainer.optimizer])

    def paused(step):
        def wrapped(*a, **k):
            with counter.paused_here():
                return step(*a, **k)
        return wrapped

    for o in parts:
        o.step = paused(o.step)
    if parts[0] is not trainer.optimizer:
        trainer.optimizer.step = paused(trainer.optimizer.step)

    def counted():
        counter.reads = []
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
        tolist, calls = torch.Tensor.tolist, []

        def counting_tolist(self, *a, **k):
            calls.append(1)
            return tolist(self, *a, **k)

        counter.reads = []
        torch.Tensor.tolist = counting_tolist
        try:
            with counter:
                call_hooks(stage)
        finally:
            torch.Tensor.tolist = tolist
            record.setdefault("hooks", {})[trainer.iter] = {"reads": counter.reads, "tolist": len(calls)}

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
