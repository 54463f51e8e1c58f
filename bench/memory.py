#!/usr/bin/env python
"""Memory per rank under data parallelism: no ZeRO, ZeRO-1, 1+offload, 2, 3, 3+offload, activation checkpointing
(full and selective), fused loss.

    python bench/memory.py                 # a GPT of about 30M parameters, 4 ranks
    python bench/memory.py --smoke         # a 3.7M-parameter GPT, big enough for RSS to measure
    python bench/memory.py --hidden 1024 --layers 12 --nproc 8
    python bench/memory.py --compare-offload [--smoke]   # DeepSpeed's ZeRO-1 with and without offload_optimizer

The table shows each configuration next to no-ZeRO; the last line of the output is one JSON object
with every number (the maximum over ranks).
What each column counts: bench/README.md, section "memory.py: how it measures".
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

# name -> (zero_stage, offload, activation checkpointing mode or False, fused LM head + loss); "no_zero" is the
# reference column; the "_ac" rows checkpoint every layer ("full"), "no_zero_selective_ac" keeps the matmul
# outputs ("selective"). Every row but the last fuses the LM head with the loss, as training does;
# "no_zero_unfused_ce" materialises the logits, to show what the fusion saves.
CONFIGS = {
    "no_zero": (0, False, False, True),
    "zero1": (1, False, False, True),
    "zero1_offload": (1, True, False, True),
    "zero2": (2, False, False, True),
    "zero3": (3, False, False, True),
    "zero3_offload": (3, True, False, True),
    "no_zero_ac": (0, False, "full", True),
    "no_zero_selective_ac": (0, False, "selective", True),
    "zero3_ac": (3, False, "full", True),
    "no_zero_unfused_ce": (0, False, False, False),
}
OFFLOAD_COMPARISON = ("no_zero", "zero1", "zero1_offload")
MODEL_DEFAULTS = dict(layers=6, hidden=512, heads=8, vocab=16384, seq=128, micro_batch=4)
SMOKE = dict(layers=2, hidden=256, heads=4, vocab=8192, seq=64, micro_batch=4)
ACCEPT_ZERO3_STATIC_RATIO = 0.30
# tools/estimate_memory.py's peak step per rank must be within this fraction of the measured one.
ACCEPT_ESTIMATE_ERROR = 0.15


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options; see ``--help``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--smoke", action="store_true", help="a 3.7M-parameter GPT: checks the benchmark and the planner (about a minute)")
    p.add_argument("--nproc", type=int, default=4, help="data-parallel ranks (default 4)")
    for key, value in MODEL_DEFAULTS.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"default {value} (smoke {SMOKE[key]})")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    p.add_argument("--compare-offload", action="store_true",
                   help=f"only {','.join(OFFLOAD_COMPARISON)}: ZeRO-1's peaks with and without optimizer offload side "
                        f"by side, measured here and predicted for a GPU")
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compare_offload:
        args.configs = ",".join(OFFLOAD_COMPARISON)
    base = SMOKE if args.smoke else MODEL_DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; choose from {','.join(CONFIGS)}")
    if "no_zero" not in args.configs.split(","):
        p.error("--configs must include no_zero, the reference column")
    return args


# ------------------------------------------------------------------ memory probes (worker side)


class MemoryProbe:
    """Current and peak memory of this process: RSS on CPU, the CUDA allocator on GPU."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"

    def current(self) -> int:
        if self.cuda:
            return self.torch.cuda.memory_allocated()
        return self._status_kb("VmRSS") * 1024

    def peak(self) -> int:
        if self.cuda:
            return self.torch.cuda.max_memory_allocated()
        return self._status_kb("VmHWM") * 1024

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
            return
        # "5" resets the process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0).
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    @staticmethod
    def _status_kb(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise RuntimeError(f"{field} not in /proc/self/status")


def tensor_bytes(t) -> int:
    """Bytes this rank holds for `t`: the local shard of a DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def state_bytes(model, optimizer) -> tuple[int, int, int]:
    """(param, grad, optimizer-state) bytes held by this rank."""
    import torch

    params = list(model.parameters())
    param_bytes = sum(tensor_bytes(p) for p in params)
    grad_bytes = sum(tensor_bytes(p.grad) for p in params if p.grad is not None)
    # ShardedStateZeroRedundancyOptimizer.state is its local shard; other optimizers hold their own.
    opt_bytes = sum(
        tensor_bytes(v) for s in optimizer.state.values() if s for v in s.values() if torch.is_tensor(v)
    )
    return param_bytes, grad_bytes, opt_bytes


def run_config(name: str, args, dp_mesh, device, probe: MemoryProbe) -> dict:
    """Three training steps of one configuration; the third is measured."""
    import torch

    from libai_lite.optim.build import get_default_optimizer_params
    from libai_lite.converters.activation_checkpoint import apply_activation_checkpointing
    from libai_lite.parallel.data_parallel import apply_data_parallel, build_zero1_optimizer
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    stage, offload, ac, fused_ce = CONFIGS[name]
    gc.collect()
    baseline = probe.current()
    torch.manual_seed(0)
    model = GPTForPreTraining(model_cfg(args, fused_ce)).to(device)
    n_params = model.num_parameters()
    if ac:
        apply_activation_checkpointing(model, 1, ac)
    model = apply_data_parallel(model, dp_mesh, stage, offload=offload)
    raw = model.module if hasattr(model, "module") else model
    groups = get_default_optimizer_params(raw, weight_decay=0.01)
    if stage == 1:
        opt = build_zero1_optimizer(torch.optim.AdamW, groups, dp_mesh.get_group(), offload=offload, lr=1e-4)
    else:
        opt = torch.optim.AdamW(groups, lr=1e-4)
    g = torch.Generator().manual_seed(1 + dp_mesh.get_local_rank())
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # Step 1 allocates the optimizer state and DDP rebuilds its gradient buckets in step 2's
    # forward (freeing the first ones mid-forward); step 3 is the one measured.
    for _ in range(2):
        model(x, y)["lm_loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    gc.collect()
    sync()
    t0 = time.perf_counter()
    probe.reset_peak()
    before_forward = probe.current()
    loss = model(x, y)["lm_loss"]
    sync()
    after_forward = probe.current()
    loss.backward()
    sync()
    peak_fwd_bwd = probe.peak()
    param_b, grad_b, _ = state_bytes(model, opt)
    opt.step()
    sync()
    peak_step = probe.peak()
    _, _, opt_b = state_bytes(model, opt)
    opt.zero_grad(set_to_none=True)
    step_time = time.perf_counter() - t0
    del model, raw, opt, loss, groups
    gc.collect()
    return {
        "num_parameters": n_params,
        "param_bytes": param_b,
        "grad_bytes": grad_b,
        "optimizer_bytes": opt_b,
        "static_bytes": param_b + grad_b + opt_b,
        "activation_bytes": after_forward - before_forward,
        "peak_fwd_bwd_bytes": peak_fwd_bwd - before_forward,
        "peak_step_bytes": peak_step - baseline,
        "step_time_s": step_time,
    }


def worker(args) -> None:
    """One rank of the torchrun job: every configuration in turn; rank 0 writes the per-rank maxima."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    probe = MemoryProbe(device)
    # The first configuration a process runs pays one-off allocations (gloo buffers, library
    # state; about 80 MiB of "pk step" here), so one untimed run of it comes first and every
    # measured row starts from the same process state.
    run_config(args.configs.split(",")[0], args, mesh["dp"], device, probe)
    results = {}
    for name in args.configs.split(","):
        row = run_config(name, args, mesh["dp"], device, probe)
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        results[name] = {k: max(r[k] for r in rows) for k in row}
        if dist.get_rank() == 0:
            print(f"[memory bench] {name} done in {results[name]['step_time_s']:.1f} s/step", file=sys.stderr, flush=True)
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"device": device.type, "configs": results}, f)
    # Every rank past its last collective before teardown: tearing gloo down while a peer still
    # talks to it can abort the process ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------ the planner's estimate


