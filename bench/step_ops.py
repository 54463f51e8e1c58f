#!/usr/bin/env python
"""ATen calls and host reads in one training step of our model (torch.profiler, CPU).

The model is a ``bench/throughput_models.py`` family at a shape (``--model mt5 --size demo``), stepped by
``Trainer.run_step`` as ``bench/train_throughput.py`` steps it. After ``--warmup`` untimed steps one step
is profiled and its ATen calls counted three ways:

* ``aten_calls``: every ``aten::`` event (an op and the ops it dispatches to inside);
* ``top_level_aten_calls``: those with no ``aten::`` caller, what a GPU would see as launches (roughly:
  a composite op is one line here however many kernels it runs);
* ``host_reads``: calls that read a device value back on the host (``aten::_local_scalar_dense``, behind
  ``.item()``, ``float()``, ``.tolist()`` and ``bool()`` of a tensor; ``aten::nonzero``, whose output size
  comes from the data; ``aten::equal``) outside the optimizer's step, each a synchronisation on a GPU;
* ``optimizer_host_reads``: the same inside ``Optimizer.step``: torch's CPU fused AdamW reads each
  parameter's step counter in its kernel (one ``aten::item`` per parameter), its CUDA kernel reads
  them on the device, so these are no GPU stall (``bench/step_profile.py`` splits them the same way).

    python bench/step_ops.py --model mt5 --size demo

The last line is one JSON object with the counts and the most frequent top-level calls.
"""
from __future__ import annotations

import argparse
import collections
import json

import torch

from throughput_models import FAMILIES
from train_throughput import OursStepper, make_batches

HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::equal")


def count_step(stepper) -> dict:
    """Profile one ``stepper.step()``; the counts described in the module docstring."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        stepper.step()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]

    def ancestors(event):
        parent = event.cpu_parent
        while parent is not None:
            yield parent.name
            parent = parent.cpu_parent

    top = [e.name for e in aten if not any(name.startswith("aten::") for name in ancestors(e))]
    reads, in_optimizer = collections.Counter(), collections.Counter()
    for e in aten:
        if e.name in HOST_READS:
            inside = any(name.startswith("Optimizer.step") for name in ancestors(e))
            (in_optimizer if inside else reads)[e.name] += 1
    return {"aten_calls": len(aten), "top_level_aten_calls": len(top), "host_reads": sum(reads.values()),
            "host_reads_by_op": dict(reads), "optimizer_host_reads": sum(in_optimizer.values()),
            "top_level_most_common": collections.Counter(top).most_common(12)}


def main(argv=None) -> dict:
    """Parse the options, build and step the model, print and return the counts."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(FAMILIES), default="mt5")
    p.add_argument("--size", default="demo")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the profiled one")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    family = FAMILIES[args.model]
    if args.size not in family.sizes:
        p.error(f"--size {args.size} is not a {args.model} size; {args.model} has {', '.join(family.sizes)}")
    args.family, args.shape = family, dict(family.sizes[args.size])
    args.micro_batch = args.shape["micro_batch"]
    device = torch.device("cpu")
    torch.manual_seed(args.seed)
    model = family.build_ours(args.shape, device)
    stepper = OursStepper(model, make_batches(args, device), device, None)
    for _ in range(args.warmup):
        stepper.step()
    result = {"benchmark": "step_ops", "model": args.model, "size": args.size, **count_step(stepper),
              "torch": torch.__version__}
    print(f"{family.label} {args.size}: {result['aten_calls']} ATen calls, {result['top_level_aten_calls']} top-level, "
          f"{result['host_reads']} host reads {result['host_reads_by_op']} per training step "
          f"(+{result['optimizer_host_reads']} inside the optimizer's CPU kernel)")
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
