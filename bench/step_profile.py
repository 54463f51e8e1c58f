#!/usr/bin/env python
"""Host reads and ATen calls per training step of our model, the optimizer's own step counted apart.

    python bench/step_profile.py --model gpt --size demo
    python bench/step_profile.py --model mt5 --size demo
    python bench/step_profile.py --model mt5 --size base --micro-batch 1   # the recipe's shape, in seconds

``--smoke``: one warm-up and one profiled step. The last line is one JSON object.
What is counted and why through the profiler: bench/README.md, section "step_profile.py: how it measures".
"""
from __future__ import annotations

import argparse
import collections
import json

import torch

from host_reads import PROFILER_READS
from throughput_models import FAMILIES
from train_throughput import OursStepper, make_batches


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def count_steps(stepper, steps: int) -> dict:
    """Profile ``steps`` calls of ``stepper.step()``; the per-step counts described in the module docstring."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            stepper.step()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in aten if not any(p.name.startswith("aten::") for p in _ancestors(e))]
    reads, in_optimizer = collections.Counter(), collections.Counter()
    for e in aten:
        if e.name in PROFILER_READS:
            inside = any(p.name.startswith("Optimizer.step") for p in _ancestors(e))
            (in_optimizer if inside else reads)[e.name] += 1
    return {"host_reads": sum(reads.values()) / steps, "host_reads_by_op": {k: v / steps for k, v in reads.items()},
            "optimizer_host_reads": sum(in_optimizer.values()) / steps, "aten_calls": len(aten) / steps,
            "top_level_aten_calls": len(top) / steps,
            "top_level_most_common": collections.Counter(e.name for e in top).most_common(12)}


def main(argv=None) -> dict:
    """Parse the options, build and step the model, print and return the counts."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(FAMILIES), default="gpt")
    p.add_argument("--size", default="demo")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the profiled ones")
    p.add_argument("--steps", type=int, default=3, help="profiled steps (the counts are per step)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--micro-batch", type=int, default=None,
                   help="samples per step instead of the size's (the counts do not depend on it)")
    p.add_argument("--smoke", action="store_true", help="one warm-up and one profiled step (the test suite's run)")
    args = p.parse_args(argv)
    if args.smoke:
        args.warmup, args.steps = 1, 1
    family = FAMILIES[args.model]
    if args.size not in family.sizes:
        p.error(f"--size {args.size} is not a {args.model} size; {args.model} has {', '.join(family.sizes)}")
    args.family, args.shape = family, dict(family.sizes[args.size])
    if args.micro_batch is not None and args.micro_batch < 1:
        p.error(f"--micro-batch must be at least 1, got {args.micro_batch}")
    args.micro_batch = args.micro_batch or args.shape["micro_batch"]
    device = torch.device("cpu")
    torch.manual_seed(args.seed)
    model = family.build_ours(args.shape, device)
    stepper = OursStepper(model, make_batches(args, device), device, None)
    for _ in range(args.warmup):
        stepper.step()
    result = {"benchmark": "step_profile", "model": args.model, "size": args.size, "micro_batch": args.micro_batch,
              **count_steps(stepper, args.steps),
              "torch": torch.__version__}
    print(f"{family.label} {args.size}, per training step: {result['host_reads']:g} host reads "
          f"{result['host_reads_by_op']} (+{result['optimizer_host_reads']:g} inside the optimizer's CPU kernel), "
          f"{result['aten_calls']:g} ATen calls, {result['top_level_aten_calls']:g} top-level")
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