def model_cfg(args, fused_ce: bool) -> dict:
    """The GPT's constructor settings for this job (also what the planner builds)."""
    return dict(hidden_layers=args.layers, vocab_size=args.vocab, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
                num_attention_heads=args.heads, max_seq_length=args.seq, embedding_dropout_prob=0.0,
                attention_dropout_prob=0.0, output_dropout_prob=0.0, fused_cross_entropy=fused_ce)


def estimate_configs(args, device: str) -> dict:
    """``libai_lite.planning``'s per-rank estimate of each configuration (name -> its numbers), whose
    ``peak_step_bytes`` is comparable to the measured "peak step": the device peak, planned for this job's
    device (on a CPU, offload moves nothing)."""
    import torch

    from libai_lite.optim.build import get_default_optimizer_params
    from libai_lite.planning import MemoryPlanner, PlanSettings
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    sample = {"input_ids": torch.zeros(args.seq, dtype=torch.long), "labels": torch.zeros(args.seq, dtype=torch.long)}
    planners, out = {}, {}
    for name in args.configs.split(","):
        stage, offload, ac, fused_ce = CONFIGS[name]
        if fused_ce not in planners:
            planners[fused_ce] = MemoryPlanner(
                lambda f=fused_ce: GPTForPreTraining(model_cfg(args, f)), sample,
                optimizer_factory=lambda params: torch.optim.AdamW(params, lr=1e-4),
                param_groups=lambda m: get_default_optimizer_params(m, weight_decay=0.01))
        settings = PlanSettings(world_size=args.nproc, data_parallel_size=args.nproc, zero_stage=stage, offload=offload,
                                activation_checkpoint_every=int(bool(ac)),
                                activation_checkpoint_mode=ac or "full", micro_batch_size=args.micro_batch, device=device)
        est = planners[fused_ce].estimate(settings)
        out[name] = {"params": est.params, "grads": est.grads, "optimizer": est.optimizer,
                     "activations": est.activations, "peak": est.peak, "host": est.host,
                     "peak_step_bytes": est.peak}
    return out


