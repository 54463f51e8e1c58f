#!/usr/bin/env python
"""Dense GPT against MoE GPT at the same ACTIVE parameter count: training tokens/s and param+grad+optimizer memory.

    python bench/moe.py                  # 1 process, demo-sized GPT, 8 experts
    python bench/moe.py --nproc 2        # experts over 2 ranks (ep=2)
    python bench/moe.py --smoke          # tiny models, seconds

The last line of the output is one JSON object with every number.
The method: bench/README.md, section "moe.py: how it measures".
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

DEFAULTS = dict(layers=4, hidden=256, heads=4, seq=128, vocab=8064, micro_batch=8, experts=8, every_n_layers=2,
                steps=2, blocks=8, warmup=2)
SMOKE = dict(layers=2, hidden=32, heads=2, seq=16, vocab=128, micro_batch=2, experts=4, every_n_layers=2,
             steps=1, blocks=2, warmup=1)
LR, CLIP = 1e-4, 1.0


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options; see ``--help``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--smoke", action="store_true", help="tiny models: checks the benchmark runs (seconds)")
    p.add_argument("--nproc", type=int, default=1, help="processes; the MoE model uses ep_size=nproc (default 1)")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="expert capacity factor (default 1.25)")
    for key, value in DEFAULTS.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"default {value} (smoke {SMOKE[key]})")
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    base = SMOKE if args.smoke else DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.experts % args.nproc:
        p.error(f"--experts {args.experts} must be a multiple of --nproc {args.nproc} (experts are spread over ranks)")
    return args


def model_cfg(args, moe: bool) -> dict:
    cfg = dict(hidden_layers=args.layers, vocab_size=args.vocab, hidden_size=args.hidden,
               ffn_hidden_size=4 * args.hidden, num_attention_heads=args.heads, max_seq_length=args.seq,
               embedding_dropout_prob=0.0, attention_dropout_prob=0.0, output_dropout_prob=0.0)
    if moe:
        cfg["moe"] = dict(enabled=True, num_experts=args.experts, top_k=1, ep_size=args.nproc,
                          capacity_factor=args.capacity_factor, aux_loss_weight=0.01,
                          every_n_layers=args.every_n_layers)
    return cfg


def local_bytes(t) -> int:
    """Bytes this rank holds for ``t``: a DTensor's local shard."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


