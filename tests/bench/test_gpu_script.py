"""bench/gpu.sh, the one command that checks and measures a GPU: its dry run on the CPU (so a device's
first call is not the script's first run), its parsers on the log lines the project writes, its files."""
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from tests.launch import ROOT, env

sys.path.insert(0, str(ROOT / "bench"))
import gpu  # noqa: E402  (bench/gpu.py)


def _run(tmp_path, *args, timeout=600):
    return subprocess.run(["bash", "bench/gpu.sh", "--out", str(tmp_path / "out"), "--dry-run", *args], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_dry_run_of_demo_and_cpu_resume(tmp_path):
    """The first two steps end to end (train, then resume that checkpoint with CUDA hidden): the table
    printed last and the four files under --out."""
    r = _run(tmp_path, "--only", "demo_gpu,resume_cpu")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu.log", "logs.tar.gz", "plan.md", "results.json", "table.md"]
    table = (out / "table.md").read_text()
    assert table.rstrip() in r.stdout  # printed last, before the dry run's H100 plan
    assert table.startswith("device: cpu; torch ") and "DRY RUN" in table
    results = json.loads((out / "results.json").read_text())
    assert [s["step"] for s in results["steps"]] == ["demo_gpu", "resume_cpu"]
    assert all(s["status"] == "ok" for s in results["steps"]), results
    assert "resumed at 4 -> 6" in results["steps"][1]["figure"] and "on cpu" in results["steps"][1]["figure"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert f"logs/{gpu.STEP_NAMES.index('demo_gpu'):02d}_demo_gpu.log" in names and "runs/demo/metrics.json" in names, names
    assert "CUDA_VISIBLE_DEVICES=''" in (out / "gpu.log").read_text()


@pytest.mark.slow
def test_full_dry_run(tmp_path):
    """Every step at tiny sizes on the CPU: all pass, FP8 is refused as on any CPU."""
    r = _run(tmp_path, timeout=1800)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    statuses = {s["step"]: s["status"] for s in results["steps"]}
    assert list(statuses) == gpu.STEP_NAMES
    assert statuses.pop("fp8_345M") == "refused on CPU (expected)"
    assert set(statuses.values()) == {"ok"}, statuses
    assert r.returncode == 0


def test_unknown_step_is_refused():
    r = subprocess.run(["bash", "bench/gpu.sh", "--out", "/nonexistent", "--only", "demo"], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--only: unknown step 'demo'; steps are mission_mt5" in r.stderr


LOG = """[11/26 14:56:08 libai_lite]: Rank 0 of 1; layout pp=1 dp=1 tp=1 on cuda:0; global batch 8
[11/26 14:56:09 libai_lite]: Starting training from iteration 60 to 70
[11/26 14:56:10 libai_lite]: iteration: 70/70  consumed_samples: 560  total_loss: 6.7220  lm_loss: 6.7220  lr: 1.5e-04  \
grad_norm: 0.612  time: 0.0750 s/it  data_time: 0.0003 s/it  samples/s: 106.60  tokens/s: 109158  TFLOP/s/rank: 237.1  \
MFU: 24.0%  max_mem: 20.1G  eta: 0:00:00
[11/26 14:56:21 libai_lite]: Saved checkpoint output/model_final in 11.10s
"""


def test_parsers_read_the_project_s_log_lines():
    ok, figure = gpu.parse_train_with_save(LOG, None)
    assert ok and figure == ("iter 70, 0.0750 s/it, tok/s 109158, samples/s 106.60, MFU 24.0%, loss 6.7220, on cuda:0; "
                             "checkpoint save 11.10 s")
    ok, figure = gpu.parse_resume(LOG, None)
    assert ok and figure.startswith("resumed at 60 -> 70; iter 70")
    # A run that started afresh is not a resume, whatever it printed after.
    assert gpu.parse_resume(LOG.replace("iteration 60 to", "iteration 0 to"), None)[0] is False
    assert gpu.parse_train("no training here", None) == (False, "no iteration line")


def test_parsers_read_pytest_and_throughput_summaries():
    assert gpu.parse_pytest("....\n17 passed, 3 skipped in 250.12s (0:04:10)\n", None) == (True, "17 passed, 3 skipped")
    assert gpu.parse_pytest("== 2 failed, 15 passed in 99.1s ==", None) == (False, "2 failed, 15 passed")
    result = {"benchmark": "train_throughput", "ours_tokens_per_s": 105300.0, "hf_tokens_per_s": 60900.0,
              "mfu_ours": 0.258, "mfu_hf": 0.149, "ratio": 1.73}
    assert gpu.parse_throughput("table\n" + json.dumps(result), None) == (
        True, "ours 105300 tok/s (MFU 25.8%), HF 60900 tok/s (MFU 14.9%), ratio 1.73")


def test_a_failed_step_is_named_by_its_error_line():
    """The project's `error:` line when there is one, else the worker's exception, never torchrun's report."""
    crash = ("[rank0]: Traceback (most recent call last):\n[rank0]: TypeError: bad thing\n"
             "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n=====\n")
    assert gpu._error_line(crash) == "[rank0]: TypeError: bad thing"
    assert gpu._error_line("error: train.dist.backend='mpi' is not allowed\n" + crash).startswith("error: train.dist")
    assert gpu._error_line("all fine\n") is None


def test_a_dry_run_killed_mid_run_keeps_the_rows_of_its_finished_steps(tmp_path):
    """A user stops the call (SIGTERM to its process group, as `timeout` does) while its second step runs:
    table.md and results.json hold the first step's row, written when it ended, and the cut-off one."""
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", "bench/gpu.sh", "--out", str(out), "--dry-run", "--only", "demo_gpu,resume_cpu"],
                            cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                steps = json.loads((out / "results.json").read_text())["steps"]
            except (FileNotFoundError, json.JSONDecodeError):
                steps = []
            if len(steps) >= 2 and steps[-1]["status"] == "running":
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the dry run ended before its second step started"
        os.killpg(proc.pid, signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, stdout[-3000:]
    steps = json.loads((out / "results.json").read_text())["steps"]
    assert [s["step"] for s in steps] == ["demo_gpu", "resume_cpu"], steps
    assert steps[0]["status"] == "ok" and "on cpu" in steps[0]["figure"], steps
    assert steps[1]["status"] == "cut off (SIGTERM)", steps
    table = (out / "table.md").read_text()
    assert "| demo_gpu | ok |" in table and "| resume_cpu | cut off (SIGTERM) |" in table, table
    assert "plan for H100, budget 540 s" in stdout and (out / "plan.md").is_file()


def test_the_planner_skips_what_cannot_fit_and_still_takes_what_fits_after_it():
    """In order: a step runs if the plan so far, its estimate and one grace fit; a step too long is skipped
    with its reason, a shorter one after it still runs; a step continuing a skipped one is skipped."""
    estimates = {"a": (100.0, "measured"), "b": (300.0, "predicted"), "c": (50.0, "predicted"),
                 "d": (35.0, "predicted"), "e": (5.0, "predicted")}
    rows = gpu.plan(list(estimates), estimates, budget=200, spent=10, grace=10, needs={"e": "b"})
    assert [(r["step"], r["run"]) for r in rows] == [("a", True), ("b", False), ("c", True), ("d", False),
                                                     ("e", False)]
    assert rows[1]["reason"] == "needs 300 s + 10 s grace, 90 s left"
    # c ends at 160 s: d's 35 s fit the 40 s left, but not with the 10 s grace kept for a step stopped at the end.
    assert rows[3]["reason"] == "needs 35 s + 10 s grace, 40 s left" and rows[2]["at"] == 110
    assert rows[4]["reason"] == "continues b, which does not run"
    # The grace is counted once, for the step that may be stopped at the budget's end.
    assert [r["run"] for r in gpu.plan(["a", "c"], estimates, budget=160, spent=0, grace=10)] == [True, True]


def test_the_h100_plan_fits_540_s_and_answers_the_mission_first():
    """The built-in H100 estimates (all predicted): the planned sum with the device check and grace is at
    most 540 s, and the mission's recipe, the fast paths and the 345M MFU are in it."""
    estimates = gpu.estimates_for(gpu.STEPS, "H100")
    rows = gpu.plan(gpu.STEP_NAMES, estimates, 540, spent=estimates["device check"][0])
    run = [r["step"] for r in rows if r["run"]]
    assert run[:3] == ["mission_mt5", "fast_paths", "trainer_345M"], run
    total = estimates["device check"][0] + sum(estimates[n][0] for n in run) + gpu.GRACE
    assert total <= 540, total
    assert all(estimates[n][1] == "predicted" for n in gpu.STEP_NAMES)
    text = gpu.plan_text(rows, 540, "H100", estimates["device check"])
    assert f"= {total:.0f} s of 540; cut: " in text


def test_estimates_from_a_previous_call_replace_the_built_in_ones(tmp_path):
    """A step that ended gives its measured time; one stopped at its limit only a lower bound."""
    previous = {"device": "NVIDIA H100 80GB HBM3", "device_check_s": 7.5, "steps": [
        {"step": "mission_mt5", "status": "ok", "seconds": 81.0, "figure": ""},
        {"step": "fast_paths", "status": "timeout 40 s", "seconds": 40.0, "figure": ""},
        {"step": "gpu_tests", "status": "cut off (SIGTERM)", "seconds": 400.0, "figure": ""},
        {"step": "demo_gpu", "status": "skipped", "seconds": 0.0, "figure": ""}]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(previous))
    estimates = gpu.estimates_for(gpu.STEPS, "H100", gpu.load_estimates(path))
    assert estimates["mission_mt5"] == (81.0, "measured NVIDIA H100 80GB HBM3")
    assert estimates["device check"] == (7.5, "measured NVIDIA H100 80GB HBM3")
    assert estimates["fast_paths"] == gpu.estimates_for(gpu.STEPS, "H100")["fast_paths"]
    assert estimates["gpu_tests"][0] == 400.0 and "lower bound" in estimates["gpu_tests"][1]
    assert estimates["demo_gpu"][1] == "predicted"
    assert gpu.device_kind("NVIDIA H200") == "H200" and gpu.device_kind("NVIDIA A100-SXM4-80GB") is None


def test_a_call_whose_budget_is_spent_skips_in_one_line_and_runs_nothing(tmp_path):
    """Not a dry run: after the device check, 30 s cannot hold demo_gpu's 30 s estimate and its grace; the
    step is skipped with the reason in its row, and the call ends well."""
    out = tmp_path / "out"
    r = subprocess.run(["bash", "bench/gpu.sh", "--out", str(out), "--budget", "30", "--kind", "H100", "--only",
                        "demo_gpu,resume_cpu"], cwd=ROOT, env=env(CUDA_VISIBLE_DEVICES=""), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    steps = json.loads((out / "results.json").read_text())["steps"]
    assert [(s["step"], s["status"]) for s in steps] == [("demo_gpu", "skipped"), ("resume_cpu", "skipped")]
    assert steps[0]["figure"].startswith("needs 30 s + 10 s grace, ") and steps[1]["figure"] == (
        "continues demo_gpu, which did not end ok")
    assert "skip demo_gpu: needs 30 s" in r.stdout and not list((out.parent).glob("**/demo/metrics.json"))
