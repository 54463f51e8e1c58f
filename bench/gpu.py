#!/usr/bin/env python
"""Check and measure the project on one CUDA GPU in one command: its recipes, fast paths and speeds.

    bash bench/gpu.sh --out DIR                 # on a GPU machine: what fits 540 s, most important first
    bash bench/gpu.sh --out DIR --estimates OLD/results.json --budget 300   # plan from a previous call's times
    bash bench/gpu.sh --out DIR --dry-run       # every step on the CPU at tiny sizes, and the plan for an H100
    bash bench/gpu.sh --out DIR --only gpu_tests,resume_cpu    # some steps (--skip for the others)

Each step has its own time limit and log; its row is added to table.md and results.json under --out as
it ends, so a call cut off keeps what it measured. The steps, the plan and the files: bench/README.md,
section "gpu.py: how it measures"; the steps themselves: bench/gpu_steps.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_steps import (DEVICE_CHECK, GRACE, MEASURED_H200, PREDICTED, STEP_NAMES, STEPS, Ctx,  # noqa: E402,F401
                       Step, _last, parse_pytest, parse_resume, parse_throughput, parse_train, parse_train_with_save)

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("H100", "H200")
DRY_LIMIT = 600.0  # seconds per step in the dry run, which has no budget: tiny sizes on a loaded CPU


# ----------------------------------------------------------------------------------------- planning
def device_kind(name: str) -> str | None:
    """The estimates' device kind of a device name ("NVIDIA H100 80GB HBM3" -> "H100"), or None."""
    return next((kind for kind in KINDS if kind in name), None)


def load_estimates(path: str | Path) -> dict:
    """Step -> (seconds, source) from a previous call's results.json. A step that ended (ok or not) gives its
    time; one stopped at its limit or cut off gives a lower bound, kept only where it exceeds the prediction."""
    data = json.loads(Path(path).read_text())
    source = f"measured {data.get('device', '?')}"
    found = {}
    for row in data.get("steps", []):
        status = row.get("status", "")
        if status in ("skipped", "not run") or not row.get("seconds"):
            continue
        lower = status.startswith(("timeout", "cut off"))
        found[row["step"]] = (float(row["seconds"]), source + (" (lower bound: it was stopped)" if lower else ""))
    if data.get("device_check_s"):
        found["device check"] = (float(data["device_check_s"]), source)
    return found


def estimates_for(steps: list, kind: str, measured: dict | None = None) -> dict:
    """Step name (and "device check") -> (seconds, source): a previous call's measured times where given
    (a lower bound only where above the built-in figure), else the built-in estimates for ``kind``."""
    base = kind if kind in KINDS else "H100"
    note = "" if kind in KINDS else f" (no estimates for {kind}: H100's)"
    table = {"device check": DEVICE_CHECK, **{s.name: s.estimate for s in steps}}
    out = {}
    for name, per_kind in table.items():
        seconds, source = per_kind[base]
        out[name] = (seconds, source + note)
        if measured and name in measured:
            m_seconds, m_source = measured[name]
            if "lower bound" not in m_source or m_seconds > seconds:
                out[name] = (m_seconds, m_source)
    return out


def plan(names: list, estimates: dict, budget: float, spent: float = 0.0, grace: float = GRACE,
         needs: dict | None = None) -> list:
    """Which steps fit ``budget`` seconds: in order, a step runs if what is planned so far, its estimate and one
    ``grace`` (the seconds a step stopped at the budget's end takes to stop) fit; a step that does not is
    skipped and the next ones are still tried. ``spent``: seconds already gone (the device check);
    ``needs``: step -> the step whose output it continues, skipped where that one is.
    Returns dicts: step, seconds, source, run (bool), at (planned start), reason."""
    rows, used = [], spent
    for name in names:
        seconds, source = estimates[name]
        left = budget - used
        need = (needs or {}).get(name)
        if need is not None and not any(r["step"] == need and r["run"] for r in rows):
            rows.append(dict(step=name, seconds=seconds, source=source, run=False, at=None,
                             reason=f"continues {need}, which does not run"))
        elif used + seconds + grace <= budget:
            rows.append(dict(step=name, seconds=seconds, source=source, run=True, at=used,
                             reason=f"fits: starts at {used:.0f} s, {left - seconds:.0f} s left after it"))
            used += seconds
        else:
            rows.append(dict(step=name, seconds=seconds, source=source, run=False, at=None,
                             reason=f"needs {seconds:.0f} s + {grace:.0f} s grace, {left:.0f} s left"))
    return rows