# ------------------------------------------------------------------ launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mib(n: float) -> str:
    return f"{n / 2**20:9.1f}"


def format_table(configs: dict) -> str:
    """Side-by-side MiB per rank, each configuration's static bytes as a ratio of no-ZeRO's."""
    ref = configs["no_zero"]
    cols = ["param_bytes", "grad_bytes", "optimizer_bytes", "static_bytes", "activation_bytes",
            "peak_fwd_bwd_bytes", "peak_step_bytes"]
    heads = ["params", "grads", "optim", "static", "activ.", "pk f+b", "pk step"]
    lines = [f"{'config (MiB/rank)':20s}" + "".join(f"{h:>10s}" for h in heads) + f"{'static/no_zero':>16s}{'activ./no_AC':>14s}"
             + f"{'step s':>8s}{'time/no_AC':>12s}{'estimated':>11s}{'est/meas':>10s}"]
    for name, row in configs.items():
        base = name.removesuffix("_ac").removesuffix("_selective") if name.endswith("_ac") else None
        ac_ref = configs.get(base) if base else None
        ac_ratio = f"{row['activation_bytes'] / ac_ref['activation_bytes']:14.2f}" if ac_ref and ac_ref["activation_bytes"] > 0 else f"{'':14s}"
        # One measured step each: a rough figure on a shared machine, beside the exact byte counts.
        time_ratio = f"{row['step_time_s'] / ac_ref['step_time_s']:12.2f}" if ac_ref else f"{'':12s}"
        estimate = (f"{_mib(row['estimated_peak_step_bytes']):>11s}{row['estimate_ratio']:10.3f}"
                    if "estimated_peak_step_bytes" in row else "")
        lines.append(
            f"{name:20s}" + "".join(f"{_mib(row[c]):>10s}" for c in cols)
            + f"{row['static_bytes'] / ref['static_bytes']:16.3f}" + ac_ratio + f"{row['step_time_s']:8.2f}" + time_ratio
            + estimate
        )
    return "\n".join(lines)


def offload_comparison(configs: dict, measured_on: str, predicted: dict) -> dict:
    """ZeRO-1's peak step per rank with and without optimizer offload: measured on this job's device (on a CPU
    the host copies are in the same memory) and predicted by the planner for a GPU, where the offloaded
    state leaves the device for the host."""
    plain, off = configs["zero1"], configs["zero1_offload"]
    gpu_plain, gpu_off = predicted["zero1"], predicted["zero1_offload"]
    return {
        "measured_on": measured_on,
        "measured_peak_step_bytes": {"zero1": plain["peak_step_bytes"], "zero1_offload": off["peak_step_bytes"]},
        "measured_ratio": round(off["peak_step_bytes"] / max(1, plain["peak_step_bytes"]), 4),
        "predicted_on": "cuda",
        "predicted_peak_bytes": {"zero1": gpu_plain["peak"], "zero1_offload": gpu_off["peak"]},
        "predicted_ratio": round(gpu_off["peak"] / max(1, gpu_plain["peak"]), 4),
        "predicted_host_bytes": gpu_off["host"],
    }