class Side:
    """One model (dense or MoE) with its optimizer, ready to step."""

    def __init__(self, name: str, args, mesh, device):
        import torch

        from libai_lite.optim.build import get_default_optimizer_params
        from libai_lite.parallel.data_parallel import apply_data_parallel
        from libai_lite.parallel.expert_parallel import apply_expert_parallel, build_expert_mesh
        from projects.GPT.modeling.gpt_model import GPTForPreTraining

        self.name = name
        torch.manual_seed(0)
        model = GPTForPreTraining(model_cfg(args, name == "moe")).to(device)
        gpt = model.GPT_model
        self.total_params = gpt.num_parameters()
        # Active parameters per token, as the FLOPs count sees them (embeddings included, as nanoGPT).
        self.active_params = (gpt.flops_per_token(args.seq) - 12 * args.layers * args.hidden * args.seq) // 6
        expert_mesh = None
        if mesh is not None:
            if name == "moe" and args.nproc > 1:
                expert = build_expert_mesh(mesh, args.nproc)
                apply_expert_parallel(model, expert)
                expert_mesh = expert["edp"]
            model = apply_data_parallel(model, mesh["dp"], 0, expert_mesh=expert_mesh)
        raw = model.module if hasattr(model, "module") else model
        self.model = model
        self.opt = torch.optim.AdamW(get_default_optimizer_params(raw, weight_decay=0.01), lr=LR, betas=(0.9, 0.95))
        self.params = [p for p in model.parameters() if p.requires_grad]

    def step(self, x, y) -> float:
        from libai_lite.parallel.clip_grad import clip_grad_norm_

        out = self.model(x, y)
        loss = sum(v for k, v in out.items() if "loss" in k)
        loss.backward()
        clip_grad_norm_(self.params, CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        return float(out["lm_loss"].detach())

    def memory(self) -> dict:
        import torch

        params = list(self.model.parameters())
        opt_bytes = sum(local_bytes(v) for s in self.opt.state.values() for v in s.values()
                        if torch.is_tensor(v) and v.dim() > 0)
        out = {
            "param_bytes": sum(local_bytes(p) for p in params),
            "grad_bytes": sum(local_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer_bytes": opt_bytes,
        }
        out["static_bytes"] = sum(out.values())
        return out


def run(args, mesh, device, rank: int, world: int) -> dict:
    """Warm up both sides, then alternate timed blocks; returns this rank's numbers."""
    import torch

    sides = {name: Side(name, args, mesh, device) for name in ("dense", "moe")}
    g = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    for side in sides.values():
        for _ in range(args.warmup):
            side.step(x, y)
    tokens_per_block = args.steps * args.micro_batch * args.seq * world
    rates: dict = {"dense": [], "moe": []}
    for block in range(args.blocks):
        order = ("dense", "moe") if block % 2 == 0 else ("moe", "dense")
        for name in order:
            if mesh is not None:
                torch.distributed.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                sides[name].step(x, y)
            if device.type == "cuda":
                torch.cuda.synchronize()
            rates[name].append(tokens_per_block / (time.perf_counter() - start))
    out = {"rates": rates}
    for name, side in sides.items():
        out[name] = {"total_params": side.total_params, "active_params": side.active_params, **side.memory()}
    return out


def worker(args) -> None:
    """One rank of the torchrun job; rank 0 writes the numbers (memory: maximum over ranks)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    # torchrun would take a --nproc argument for its own; the world size says it.
    args.nproc = world
    mesh = init_device_mesh(device.type, (1, world, 1), mesh_dim_names=("pp", "dp", "tp"))
    mine = run(args, mesh, device, rank, world)
    rows = [None] * world
    dist.all_gather_object(rows, mine)
    if rank == 0:
        merged = {"rates": rows[0]["rates"], "device": device.type}
        for name in ("dense", "moe"):
            merged[name] = {k: max(r[name][k] for r in rows) for k in rows[0][name]}
        with open(args.worker_out, "w") as f:
            json.dump(merged, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args) -> dict:
    """The numbers of both sides: in this process (nproc 1) or from a torchrun job."""
    if args.nproc == 1:
        import torch

        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        result = run(args, None, device, 0, 1)
        result["device"] = device.type
        return result
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "moe.json")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), os.path.abspath(__file__),
               "--worker-out", out, "--capacity-factor", str(args.capacity_factor)]
        cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in DEFAULTS]
        subprocess.run(cmd, env=env, check=True, stdout=sys.stderr)
        with open(out) as f:
            return json.load(f)


def _quartiles(values: list[float]) -> list[float]:
    """Lower quartile, median, upper quartile (min, median, max with fewer than 4 values)."""
    if len(values) >= 4:
        return [round(q, 3) for q in statistics.quantiles(values, n=4)]
    return [round(v, 3) for v in (min(values), statistics.median(values), max(values))]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker_out:
        worker(args)
        return 0
    start = time.perf_counter()
    res = measure(args)
    dense, moe = res["dense"], res["moe"]
    rates = res["rates"]
    ratios = [m / d for m, d in zip(rates["moe"], rates["dense"])]
    summary = {
        "benchmark": "moe",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {res['device']}",
        "smoke": args.smoke,
        "nproc": args.nproc,
        "ep_size": args.nproc,
        "model": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq", "vocab", "micro_batch")},
        "experts": args.experts,
        "every_n_layers": args.every_n_layers,
        "capacity_factor": args.capacity_factor,
        "dense": dense,
        "moe": moe,
        "dense_tokens_per_s": statistics.median(rates["dense"]),
        "moe_tokens_per_s": statistics.median(rates["moe"]),
        "tokens_per_s_ratio": statistics.median(ratios),
        "tokens_per_s_ratio_quartiles": _quartiles(ratios),
        "static_bytes_ratio": moe["static_bytes"] / dense["static_bytes"],
        "active_params_ratio": moe["active_params"] / dense["active_params"],
        "wall_s": round(time.perf_counter() - start, 1),
    }
    mib = 2**20
    print(f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro batch {args.micro_batch}/rank, "
          f"{args.nproc} process(es); MoE: {args.experts} experts top-1 every {args.every_n_layers} layer(s), "
          f"ep={args.nproc}, capacity {args.capacity_factor}; {res['device']}")
    print(f"{'':22s}{'dense':>12s}{'MoE':>12s}{'MoE/dense':>12s}")
    rows = [("total params (M)", dense["total_params"] / 1e6, moe["total_params"] / 1e6),
            ("active params (M)", dense["active_params"] / 1e6, moe["active_params"] / 1e6),
            ("tokens/s", summary["dense_tokens_per_s"], summary["moe_tokens_per_s"]),
            ("params MiB/rank", dense["param_bytes"] / mib, moe["param_bytes"] / mib),
            ("grads MiB/rank", dense["grad_bytes"] / mib, moe["grad_bytes"] / mib),
            ("AdamW MiB/rank", dense["optimizer_bytes"] / mib, moe["optimizer_bytes"] / mib),
            ("p+g+opt MiB/rank", dense["static_bytes"] / mib, moe["static_bytes"] / mib)]
    for label, d, m in rows:
        ratio = summary["tokens_per_s_ratio"] if label == "tokens/s" else m / d
        print(f"{label:22s}{d:12.2f}{m:12.2f}{ratio:12.3f}")
    print(f"tokens/s ratio: median of {len(ratios)} per-block ratios, quartiles "
          f"{summary['tokens_per_s_ratio_quartiles']}")
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
