#!/usr/bin/env python
"""Check and measure the project on one CUDA GPU in one command: its GPU tests, recipes and benchmarks.

    bash bench/gpu.sh --out DIR                 # on a GPU machine
    bash bench/gpu.sh --out DIR --dry-run       # the same steps on the CPU at tiny sizes
    bash bench/gpu.sh --out DIR --only gpu_tests,resume_cpu    # some steps (--skip for the others)

Each step has its own time limit and log. The table printed last goes to table.md under --out,
beside results.json, gpu.log and logs.tar.gz.
The steps, the files and what the checkout needs: bench/README.md, section "gpu.py: how it measures".
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
GPT_DEMO = "projects/GPT/configs/gpt2_pretrain.py"
GPT_345M = "projects/GPT/configs/gpt2_345M.py"
MT5 = "projects/MT5/configs/mt5_pretrain.py"
# The dry run's model: the tests' tiny GPT (tests/launch.py), milliseconds per step on a CPU.
TINY_GPT = ["model.cfg.hidden_layers=2", "model.cfg.hidden_size=64", "model.cfg.ffn_hidden_size=128",
            "model.cfg.num_attention_heads=2", "model.cfg.max_seq_length=32", "train.train_micro_batch_size=4",
            "train.global_batch_size=8", "train.test_micro_batch_size=4", "train.log_period=1",
            "train.evaluation.eval_iter=2", "train.log_memory_estimate=False", "dataloader.train.num_workers=0"]
TINY_MT5 = ["model.cfg.hidden_layers=2", "model.cfg.hidden_size=64", "model.cfg.num_attention_heads=4",
            "model.cfg.head_size=16", "model.cfg.intermediate_size=128", "dataloader.train.max_seq_length=64",
            "dataloader.train.num_workers=0", "train.train_micro_batch_size=2", "train.log_period=1",
            "tokenization.make_vocab_size_divisible_by=256"]


@dataclass
class Ctx:
    """What every step's command and parser needs."""

    dry: bool
    work: Path
    python: str
    env: dict


@dataclass
class Step:
    """One step: ``cmd(ctx)`` -> argv, run with ``timeout`` seconds; ``parse(text, ctx)`` -> (ok, figure)."""

    name: str
    cmd: Callable[[Ctx], list]
    timeout: int
    parse: Callable[[str, Ctx], tuple]
    env: dict = field(default_factory=dict)
    # In the dry run on a CPU this step is refused by design (FP8 needs compute capability 8.9+): a
    # one-line `error:` is its expected outcome there.
    cpu_refuses: bool = False


# ----------------------------------------------------------------------------------------- parsing
def _last(pattern: str, text: str):
    found = re.findall(pattern, text, flags=re.M)
    return found[-1] if found else None


def _iteration_figure(text: str) -> tuple:
    """s/it, tokens/s, MFU and loss from the last `iteration:` log line of a training run."""
    line = _last(r"^.*iteration: \d+/\d+ .*$", text)
    if line is None:
        return False, "no iteration line"
    parts = ["iter " + _last(r"iteration: (\d+)/", line)]
    for label, pattern in (("s/it", r"\btime: ([\d.]+) s/it"), ("tok/s", r"tokens/s: ([\d.]+)"),
                           ("samples/s", r"samples/s: ([\d.]+)"), ("MFU", r"MFU: ([\d.]+%)"),
                           ("loss", r"total_loss: ([\d.]+)")):
        value = _last(pattern, line)
        if value is not None:
            parts.append(f"{label} {value}" if label != "s/it" else f"{value} s/it")
    device = _last(r" on (cuda:\d+|cpu);", text)
    return True, ", ".join(parts + ([f"on {device}"] if device else []))


def parse_train(text: str, ctx: Ctx) -> tuple:
    """A training run: its last log line."""
    return _iteration_figure(text)


def parse_train_with_save(text: str, ctx: Ctx) -> tuple:
    """A training run and the seconds its final synchronous checkpoint save took."""
    ok, figure = _iteration_figure(text)
    save = _last(r"Saved checkpoint \S+ in ([\d.]+)\s*s", text)
    return ok, figure + (f"; checkpoint save {save} s" if save else "; no checkpoint save logged")


def parse_resume(text: str, ctx: Ctx) -> tuple:
    """A resumed run: where it started (a fresh start is a failure here) and its last log line."""
    start = _last(r"Starting training from iteration (\d+) to (\d+)", text)
    ok, figure = _iteration_figure(text)
    if not start or start[0] == "0":
        return False, "did not resume (started from iteration 0 or not at all); " + figure
    return ok, f"resumed at {start[0]} -> {start[1]}; " + figure