def format_offload_comparison(c: dict) -> str:
    """The comparison as a small table: both peaks in MiB per rank and offload's over plain ZeRO-1's."""
    lines = [f"{'ZeRO-1 peak step (MiB/rank)':30s}{'no offload':>12s}{'offload':>12s}{'offload/no':>12s}"]
    for kind, peaks, ratio in (("measured", c["measured_peak_step_bytes"], c["measured_ratio"]),
                               ("predicted", c["predicted_peak_bytes"], c["predicted_ratio"])):
        where = c[f"{kind}_on"]
        lines.append(f"{f'{kind} ({where})':30s}{_mib(peaks['zero1']):>12s}{_mib(peaks['zero1_offload']):>12s}"
                     f"{ratio:12.3f}")
    lines.append(f"predicted host memory with offload: {c['predicted_host_bytes'] / 2**20:.1f} MiB/rank (optimizer "
                 f"state, the shard's parameter and gradient copies, the step's temporaries)")
    if c["measured_on"] == "cpu":
        lines.append("measured on a CPU: host and device are the same memory, so offload only adds the shard's copies")
    return "\n".join(lines)


def launch(args) -> dict:
    """Run the torchrun job and return its results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "memory.json")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   # A fixed mmap threshold makes glibc return every large free to the OS at once
                   # (its default adapts upwards and keeps freed tensors resident), so RSS is live memory.
                   MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
               os.path.abspath(__file__), "--worker-out", out, "--configs", args.configs]
        cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in MODEL_DEFAULTS]
        start = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, stdout=sys.stderr)
        with open(out) as f:
            result = json.load(f)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker_out:
        worker(args)
        return 0
    result = launch(args)
    configs = result["configs"]
    for name, est in estimate_configs(args, result["device"]).items():
        row = configs[name]
        row["estimated"] = est
        row["estimated_peak_step_bytes"] = est["peak_step_bytes"]
        row["estimate_ratio"] = round(est["peak_step_bytes"] / max(1, row["peak_step_bytes"]), 4)
    model = {k: getattr(args, k) for k in MODEL_DEFAULTS}
    model["num_parameters"] = configs["no_zero"]["num_parameters"]
    summary = {
        "bench": "memory",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {result['device']}",
        "nproc": args.nproc,
        "smoke": args.smoke,
        "model": model,
        "wall_s": result["wall_s"],
        "configs": configs,
    }
    if "zero3" in configs:
        ratio = configs["zero3"]["static_bytes"] / configs["no_zero"]["static_bytes"]
        summary["zero3_static_ratio"] = round(ratio, 4)
        summary["zero3_static_at_most_30pct"] = ratio <= ACCEPT_ZERO3_STATIC_RATIO
    print(f"GPT {model['num_parameters'] / 1e6:.1f}M parameters, dp={args.nproc}, micro-batch {args.micro_batch} x "
          f"seq {args.seq}, {result['device']}, {summary['wall_s']} s")
    print(format_table(configs))
    if "zero3_static_ratio" in summary:
        verdict = "meets" if summary["zero3_static_at_most_30pct"] else "MISSES"
        print(f"ZeRO-3 param+grad+optimizer bytes per rank = {summary['zero3_static_ratio']:.1%} of no-ZeRO "
              f"({verdict} the <= 30% target)")
    if {"zero1", "zero1_offload"} <= set(configs):
        summary["offload_comparison"] = offload_comparison(configs, result["device"], estimate_configs(args, "cuda"))
        print(format_offload_comparison(summary["offload_comparison"]))
    worst = max(configs, key=lambda n: abs(configs[n]["estimate_ratio"] - 1))
    summary["estimate_worst_ratio"] = configs[worst]["estimate_ratio"]
    summary["estimate_within_15pct"] = all(abs(r["estimate_ratio"] - 1) <= ACCEPT_ESTIMATE_ERROR for r in configs.values())
    verdict = "meets" if summary["estimate_within_15pct"] else "MISSES"
    print(f"tools/estimate_memory.py's peak step against the measured one: worst {worst} at "
          f"{configs[worst]['estimate_ratio']:.3f} ({verdict} the within-15% target)")
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