def plan_text(rows: list, budget: float, kind: str, spent: tuple) -> str:
    """The plan and its reasoning, one line a step, then the sum and what is cut."""
    check_s, check_source = spent
    lines = [f"plan for {kind}, budget {budget:.0f} s from gpu.py's start: device check {check_s:.0f} s "
             f"({check_source}), then the steps in order of what they answer; a step runs if its estimate and "
             f"{GRACE:.0f} s of grace fit what is left"]
    for r in rows:
        lines.append(f"  {'run ' if r['run'] else 'SKIP'} {r['step']:<16} {r['seconds']:5.0f} s  {r['source']:<30} "
                     f"{r['reason']}")
    run = [r for r in rows if r["run"]]
    total = check_s + sum(r["seconds"] for r in run)
    cut = [r["step"] for r in rows if not r["run"]]
    terms = " + ".join(f"{r['seconds']:.0f}" for r in run) or "0"
    lines.append(f"sum: {check_s:.0f} + {terms} = {total:.0f} s, "
                 f"+ {GRACE:.0f} s grace = {total + GRACE:.0f} s of {budget:.0f}; "
                 + (f"cut: {', '.join(cut)} (each would pass the budget where it stands)" if cut else "nothing cut"))
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------- running
class Cut(Exception):
    """gpu.py itself got a signal (the call's limit, Ctrl-C): the step running is stopped and recorded."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum, frame):
    raise Cut(signum)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's process group, SIGKILL after 5 s; at most GRACE seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=GRACE / 2)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, ctx: Ctx, timeout: float, log_path: Path) -> tuple:
    """Run one step in a process group of its own; (status, seconds, text). A step past its limit is stopped
    (``_stop``) and returns its log so far; a signal to gpu.py stops it too and raises ``Cut`` after."""
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
            _stop(proc)
            status = f"timeout {timeout:.0f} s"
        except Cut:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the caller's group gets one; finish writing
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            _stop(proc)
            raise
    return status, time.monotonic() - t0, log_path.read_text(errors="replace")


def device_and_torch(ctx: Ctx, timeout: float) -> tuple:
    """(device name, torch version) as the steps' interpreter sees them."""
    code = ("import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'); "
            "print(torch.__version__)")
    try:
        r = subprocess.run([ctx.python, "-c", code], cwd=ROOT, env=ctx.env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"unknown (torch's import took over {timeout:.0f} s)", "?"
    lines = r.stdout.split("\n")
    if r.returncode != 0 or len(lines) < 2:
        return "unknown (torch failed to import)", (r.stderr.strip().splitlines()[-1:] or ["?"])[0]
    return lines[0], lines[1]


def _error_line(text: str) -> str | None:
    """What a failed step says: the project's one `error:` line, else the last exception line (torchrun's
    own report after it only says that a worker failed)."""
    return (_last(r"^error: .*$", text) or _last(r"^\[rank\d+\]: [\w.]*(?:Error|Exception)\b.*$", text)
            or _last(r"^[\w.]*(?:Error|Exception)\b.*$", text))


def table(rows: list, device: str, torch_version: str, dry: bool) -> str:
    """The Markdown table, rewritten as each step ends and printed last."""
    head = [f"device: {device}; torch {torch_version}" + ("; DRY RUN (tiny sizes on the CPU)" if dry else ""), "",
            "| step | status | seconds | figure |", "| --- | --- | ---: | --- |"]
    body = [f"| {r['step']} | {r['status']} | {r['seconds']:.0f} | {r['figure']} |" for r in rows]
    return "\n".join(head + body) + "\n"


def _write(path: Path, text: str) -> None:
    """Write whole or not at all: a call killed mid-write leaves the previous version."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_files(out: Path, work: Path, rows: list, head: dict) -> None:
    """table.md, results.json and logs.tar.gz under ``out``, as they stand now."""
    _write(out / "table.md", table(rows, head["device"], head["torch"], head["dry_run"]))
    _write(out / "results.json", json.dumps({**head, "steps": rows}, indent=1))
    tmp = out / ".logs.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(work / "logs", arcname="logs")
        for pattern in ("*/metrics.json", "*/config.yaml", "*/log.txt*"):
            for path in sorted(work.glob(pattern)):
                tar.add(path, arcname=f"runs/{path.relative_to(work)}")
    os.replace(tmp, out / "logs.tar.gz")


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options; see ``--help``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for table.md, results.json, plan.md, gpu.log, logs.tar.gz")
    p.add_argument("--dry-run", action="store_true",
                   help="every step on the CPU at tiny sizes (no budget), and the plan --budget makes for --kind")
    p.add_argument("--only", default="", help=f"comma-separated steps to run, of: {', '.join(STEP_NAMES)}")
    p.add_argument("--skip", default="", help="comma-separated steps not to run")
    p.add_argument("--budget", type=float, default=540.0,
                   help="seconds for the whole call from gpu.py's start, device check included (default 540)")
    p.add_argument("--estimates", default=None,
                   help="a previous call's results.json: its measured step times replace the built-in estimates")
    p.add_argument("--kind", choices=KINDS, default=None,
                   help="device kind whose estimates plan (default: from the device's name; H100 in the dry run)")
    p.add_argument("--work", default=None, help="folder for the runs' outputs and caches (default: a temporary one)")
    p.add_argument("--keep-work", action="store_true", help="keep --work (checkpoints) after the run")
    args = p.parse_args(argv)
    for opt in ("only", "skip"):
        names = [n for n in getattr(args, opt).split(",") if n]
        unknown = [n for n in names if n not in STEP_NAMES]
        if unknown:
            p.error(f"--{opt}: unknown step {unknown[0]!r}; steps are {', '.join(STEP_NAMES)}")
        setattr(args, opt, names)
    if args.estimates and not Path(args.estimates).is_file():
        p.error(f"--estimates: {args.estimates} is not a file; give a previous call's results.json")
    return args


def _environment(args, work: Path) -> dict:
    env = dict(os.environ)
    # The checkout first, the caller's PYTHONPATH (a device's .gpu/site) kept after it.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHON", sys.executable)
    env["PYTHONUNBUFFERED"] = "1"
    # One inductor and one triton cache for every step of the call: a kernel one step compiled is
    # loaded, not compiled again, by the next step that needs it.
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(work / "cache" / "inductor"))
    env.setdefault("TRITON_CACHE_DIR", str(work / "cache" / "triton"))
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU's, even on a GPU machine
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def main(argv=None) -> int:
    """Plan, run the steps, write each row under --out as it ends, print the table last; non-zero if a
    step failed or the call was cut off."""
    t_start = time.monotonic()
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="libai_gpu_"))
    (work / "logs").mkdir(parents=True, exist_ok=True)
    env = _environment(args, work)
    ctx = Ctx(dry=args.dry_run, work=work, python=env["PYTHON"], env=env)
    elapsed = lambda: time.monotonic() - t_start  # noqa: E731

    device, torch_version = device_and_torch(ctx, timeout=max(1.0, min(120.0, args.budget - GRACE - elapsed())))
    check_s = elapsed()
    kind = args.kind or ("H100" if args.dry_run else device_kind(device) or "H100")
    selected = [s for s in STEPS if (not args.only or s.name in args.only) and s.name not in args.skip]
    names = {s.name for s in selected}
    measured = load_estimates(args.estimates) if args.estimates else None
    estimates = estimates_for(selected, kind, measured)
    # The dry run plans as the device would at its start, with the device check's estimate.
    rows_plan = plan([s.name for s in selected], estimates, args.budget,
                     spent=estimates["device check"][0] if args.dry_run else check_s,
                     needs={s.name: s.needs for s in selected if s.needs})
    reasoning = plan_text(rows_plan, args.budget, kind, estimates["device check"] if args.dry_run
                          else (check_s, "measured now"))
    _write(out / "plan.md", reasoning)
    print(f"device: {device}; torch {torch_version}; work {work}; budget {args.budget:.0f} s; device check "
          f"{check_s:.0f} s\n{reasoning}", flush=True)
    head = dict(device=device, torch=torch_version, dry_run=args.dry_run, budget=args.budget, kind=kind,
                device_check_s=round(check_s, 1), plan=rows_plan)
    rows, code = [], 0
    planned = {r["step"]: r for r in rows_plan}
    try:
        with open(out / "gpu.log", "w") as combined:
            for i, step in enumerate(STEPS):
                if step.name not in names:
                    continue
                left = args.budget - elapsed()
                seconds = estimates[step.name][0]
                if step.needs and step.needs in names and not any(
                        r["step"] == step.needs and r["status"] == "ok" for r in rows):
                    rows.append(dict(step=step.name, status="skipped", seconds=0.0,
                                     figure=f"continues {step.needs}, which did not end ok"))
                    print(f"skip {step.name}: {rows[-1]['figure']}", flush=True)
                    write_files(out, work, rows, head)
                    continue
                if not args.dry_run and seconds + GRACE > left:
                    why = planned[step.name]["reason"] if not planned[step.name]["run"] else \
                        f"needs {seconds:.0f} s + {GRACE:.0f} s grace, {left:.0f} s left (earlier steps ran long)"
                    rows.append(dict(step=step.name, status="skipped", seconds=0.0, figure=why))
                    print(f"skip {step.name}: {why}", flush=True)
                    write_files(out, work, rows, head)
                    continue
                limit = DRY_LIMIT if args.dry_run else min(step.limit(kind), left - GRACE)
                log_path = work / "logs" / f"{i:02d}_{step.name}.log"
                print(f"[{elapsed():5.0f} s] {step.name} (estimate {seconds:.0f} s, limit {limit:.0f} s): "
                      f"{step.answers}", flush=True)
                # Written as it starts too: a call killed outright (SIGKILL) still says which step it was in.
                rows.append(dict(step=step.name, status="running", seconds=0.0, figure=""))
                write_files(out, work, rows, head)
                t0 = time.monotonic()
                try:
                    status, took, text = run_step(step, ctx, limit, log_path)
                except Cut as cut:
                    rows[-1].update(status=f"cut off ({cut})", seconds=time.monotonic() - t0,
                                    figure="gpu.py was stopped while this step ran")
                    raise
                ok, figure = step.parse(text, ctx) if status == "ok" else (False, "")
                if status == "ok" and not ok:
                    status = "failed check"
                elif status != "ok":
                    error = _error_line(text)
                    if error and step.cpu_refuses and ctx.dry:
                        status = "refused on CPU (expected)"
                    figure = (error or (text.strip().splitlines() or [""])[-1])[:200]
                rows[-1].update(status=status, seconds=took, figure=figure.replace("|", "/"))
                combined.write(f"\n===== {step.name}: {status} in {took:.0f} s =====\n{text}")
                combined.flush()
                write_files(out, work, rows, head)
                print(f"        {status} in {took:.0f} s: {rows[-1]['figure']}", flush=True)
    except Cut as cut:
        code = 128 + cut.signum
        write_files(out, work, rows, head)
        print(f"stopped by {cut}: the rows so far are in {out / 'table.md'}", flush=True)
    if not args.keep_work and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + table(rows, device, torch_version, args.dry_run) + ("\n" + reasoning if args.dry_run else ""),
          flush=True)
    good = ("ok", "refused on CPU (expected)", "skipped")
    return code or (0 if all(r["status"] in good for r in rows) else 1)


if __name__ == "__main__":
    sys.exit(main())