def parse_throughput(text: str, ctx: Ctx) -> tuple:
    """bench/train_throughput.py's last line, a JSON object."""
    line = _last(r"^\{.*\}$", text)
    if line is None:
        return False, "no JSON result line"
    r = json.loads(line)
    if r.get("benchmark") == "train_throughput_compile":
        return True, (f"eager {r['eager_tokens_per_s']:.0f} tok/s, compiled {r['compiled_tokens_per_s']:.0f} tok/s, "
                      f"ratio {r['ratio']:.2f}, compile {r['compile_seconds']:.0f} s")
    return True, (f"ours {r['ours_tokens_per_s']:.0f} tok/s (MFU {r['mfu_ours']:.1%}), HF {r['hf_tokens_per_s']:.0f} "
                  f"tok/s (MFU {r['mfu_hf']:.1%}), ratio {r['ratio']:.2f}")


def parse_stall(text: str, ctx: Ctx) -> tuple:
    """bench/checkpoint_stall.py's JSON line: the loop's stall per save, synchronous and async."""
    line = _last(r"^\{.*\}$", text)
    if line is None:
        return False, "no JSON result line"
    r = json.loads(line)
    return True, (f"{r['parameters'] / 1e6:.0f}M, {r['checkpoint_bytes'] / 2**30:.1f} GiB: stall sync "
                  f"{r['sync']['stall_s']:.2f} s, async {r['async']['stall_s']:.2f} s (first async "
                  f"{r['async']['first_stall_s']:.2f} s), step {r['step_s']:.3f} s")


def parse_pytest(text: str, ctx: Ctx) -> tuple:
    """pytest's summary line: counts of passed, failed, skipped ..."""
    line = _last(r"^=*\s*(\d+ (?:passed|failed|skipped|error|errors|deselected|xfailed|xpassed)\b.*?)\s*=*$", text)
    if line is None:
        return False, "no pytest summary"
    failed = re.search(r"(\d+) (failed|errors?)\b", line)
    return failed is None, re.sub(r" in [\d.]+s.*$", "", line)


# ----------------------------------------------------------------------------------------- steps
def _train(config: str, nproc: int, out: str, full: list, dry: list, resume: bool = False) -> Callable[[Ctx], list]:
    """tools/train.sh with ``full`` overrides, or in the dry run the tiny ones."""
    def cmd(ctx: Ctx) -> list:
        tiny = TINY_MT5 if config == MT5 else TINY_GPT
        extra = dry if ctx.dry else full
        base = [f"train.output_dir={ctx.work / out}", f"dataloader.train.cache_dir={ctx.work / 'cache'}"]
        return (["bash", "tools/train.sh", "tools/train_net.py", config, str(nproc), *base, *(tiny if ctx.dry else []),
                 *extra] + (["--resume"] if resume else []))
    return cmd


def _throughput(*full: str) -> Callable[[Ctx], list]:
    def cmd(ctx: Ctx) -> list:
        compile_ = ["--compile"] if "--compile" in full else []
        model = [a for i, a in enumerate(full) if i > 0 and full[i - 1] == "--model"]
        args = (["--smoke", "--device", "cpu", *compile_, *(["--model", model[0]] if model else [])] if ctx.dry
                else [*full, "--device", "cuda", "--dtype", "bf16"])
        return [ctx.python, "bench/train_throughput.py", *args]
    return cmd


def _pytest(marks: str) -> Callable[[Ctx], list]:
    # The dry run collects tests/gpu only (everything there skips on a CPU); on a GPU every test of the
    # suite with these marks runs (tests/gpu, the FP8, flex and fused-loss kernels ...).
    def cmd(ctx: Ctx) -> list:
        where = "tests/gpu" if ctx.dry else "tests"
        return [ctx.python, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-m", marks, "-rfEs",
                where]
    return cmd


NO_EVAL = "train.evaluation.enabled=False"
TRAINER_345M = ["train.train_iter=30", "train.log_period=10", "train.train_micro_batch_size=8",
                "train.global_batch_size=8", NO_EVAL]
