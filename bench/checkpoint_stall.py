#!/usr/bin/env python
"""How long a checkpoint stops the training loop: synchronous saves against train.checkpointer.async_save.

    python bench/checkpoint_stall.py                 # 117M, micro-batch 1 x seq 128, 3 rounds
    python bench/checkpoint_stall.py --smoke         # a tiny model, for the test suite

The last output line is a JSON object with every number.
The modes and what the stall counts: bench/README.md, section "checkpoint_stall.py: how it measures".
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("sync", "async", "none")
TARGET = 0.2


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options; see ``--help``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="projects/GPT/configs/gpt2_117M.py", help="config whose model.cfg is trained")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps-per-save", type=int, default=8,
                   help="steps per window; the background write should end within it")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    p.add_argument("--writer-threads", type=int, default=None,
                   help="DCP writer threads per save (default: the Checkpointer's, 1 without a GPU, 4 with one)")
    p.add_argument("--device", default="cpu", help="where the model trains (cuda: bf16 autocast, the state staged "
                   "from GPU memory)")
    p.add_argument("--smoke", action="store_true", help="a tiny model, 1 round of 2 steps (the test suite's run)")
    args = p.parse_args(argv)
    if args.smoke:
        args.seq_length, args.steps_per_save, args.rounds = 32, 2, 1
    if args.steps_per_save < 2 or args.rounds < 1:
        p.error("--steps-per-save must be at least 2 and --rounds at least 1")
    return args


def build(args):
    """The config's GPT (dropout 0, the sequence length of this run) and AdamW as configs/common/optim.py sets it."""
    from libai_lite.config import LazyConfig, instantiate

    cfg = LazyConfig.load(str(ROOT / args.config))
    model_cfg = cfg.model.cfg
    model_cfg.update(max_seq_length=args.seq_length, embedding_dropout_prob=0.0, attention_dropout_prob=0.0,
                     output_dropout_prob=0.0)
    if args.smoke:
        model_cfg.update(hidden_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=2, vocab_size=1024)
    torch.manual_seed(0)
    model = instantiate(cfg.model).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    return model, optimizer, int(model_cfg.vocab_size)


def _cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else the platform's machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def window(model, optimizer, vocab: int, args, mode: str, ck, iteration: int) -> dict:
    """``args.steps_per_save`` training steps, saving with ``ck`` after the first in ``mode``; seconds spent."""
    stall = 0.0
    start, cpu = time.perf_counter(), time.process_time()
    for step in range(args.steps_per_save):
        ids = torch.randint(0, vocab, (args.micro_batch, args.seq_length + 1), device=args.device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=str(args.device).startswith("cuda")):
            out = model(input_ids=ids[:, :-1], labels=ids[:, 1:])
        out["lm_loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(args.device)  # the step's own kernels are not the save's stall; the save's copies are
        t = time.perf_counter()
        if step == 0 and mode != "none":
            ck.save(f"model_{iteration + step:07d}", {"iteration": iteration + step})
        elif mode == "async":
            ck.poll()
        _sync(args.device)
        stall += time.perf_counter() - t
    t = time.perf_counter()
    still_writing = ck.in_flight is not None
    ck.wait()
    stall += time.perf_counter() - t
    total, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"stall_s": stall, "window_s": total, "cpu_s": cpu, "waited_at_end": still_writing}


def main(argv=None) -> dict:
    from libai_lite.checkpoint import Checkpointer

    args = parse_args(argv)
    # The checkpointer's per-save log lines and DCP's single-process notice are not the output.
    logging.getLogger("libai_lite").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    model, optimizer, vocab = build(args)
    params = sum(p.numel() for p in model.parameters())
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="checkpoint_stall_"))
    runs, first = {m: [] for m in MODES}, {}
    size = 0
    # One checkpointer per mode for the whole job, as a training run has (async_save keeps its
    # staging memory from one save to the next).
    cks = {m: Checkpointer(model, optimizer, str(base / m), async_save=(m == "async"),
                           writer_threads=args.writer_threads) for m in MODES}
    try:
        for r in range(args.rounds + 1):
            order = MODES[r % 3:] + MODES[:r % 3]
            for mode in order:
                res = window(model, optimizer, vocab, args, mode, cks[mode], r * args.steps_per_save)
                save_dir = base / mode
                if mode != "none":
                    size = sum(f.stat().st_size for f in save_dir.rglob("*") if f.is_file())
                shutil.rmtree(save_dir, ignore_errors=True)
                if r == 0:  # round 0 warms every path up (allocations, the writer thread, the page cache)
                    first[mode] = res
                else:
                    runs[mode].append(res)
                    print(f"round {r} {mode:5s} stall {res['stall_s']:7.3f} s  window {res['window_s']:7.3f} s  "
                          f"cpu {res['cpu_s']:7.3f} s"
                          + ("  (write still in flight at the window's end)" if res["waited_at_end"] else ""),
                          flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)

    none = runs["none"]
    result = {"benchmark": "checkpoint_stall", "config": args.config, "smoke": args.smoke, "parameters": params,
              "checkpoint_bytes": size, "device": str(args.device), "seq_length": args.seq_length, "micro_batch": args.micro_batch,
              "steps_per_save": args.steps_per_save, "rounds": args.rounds,
              "writer_threads": cks["sync"].writer_threads,
              "step_s": statistics.median(x["window_s"] for x in none) / args.steps_per_save}
    for mode in ("sync", "async"):
        result[mode] = {
            "stall_s": statistics.median(x["stall_s"] for x in runs[mode]),
            # Each paired with the same round's reference window.
            "extra_cpu_s": statistics.median(x["cpu_s"] - n["cpu_s"] for x, n in zip(runs[mode], none)),
            "extra_wall_s": statistics.median(x["window_s"] - n["window_s"] for x, n in zip(runs[mode], none)),
            "waited_at_end": sum(x["waited_at_end"] for x in runs[mode]),
            # The run's first save (untimed round): async_save allocates its staging memory there.
            "first_stall_s": first[mode]["stall_s"],
        }
    result["stall_ratio"] = result["async"]["stall_s"] / result["sync"]["stall_s"]
    result["meets_target"] = result["stall_ratio"] <= TARGET
    result["machine"] = f"{_cpu_name()}, {os.cpu_count()} cores"
    result["torch"] = torch.__version__
    result["date"] = datetime.date.today().isoformat()

    print(f"\n{params / 1e6:.1f}M parameters, {size / 2**30:.2f} GiB per checkpoint, "
          f"{result['step_s']:.3f} s per step (median of {args.rounds} rounds)")
    print(f"{'mode':6s} {'stall/save (s)':>15s} {'extra CPU/save (s)':>19s} {'extra wall/save (s)':>20s}")
    for mode in ("sync", "async"):
        r = result[mode]
        print(f"{mode:6s} {r['stall_s']:15.3f} {r['extra_cpu_s']:19.3f} {r['extra_wall_s']:20.3f}")
    print(f"first save of the run: stall {first['sync']['stall_s']:.3f} s sync, "
          f"{first['async']['stall_s']:.3f} s async")
    print(f"async/sync: stall {result['stall_ratio']:.3f} ({'meets' if result['meets_target'] else 'misses'} the "
          f"<= {TARGET:.0%} target)")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
