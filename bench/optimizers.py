#!/usr/bin/env python
"""Muon (projects/GPT/configs/gpt2_muon.py) against AdamW (the demo's own) on the demo GPT, side by side.

    python bench/optimizers.py                   # 100 steps of the demo on this machine's device
    python bench/optimizers.py --steps 300       # the demo's whole run
    python bench/optimizers.py --smoke           # a few steps of a tiny model (the test's)

Each optimizer trains the same model on the same batches in its own process, one after the other and then again
in the other order (so a machine that slows mid-job does not favour one); the last line is a JSON object with,
for each, the loss after the same number of steps (the mean of the last 10 logged, both runs) and the seconds per
step, and the ratios Muon / AdamW. What it measures: bench/README.md, "optimizers.py: how it measures".
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"adamw": "projects/GPT/configs/gpt2_pretrain.py", "muon": "projects/GPT/configs/gpt2_muon.py"}
TINY = ["model.cfg.hidden_layers=2", "model.cfg.hidden_size=64", "model.cfg.ffn_hidden_size=128",
        "model.cfg.num_attention_heads=2", "model.cfg.max_seq_length=32", "train.train_micro_batch_size=4",
        "train.global_batch_size=8"]


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options; see ``--help``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run (default 100)")
    p.add_argument("--smoke", action="store_true", help="a tiny model for a few steps: checks the script runs")
    return p.parse_args(argv)


def train(name: str, steps: int, smoke: bool, folder: str) -> dict:
    """One run of ``name``'s config; its losses by iteration and its mean step seconds after the first step."""
    out = os.path.join(folder, name)
    shutil.rmtree(out, ignore_errors=True)
    args = [sys.executable, "tools/train_net.py", "--config-file", CONFIGS[name], f"train.output_dir={out}",
            f"dataloader.train.cache_dir={os.path.join(folder, 'cache')}", f"train.train_iter={steps}",
            "train.log_period=1", "train.evaluation.enabled=False", f"train.checkpointer.period={10 * steps}",
            "dataloader.train.num_workers=0", "train.log_memory_estimate=False", *(TINY if smoke else [])]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: the {name} run failed: {r.stderr.strip().splitlines()[-1:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.json")) if '"total_loss"' in line]
    return {"loss": {row["iteration"]: row["total_loss"] for row in rows},
            "seconds": statistics.mean(row["time"] for row in rows[1:]) if len(rows) > 1 else rows[0]["time"]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    steps = 6 if args.smoke else args.steps
    folder = tempfile.mkdtemp(prefix="bench_optimizers_")
    try:
        runs = {name: [] for name in CONFIGS}
        for order in (("adamw", "muon"), ("muon", "adamw")):
            for name in order:
                runs[name].append(train(name, steps, args.smoke, folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    tail = max(1, min(10, steps // 2))
    result = {"benchmark": "optimizers", "steps": steps, "smoke": args.smoke}
    for name, done in runs.items():
        last = [run["loss"][it] for run in done for it in sorted(run["loss"])[-tail:]]
        result[name] = {"loss": statistics.mean(last), "seconds_per_step": statistics.mean(r["seconds"] for r in done)}
        print(f"{name:6s} loss after {steps} steps {result[name]['loss']:.4f} (mean of the last {tail} of both runs), "
              f"{result[name]['seconds_per_step']:.4f} s/step")
    result["loss_ratio_muon_over_adamw"] = result["muon"]["loss"] / result["adamw"]["loss"]
    result["time_ratio_muon_over_adamw"] = result["muon"]["seconds_per_step"] / result["adamw"]["seconds_per_step"]
    print(f"muon/adamw: loss x{result['loss_ratio_muon_over_adamw']:.3f}, "
          f"time per step x{result['time_ratio_muon_over_adamw']:.3f}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