TWO_RANKS = ["train.dist.backend=gloo", NO_EVAL, "train.log_period=10"]
STEPS = [
    # The mission's command as the recipe's docstring writes it for one GPU; only its length and folders change.
    # Both MT5 steps compile the whole model (train.compile=auto) with its flex kernels in their first steps.
    Step("mission_mt5", _train(MT5, 1, "mission", ["train.train_iter=20", "train.train_epoch=0", "train.log_period=5"],
                               ["train.train_iter=2", "train.train_epoch=0", NO_EVAL]), 240, parse_train),
    Step("gpu_tests", _pytest("gpu and not slow"), 300, parse_pytest),
    Step("demo_gpu", _train(GPT_DEMO, 1, "demo", ["train.train_iter=60", "train.amp.enabled=True", "train.log_period=20"],
                            ["train.train_iter=4", "train.amp.enabled=True"]), 150, parse_train),
    Step("resume_cpu", _train(GPT_DEMO, 1, "demo", ["train.train_iter=70", "train.amp.enabled=True",
                                                    "train.log_period=10"],
                              ["train.train_iter=6", "train.amp.enabled=True"], resume=True), 150, parse_resume,
         env={"CUDA_VISIBLE_DEVICES": ""}),
    Step("trainer_345M", _train(GPT_345M, 1, "gpt345M", TRAINER_345M, ["train.train_iter=3", NO_EVAL]), 180,
         parse_train_with_save),
    Step("fp8_345M", _train(GPT_345M, 1, "gpt345M_fp8", ["train.train_iter=20", *TRAINER_345M[1:], "train.fp8.enabled=True"],
                            ["train.train_iter=2", NO_EVAL, "train.fp8.enabled=True"]), 150, parse_train,
         cpu_refuses=True),
    Step("stall_345M", lambda ctx: [ctx.python, "bench/checkpoint_stall.py", *(
        ["--smoke"] if ctx.dry else ["--device", "cuda", "--config", GPT_345M, "--seq-length", "1024",
                                     "--micro-batch", "8", "--rounds", "2"])], 180, parse_stall),
    Step("tput_gpt_345M", _throughput("--size", "345M"), 150, parse_throughput),
    Step("tput_gpt_1.3B", _throughput("--size", "1.3B"), 180, parse_throughput),
    Step("tput_llama_1.1B", _throughput("--model", "llama", "--size", "1.1B"), 180, parse_throughput),
    Step("compile_345M", _throughput("--size", "345M", "--compile"), 240, parse_throughput),
    Step("mt5_1gpu", _train(MT5, 1, "mt5", ["train.dist.data_parallel_size=1", "train.dist.tensor_parallel_size=1",
                                            "train.zero_optimization.enabled=False", "train.train_micro_batch_size=16",
                                            "train.num_accumulation_steps=1", "train.train_iter=30",
                                            "train.train_epoch=0", "train.log_period=10", NO_EVAL],
                            ["train.dist.data_parallel_size=1", "train.dist.tensor_parallel_size=1",
                             "train.zero_optimization.enabled=False", "train.num_accumulation_steps=1",
                             "train.train_iter=3", "train.train_epoch=0", NO_EVAL]), 240, parse_train),
    Step("ranks_tp2", _train(GPT_DEMO, 2, "tp2", ["train.dist.tensor_parallel_size=2", "train.train_iter=20",
                                                  *TWO_RANKS],
                             ["train.dist.tensor_parallel_size=2", "train.train_iter=3", "train.dist.backend=gloo",
                              NO_EVAL]), 150, parse_train),
    Step("ranks_zero3", _train(GPT_DEMO, 2, "tp2", ["train.zero_optimization.enabled=True",
                                                    "train.zero_optimization.stage=3", "train.train_iter=30",
                                                    *TWO_RANKS],
                               ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=3",
                                "train.train_iter=5", "train.dist.backend=gloo", NO_EVAL], resume=True), 150,
         parse_resume),
    Step("gpu_tests_slow", _pytest("gpu and slow"), 420, parse_pytest),
]
STEP_NAMES = [s.name for s in STEPS]


