#!/usr/bin/env python
"""Memory and time of the LM head + cross entropy: unfused, the one-buffer fused kernel, the compiled chunked one.

    python bench/fused_loss.py                                 # 4096 tokens x 50304 vocab x 768 hidden, CPU fp32
    python bench/fused_loss.py --tokens 8192                   # GPT-2 at 8 x 1024 tokens
    python bench/fused_loss.py --device cuda --dtype bf16      # on a GPU (Liger too when installed)

The chunked kernel uses the GPU's chunk (``fused_linear_ce.chunk_rows`` for cuda) unless ``--rows``.
What saved, peak and time count: bench/README.md, section "fused_loss.py: how it measures".
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

KERNELS = ("unfused", "buffer", "chunked", "liger")


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def run_one(args) -> dict:
    """One kernel's forward + backward, measured on the second run; the row as a dict."""
    import torch
    import torch.nn.functional as F

    from libai_lite.layers import linear_cross_entropy
    from libai_lite.layers.fused_linear_ce import chunk_rows, gpu_linear_cross_entropy

    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(device).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    rows = args.rows or chunk_rows(torch.device("cuda"), args.vocab, args.tokens)
    inputs = {hidden.data_ptr(), weight.data_ptr()}
    saved = [0]

    def pack(t):
        if t.data_ptr() not in inputs:
            saved[0] += t.numel() * t.element_size()
        return t

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                if args.kernel == "unfused":
                    loss = F.cross_entropy(F.linear(hidden, weight).float(), target, reduction="none")
                elif args.kernel == "chunked":
                    compute = dtype if dtype != torch.float32 else torch.float32
                    loss, _ = gpu_linear_cross_entropy("chunked", hidden, weight, target, -100, compute, False,
                                                       rows=rows)
                else:
                    loss = linear_cross_entropy(hidden, weight, target, kernel=args.kernel)
        loss.sum().backward()
        hidden.grad = weight.grad = None

    step()  # compiles the chunked kernel
    saved[0] = 0
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        before = _rss_kb("VmRSS") * 1024
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _rss_kb("VmHWM") * 1024 - before
    return {"kernel": args.kernel, "saved_MB": saved[0] / 1e6, "peak_MB": peak / 1e6,
            "time_s": time.perf_counter() - start, "rows": rows if args.kernel == "chunked" else None}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--rows", type=int, default=0, help="tokens per chunk of the chunked kernel (0: the GPU's)")
    p.add_argument("--kernel", choices=KERNELS, help="run this one kernel in this process (what the parent does)")
    args = p.parse_args()
    if args.kernel:
        print(json.dumps(run_one(args)))
        return
    from libai_lite.layers.fused_linear_ce import liger_available

    kernels = [k for k in KERNELS if k != "liger" or (args.device == "cuda" and liger_available())]
    if args.device == "cpu":
        kernels = [k for k in kernels if k != "liger"]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")  # large blocks mapped apart: RSS follows frees
    rows = []
    for kernel in kernels:
        cmd = [sys.executable, __file__, "--kernel", kernel, *sys.argv[1:]]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"error: {kernel} failed:\n{r.stderr[-2000:]}", file=sys.stderr)
            sys.exit(1)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    n_v = args.tokens * args.vocab / 1e6
    print(f"{args.tokens} tokens x {args.vocab} vocab x {args.hidden} hidden, {args.device} {args.dtype}; "
          f"one fp32 [tokens, vocab] tensor = {4 * n_v:.0f} MB")
    print(f"{'kernel':<10}{'saved MB':>10}{'peak MB':>10}{'peak/unfused':>14}{'time s':>9}")
    base = rows[0]["peak_MB"]
    for row in rows:
        print(f"{row['kernel']:<10}{row['saved_MB']:>10.0f}{row['peak_MB']:>10.0f}{row['peak_MB'] / base:>14.2f}"
              f"{row['time_s']:>9.2f}" + (f"   ({row['rows']} tokens per chunk)" if row["rows"] else ""))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
