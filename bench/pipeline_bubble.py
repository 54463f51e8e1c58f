#!/usr/bin/env python
"""Pipeline bubble per schedule: the idle fraction of pp ranks over one step, from per-stage timings.

    python bench/pipeline_bubble.py                 # pp=4, 8 micro-batches, sleep stages
    python bench/pipeline_bubble.py --stage gpt     # real compute, distorted on fewer cores than ranks
    python bench/pipeline_bubble.py --smoke         # pp=2, 4 micro-batches, tiny stages

Prints a table; the last line is one JSON object with every number.
The method, stages and schedules: bench/README.md, section "pipeline_bubble.py: how it measures".
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (name, stages per rank)
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zero_bubble", 2),
             ("zbv_zero_bubble", 2), ("dualpipev", 2)]
DEFAULTS = dict(pp=4, microbatches=8, stage="sleep", op_ms=20.0, layers=8, hidden=512, seq=128, micro_batch=4,
                vocab=1024, steps=3, warmup=1)
SMOKE = dict(DEFAULTS, pp=2, microbatches=4, op_ms=5.0, layers=4, hidden=64, seq=16, micro_batch=2, vocab=128,
             steps=1, warmup=1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--smoke", action="store_true", help="pp=2, 4 micro-batches, tiny stages")
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=None, help=f"default {v}")
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    base = SMOKE if args.smoke else DEFAULTS
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.stage not in ("sleep", "gpt"):
        p.error(f"--stage {args.stage!r}: use 'sleep' or 'gpt'")
    if args.layers % (2 * args.pp):
        p.error(f"--layers {args.layers} must be a multiple of 2 x pp = {2 * args.pp} (2 stages per rank)")
    return args


# --------------------------------------------------------------------------- worker (one rank)


def _sleep_stage_cls():
    import torch
    from torch import nn

    class _Sleep(torch.autograd.Function):
        """Identity whose forward sleeps ``fwd`` and backward ``bwd`` seconds: a kernel of that length."""

        @staticmethod
        def forward(ctx, x, fwd, bwd):
            ctx.bwd = bwd
            time.sleep(fwd)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            time.sleep(ctx.bwd)
            return grad, None, None

    class SleepLayer(nn.Module):
        """x @ W with F, B (input gradient) and W (weight gradient) each ``op_s`` long: the sleep on
        the activation path runs in the input-gradient pass, the one on the weight path in the
        weight-gradient pass (a full backward runs both)."""

        def __init__(self, dim: int, op_s: float):
            super().__init__()
            self.weight = nn.Parameter(torch.eye(dim) + 0.01 * torch.randn(dim, dim))
            self.op_s = op_s

        def forward(self, x):
            return _Sleep.apply(x, self.op_s, self.op_s) @ _Sleep.apply(self.weight, 0.0, self.op_s)

    return SleepLayer


def _build(args, name, virtual, layout):
    """(stepper, stage modules, step inputs, labels) for one schedule on this rank."""
    import torch
    from torch import nn

    from libai_lite.parallel.pipeline import PipelineStepper
    from libai_lite.parallel.pipeline_split import build_stage_modules, build_tied_weight_group, local_stage_ids
    from libai_lite.utils.parallel_dims import layer_stages

    pp, rank = layout.pipeline_parallel_size, layout.pp_rank
    num_stages = pp * virtual
    ids = local_stage_ids(rank, pp, virtual, name)
    per_stage = args.layers // num_stages
    g = torch.Generator().manual_seed(0)
    rows = args.microbatches * args.micro_batch
    if args.stage == "sleep":
        layer = _sleep_stage_cls()
        torch.manual_seed(0)
        # A small width: the matmuls stay far below the sleeps.
        dim = 64
        stages = [nn.Sequential(*[layer(dim, args.op_ms / 1000) for _ in range(per_stage)]) for _ in ids]
        x = torch.randn(rows, dim, generator=g)
        y = torch.randn(rows, dim, generator=g)
        stepper = PipelineStepper(stages, ids, num_stages, layout.group("pp"), layout.device, name,
                                  args.microbatches, nn.functional.mse_loss)
        return stepper, stages, (x,), {}, y
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    cfg = dict(hidden_layers=args.layers, vocab_size=args.vocab, hidden_size=args.hidden,
               ffn_hidden_size=4 * args.hidden, num_attention_heads=max(1, args.hidden // 64),
               max_seq_length=args.seq, embedding_dropout_prob=0.0, attention_dropout_prob=0.0,
               output_dropout_prob=0.0)
    torch.manual_seed(0)
    model = GPTForPreTraining(cfg)
    stages, _ = build_stage_modules(model, ids, num_stages, layer_stages(args.layers, num_stages))
    tied = build_tied_weight_group(layout.mesh, schedule=name, virtual_stages=virtual)
    stepper = PipelineStepper(stages, ids, num_stages, layout.group("pp"), layout.device, name, args.microbatches,
                              model.pipeline_loss_fn, tied, batch_fn=model.pipeline_batch)
    ids_t = torch.randint(0, args.vocab, (rows, args.seq), generator=g)
    labels = torch.randint(0, args.vocab, (rows, args.seq), generator=g)
    inputs, kwargs, labels = stepper.split_batch({"input_ids": ids_t, "labels": labels})
    return stepper, stages, inputs, kwargs, labels


def _timed(fn, box: list):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            box[0] += time.perf_counter() - t
    return wrapper


def _pipeline_stages(schedule) -> list:
    return list(getattr(schedule, "_stages", None) or [schedule._stage])


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    from libai_lite.utils.distributed import destroy, setup_dist

    torch.set_num_threads(1)
    layout = setup_dist({"pipeline_parallel_size": args.pp, "timeout": 300})
    results = []
    try:
        for name, virtual in SCHEDULES:
            if args.layers % (args.pp * virtual):
                continue
            stepper, stages, inputs, kwargs, labels = _build(args, name, virtual, layout)
            busy = [0.0]
            for stage in _pipeline_stages(stepper.schedule):
                for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                    setattr(stage, method, _timed(getattr(stage, method), busy))
            walls, busies = [], []
            for i in range(args.warmup + args.steps):
                for s in stages:
                    s.zero_grad(set_to_none=True)
                dist.barrier(group=layout.group("pp"))
                busy[0] = 0.0
                t = time.perf_counter()
                stepper.step(inputs, labels, kwargs=kwargs)
                wall = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
                # The step ends with the loss broadcast, so the slowest rank's wall is the step's.
                dist.all_reduce(wall, op=dist.ReduceOp.MAX, group=layout.group("pp"))
                b = torch.tensor([busy[0]], dtype=torch.float64)
                dist.all_reduce(b, group=layout.group("pp"))
                if i >= args.warmup:
                    walls.append(float(wall))
                    busies.append(float(b))
            idle = [1 - b / (w * args.pp) for b, w in zip(busies, walls)]
            results.append(dict(schedule=name, stages_per_rank=virtual, wall_s=statistics.median(walls),
                                busy_s_per_rank=statistics.median(busies) / args.pp,
                                idle_fraction=statistics.median(idle)))
        if layout.rank == 0:
            with open(args.worker_out, "w") as f:
                json.dump(results, f)
        dist.barrier()
    finally:
        destroy()


# --------------------------------------------------------------------------- driver


def ideal_idle(name: str, pp: int, m: int, virtual: int) -> float:
    """The idle fraction the schedule would have with F = B_input = B_weight per stage (a full backward
    twice F) and free communication: for the one-stage schedules (p-1)/(m+p-1), for the others
    torch's own action order for each rank (``get_schedule_ops``) replayed on that clock, each
    action starting when its rank is free and its inputs exist."""
    if virtual == 1 and name in ("gpipe", "1f1b"):
        return (pp - 1) / (m + pp - 1)
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from libai_lite.parallel.pipeline import SCHEDULES as CLASSES

    cost = {"F": 1, "I": 1, "W": 1, "B": 2}
    last = pp * virtual - 1
    queues = []
    for actions in get_schedule_ops(CLASSES[name], pp, m, virtual):
        ops = []
        for a in actions:
            # DualPipeV's overlapped F+B pairs run one after the other on the compute clock.
            for b in (getattr(a, "sub_actions", None) or [a]) if a is not None else []:
                if b.computation_type.value in cost:
                    ops.append((b.computation_type.value, b.stage_index, b.microbatch_index))
        queues.append(ops)
    done: dict = {}
    free, pos, work = [0] * pp, [0] * pp, 0
    moved = True
    while moved:
        moved = False
        for r in range(pp):
            while pos[r] < len(queues[r]):
                kind, s, mb = queues[r][pos[r]]
                if kind == "F":
                    deps = [("F", s - 1, mb)] if s > 0 else []
                elif kind in "IB":
                    deps = [("F", s, mb)] + ([("B", s + 1, mb)] if s < last else [])
                else:
                    deps = [("B", s, mb)]
                if any(d not in done for d in deps):
                    break
                end = max([free[r]] + [done[d] for d in deps]) + cost[kind]
                free[r], pos[r], work, moved = end, pos[r] + 1, work + cost[kind], True
                done[("B" if kind == "I" else kind, s, mb)] = end
    if pos != [len(q) for q in queues]:
        raise RuntimeError(f"replaying {name}'s action order stalled at {pos}")
    return 1 - work / (pp * max(free))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.pp),
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), os.path.abspath(__file__),
               "--worker-out", out]
        cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in DEFAULTS]
        subprocess.run(cmd, env=env, check=True, stdout=sys.stderr)
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker_out:
        worker(args)
        return 0
    rows = measure(args)
    p, m = args.pp, args.microbatches
    print(f"pp={p}, {m} micro-batches, {args.stage} stages"
          + (f" ({args.op_ms:g} ms per layer and op)" if args.stage == "sleep" else
             f" (GPT, {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro-batch {args.micro_batch})")
          + f", {os.cpu_count()} CPU cores, median of {args.steps} steps")
    print(f"{'schedule':<26}{'stages/rank':>12}{'step s':>10}{'busy s/rank':>13}{'idle':>8}{'ideal':>8}")
    for r in rows:
        r["ideal_idle_fraction"] = ideal_idle(r["schedule"], p, m, r["stages_per_rank"])
        print(f"{r['schedule']:<26}{r['stages_per_rank']:>12}{r['wall_s']:>10.3f}{r['busy_s_per_rank']:>13.3f}"
              f"{r['idle_fraction']:>8.1%}{r['ideal_idle_fraction']:>8.1%}")
    print("ideal: F = B_input = B_weight and free communication (what sleep stages model, less overheads)")
    print(json.dumps(dict(vars(args), cpu_count=os.cpu_count(), results=rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