# ----------------------------------------------------------------------------------------- running
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_step(step: Step, ctx: Ctx, timeout: float, log_path: Path) -> tuple:
    """Run one step in a process group of its own; (status, seconds, text). A step past its limit
    gets SIGTERM, then SIGKILL 10 s later, and its log so far."""
    argv = step.cmd(ctx)
    env = {**ctx.env, **step.env, "PORT": str(_free_port())}
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(f'{k}={shlex.quote(v)}' for k, v in step.env.items())} {shlex.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            status = f"timeout {timeout:.0f} s"
    return status, time.monotonic() - t0, log_path.read_text(errors="replace")


def device_and_torch(ctx: Ctx) -> tuple:
    """(device name, torch version) as the steps' interpreter sees them."""
    code = ("import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'); "
            "print(torch.__version__)")
    r = subprocess.run([ctx.python, "-c", code], cwd=ROOT, env=ctx.env, capture_output=True, text=True, timeout=120)
    lines = r.stdout.split("\n")
    if r.returncode != 0 or len(lines) < 2:
        return "unknown (torch failed to import)", r.stderr.strip().splitlines()[-1:] or ["?"]
    return lines[0], lines[1]


def _error_line(text: str) -> str | None:
    """What a failed step says: the project's one `error:` line, else the last exception line (torchrun's
    own report after it only says that a worker failed)."""
    return (_last(r"^error: .*$", text) or _last(r"^\[rank\d+\]: [\w.]*(?:Error|Exception)\b.*$", text)
            or _last(r"^[\w.]*(?:Error|Exception)\b.*$", text))


def table(rows: list, device: str, torch_version: str, dry: bool) -> str:
    """The Markdown table printed last."""
    head = [f"device: {device}; torch {torch_version}" + ("; DRY RUN (tiny sizes on the CPU)" if dry else ""), "",
            "| step | status | seconds | figure |", "| --- | --- | ---: | --- |"]
    body = [f"| {r['step']} | {r['status']} | {r['seconds']:.0f} | {r['figure']} |" for r in rows]
    return "\n".join(head + body) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options; see ``--help``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for table.md, results.json, gpu.log, logs.tar.gz")
    p.add_argument("--dry-run", action="store_true", help="the same steps on the CPU at tiny sizes")
    p.add_argument("--only", default="", help=f"comma-separated steps to run, of: {', '.join(STEP_NAMES)}")
    p.add_argument("--skip", default="", help="comma-separated steps not to run")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for all steps (default 570 on a GPU, 1800 in the dry run); a step gets what is left")
    p.add_argument("--work", default=None, help="folder for the runs' outputs (default: a temporary one)")
    p.add_argument("--keep-work", action="store_true", help="keep --work (checkpoints) after the run")
    args = p.parse_args(argv)
    for opt in ("only", "skip"):
        names = [n for n in getattr(args, opt).split(",") if n]
        unknown = [n for n in names if n not in STEP_NAMES]
        if unknown:
            p.error(f"--{opt}: unknown step {unknown[0]!r}; steps are {', '.join(STEP_NAMES)}")
        setattr(args, opt, names)
    if args.budget is None:
        args.budget = 1800.0 if args.dry_run else 570.0
    return args


def main(argv=None) -> int:
    """Run the steps, write the files under --out, print the table last; non-zero if a step failed."""
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="libai_gpu_"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    env = dict(os.environ)
    # The checkout first, the caller's PYTHONPATH (a device's .gpu/site) kept after it.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHON", sys.executable)
    env["PYTHONUNBUFFERED"] = "1"
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU's, even on a GPU machine
        env.setdefault("OMP_NUM_THREADS", "1")
    ctx = Ctx(dry=args.dry_run, work=work, python=env["PYTHON"], env=env)
    device, torch_version = device_and_torch(ctx)
    print(f"device: {device}; torch {torch_version}; work {work}; budget {args.budget:.0f} s", flush=True)

    rows, start = [], time.monotonic()
    with open(out / "gpu.log", "w") as combined:
        for i, step in enumerate(STEPS):
            if (args.only and step.name not in args.only) or step.name in args.skip:
                continue
            left = args.budget - (time.monotonic() - start)
            if left < 15:
                rows.append(dict(step=step.name, status="not run", seconds=0.0, figure="budget spent"))
                continue
            log_path = work / "logs" / f"{i:02d}_{step.name}.log"
            print(f"[{time.monotonic() - start:5.0f} s] {step.name} (limit {min(step.timeout, left):.0f} s)", flush=True)
            status, seconds, text = run_step(step, ctx, min(step.timeout, left), log_path)
            ok, figure = step.parse(text, ctx) if status == "ok" else (False, "")
            if status == "ok" and not ok:
                status = "failed check"
            elif status != "ok":
                error = _error_line(text)
                if error and step.cpu_refuses and ctx.dry:
                    status = "refused on CPU (expected)"
                figure = (error or (text.strip().splitlines() or [""])[-1])[:200]
            rows.append(dict(step=step.name, status=status, seconds=seconds, figure=figure.replace("|", "/")))
            combined.write(f"\n===== {step.name}: {status} in {seconds:.0f} s =====\n{text}")
            combined.flush()
            print(f"        {status} in {seconds:.0f} s: {rows[-1]['figure']}", flush=True)

    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(work / "logs", arcname="logs")
        for pattern in ("*/metrics.json", "*/config.yaml", "*/log.txt*"):
            for path in sorted(work.glob(pattern)):
                tar.add(path, arcname=f"runs/{path.relative_to(work)}")
    text = table(rows, device, torch_version, args.dry_run)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps(dict(device=device, torch=torch_version, dry_run=args.dry_run,
                                                      steps=rows), indent=1))
    if not args.keep_work and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + text, flush=True)
    good = ("ok", "refused on CPU (expected)")
    return 0 if all(r["status"] in good for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
