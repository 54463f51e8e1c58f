"""bench/gpu.sh, the one command that checks and measures a GPU: its dry run on the CPU (so a device's
first call is not the script's first run), its parsers on the log lines the project writes, its files."""
import json
import subprocess
import sys
import tarfile

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
    assert sorted(p.name for p in out.iterdir()) == ["gpu.log", "logs.tar.gz", "results.json", "table.md"]
    table = (out / "table.md").read_text()
    assert r.stdout.rstrip().endswith(table.rstrip())
    assert table.startswith("device: cpu; torch ") and "DRY RUN" in table
    results = json.loads((out / "results.json").read_text())
    assert [s["step"] for s in results["steps"]] == ["demo_gpu", "resume_cpu"]
    assert all(s["status"] == "ok" for s in results["steps"]), results
    assert "resumed at 4 -> 6" in results["steps"][1]["figure"] and "on cpu" in results["steps"][1]["figure"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/02_demo_gpu.log" in names and "runs/demo/metrics.json" in names, names
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
