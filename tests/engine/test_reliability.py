"""Crashes, signals, partial and corrupt checkpoints, full disks, diverging losses, restarts."""
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.launch import ROOT, env, losses, one_error_line, tiny, train_cmd, train_net, train_sh, tree_snapshot

BASE = ["train.evaluation.enabled=False"]


def _reference(tmp_path, args):
    out = tmp_path / "ref"
    r = train_net(tiny(out, tmp_path / "cache", *args))
    assert r.returncode == 0, r.stderr[-3000:]
    return losses(out)


def _start(out, tmp_path, args):
    return subprocess.Popen(train_cmd(tiny(out, tmp_path / "cache", *args)), cwd=ROOT, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(pred, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.002)
    return False


def _resume_and_compare(out, tmp_path, args, expected, resumed_from):
    start = int(resumed_from.split("_")[1]) + 1
    r = train_net(tiny(out, tmp_path / "cache", *args) + ["--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(out)
    assert sorted(got) == sorted(expected)
    for it in range(start + 1, max(expected) + 1):
        assert got[it] == expected[it], (it, got[it], expected[it])
    return r


@pytest.mark.slow  # tests/engine/test_process_faults.py sends SIGTERM to torchrun and to train.sh by default
def test_sigterm_saves_at_step_boundary_then_resume_matches(tmp_path):
    args = [*BASE, "train.train_iter=30", "train.checkpointer.period=1000"]
    expected = _reference(tmp_path, args)
    out = tmp_path / "run"
    p = _start(out, tmp_path, args)
    assert _wait_for(lambda: len(losses(out)) >= 5)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Stopped by SIGTERM after iteration" in stdout
    name = (out / "last_checkpoint").read_text().strip()
    assert not (out / "model_final").exists()
    # The signal checkpoint is taken after the step during which it arrived: nothing is lost.
    assert int(name.split("_")[1]) + 1 == max(losses(out))
    _resume_and_compare(out, tmp_path, args, expected, name)


@pytest.mark.slow  # tests/engine/test_crash_resume.py kills the whole job during saves by default
@pytest.mark.parametrize("delay_rows", [3, 7])
def test_sigkill_during_checkpoint_save_keeps_previous_and_resume_matches(tmp_path, delay_rows):
    # A wider model makes a save take long enough to be caught in the act.
    args = [*BASE, "train.train_iter=24", "train.checkpointer.period=2", "model.cfg.hidden_size=256",
            "model.cfg.ffn_hidden_size=1024"]
    expected = _reference(tmp_path, args)
    out = tmp_path / "run"
    p = _start(out, tmp_path, args)
    assert _wait_for(lambda: len(losses(out)) >= delay_rows)
    caught = _wait_for(lambda: any(d.suffix == ".tmp" for d in out.iterdir() if d.is_dir()), timeout=60)
    p.send_signal(signal.SIGKILL)
    p.communicate()
    if not caught:
        pytest.skip("the run finished its saves before the test could catch one in progress")
    partial = [d for d in out.iterdir() if d.is_dir() and d.suffix == ".tmp"]
    name = (out / "last_checkpoint").read_text().strip()
    assert (out / name / ".metadata").exists()
    _resume_and_compare(out, tmp_path, args, expected, name)
    if partial:
        # A kill after the manifest was written leaves a complete .tmp, which start-up publishes.
        log = (out / "log.txt").read_text()
        assert "Removed partial checkpoint" in log or "Published" in log
    assert not [d for d in out.iterdir() if d.suffix == ".tmp"]


def test_partial_checkpoint_left_by_a_crash_is_removed_with_a_log_line(tmp_path):
    args = [*BASE, "train.train_iter=6", "train.checkpointer.period=3"]
    out = tmp_path / "run"
    r = train_net(tiny(out, tmp_path / "cache", *args))
    assert r.returncode == 0, r.stderr[-3000:]
    partial = out / "model_0000009.tmp"
    shutil.copytree(out / "model_0000002", partial)
    (partial / ".metadata").unlink()
    r = train_net(tiny(out, tmp_path / "cache", *args, "train.train_iter=8") + ["--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Removed partial checkpoint" in (out / "log.txt").read_text()
    assert not partial.exists()


def test_resume_from_corrupt_checkpoint_is_refused_and_nothing_changes(tmp_path):
    args = [*BASE, "train.train_iter=4", "train.checkpointer.period=2"]
    out = tmp_path / "run"
    assert train_net(tiny(out, tmp_path / "cache", *args)).returncode == 0
    (out / "model_final" / ".metadata").unlink()
    before = tree_snapshot(out)
    r = train_net(tiny(out, tmp_path / "cache", *args) + ["--resume"])
    assert r.returncode == 1
    assert "corrupt" in one_error_line(r)
    assert tree_snapshot(out) == before


def test_max_to_keep_keeps_the_newest_checkpoints(tmp_path):
    out = tmp_path / "run"
    r = train_net(tiny(out, tmp_path / "cache", *BASE, "train.train_iter=10", "train.checkpointer.period=2",
                       "train.checkpointer.max_to_keep=1"))
    assert r.returncode == 0, r.stderr[-3000:]
    periodic = sorted(d.name for d in out.glob("model_0*"))
    assert periodic == ["model_0000007"]
    assert (out / "model_final").exists()


def test_full_disk_during_save_keeps_previous_checkpoint(tmp_path):
    """On a real 1 MiB filesystem the first checkpoint (about 0.8 MiB) fits and the second does not: DCP's
    CheckpointException becomes one UsageError, the partial files go and the previous checkpoint stays."""
    from libai_lite.checkpoint import Checkpointer
    from libai_lite.checkpoint.integrity import verify_checkpoint
    from libai_lite.utils.errors import UsageError
    from tests.launch import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "disk", "1m") as disk:
        model = torch.nn.Linear(256, 256)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.ones(1, 256)).sum().backward()
        opt.step()  # Adam's two moments: three copies of the weights per checkpoint
        ck = Checkpointer(model, opt, str(disk))
        ck.save("model_0000001", {"iteration": 1})
        with pytest.raises(UsageError, match=r"model_0000002 failed \(OSError: \[Errno 28\] No space left on device\); "
                                             r"it needs about .* are free there; .*model_0000001 is kept"):
            ck.save("model_0000002", {"iteration": 2})
        assert (disk / "last_checkpoint").read_text() == "model_0000001"
        assert sorted(p.name for p in disk.iterdir()) == ["last_checkpoint", "model_0000001"]
        verify_checkpoint(str(disk / "model_0000001"))
        assert ck.load(str(disk / "model_0000001"))["iteration"] == 1


def test_diverging_loss_stops_with_the_iteration_and_no_checkpoint_over_good_one(tmp_path):
    out = tmp_path / "run"
    args = [*BASE, "train.train_iter=40", "train.checkpointer.period=1000", "optim.lr=1e6",
            "optim.params.clip_grad_max_norm=null", "train.warmup_ratio=0"]
    r = train_net(tiny(out, tmp_path / "cache", *args))
    assert r.returncode == 1
    line = one_error_line(r)
    assert "at iteration" in line and "diverged" in line
    assert not (out / "model_final").exists()


def test_nonfinite_batches_are_skipped_up_to_the_limit():
    from libai_lite.engine.trainer import Trainer
    from libai_lite.model import LOSS
    from libai_lite.utils.events import EventStorage

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            return {"loss": (self.w * x).sum()}

    batches = [{"x": torch.tensor([1.0])}, {"x": torch.tensor([float("nan")])}, {"x": torch.tensor([2.0])},
               {"x": torch.tensor([float("inf")])}]
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    trainer = Trainer(model, batches, opt, sched, metrics={"loss": LOSS}, max_skipped_nonfinite=1)
    trainer.storage = EventStorage()
    for i in range(3):
        trainer.iter = i
        trainer.run_step()
    assert trainer.skipped_nonfinite == 1
    assert model.w.item() == pytest.approx(1.0 - 0.1 - 0.2)
    trainer.iter = 3
    with pytest.raises(FloatingPointError, match="at iteration 3"):
        trainer.run_step()


def test_restart_budget_recovers_from_a_killed_rank(tmp_path):
    """MAX_RESTARTS=1: one worker killed mid-run; torchrun restarts, the job resumes and finishes."""
    args = [*BASE, "train.train_iter=16", "train.checkpointer.period=4",
            "model.cfg.attention_dropout_prob=0.0", "model.cfg.output_dropout_prob=0.0"]
    ref = tmp_path / "ref"
    r = train_sh(2, tiny(ref, tmp_path / "cache", *args))
    assert r.returncode == 0, r.stderr[-3000:]
    expected = losses(ref)
    out = tmp_path / "run"
    from tests.launch import free_port

    p = subprocess.Popen(["bash", "tools/train.sh", "tools/train_net.py", "projects/GPT/configs/gpt2_pretrain.py", "2",
                          *tiny(out, tmp_path / "cache", *args)], cwd=ROOT,
                         env=env(PORT=str(free_port()), MAX_RESTARTS="1"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert _wait_for(lambda: len(losses(out)) >= 9, timeout=180)
    workers = subprocess.run(["pgrep", "-f", f"train.output_dir={out}"], capture_output=True, text=True).stdout.split()
    # The workers are the train_net.py processes (not bash, not torchrun itself).
    victims = [pid for pid in workers
               if "tools/train_net.py" in Path(f"/proc/{pid}/cmdline").read_text(errors="ignore").replace("\0", " ")
               and "torch.distributed.run" not in Path(f"/proc/{pid}/cmdline").read_text(errors="ignore")]
    assert victims, workers
    os.kill(int(victims[-1]), signal.SIGKILL)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-3000:]
    assert "Resumed from" in (out / "log.txt").read_text()
    got = losses(out)
    assert sorted(got) == sorted(expected)
    for it in expected:
        assert got[it] == pytest.approx(expected[it], rel=1e-5), it


def _worker_pids(out) -> dict:
    """global rank -> pid of the train_net.py workers writing to `out` (read from /proc)."""
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = dict(kv.split(b"=", 1) for kv in (entry / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if any(b"train_net.py" in c for c in cmdline) and f"train.output_dir={out}".encode() in cmdline \
                and b"RANK" in environ:
            pids[int(environ[b"RANK"])] = int(entry.name)
    return pids


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the workers through /proc (Linux)")
def test_stuck_rank_becomes_an_error_naming_the_rank_and_the_operation(tmp_path):
    """SIGSTOP one rank mid-run: the other gives up after train.dist.timeout with one line saying
    which rank it is, which collective and step it waited in, and which rank did not arrive."""
    from tests.launch import free_port

    out = tmp_path / "out"
    args = tiny(out, tmp_path / "cache", *BASE, "train.train_iter=100000", "train.dist.timeout=5",
                "train.checkpointer.period=100000")
    p = subprocess.Popen(["bash", "tools/train.sh", "tools/train_net.py", "projects/GPT/configs/gpt2_pretrain.py",
                          "2", *args], cwd=ROOT, env=env(PORT=str(free_port())), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: len(losses(out)) >= 3), "training did not start"
        pids = _worker_pids(out)
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGSTOP)
        # Rank 0 gives up after the 5 s timeout; then the stopped rank is cleared away, as an operator would.
        assert _wait_for(lambda: not Path(f"/proc/{pids[0]}").exists() or
                         (Path(f"/proc/{pids[0]}/stat").read_text().split()[2] == "Z"), timeout=60)
        os.kill(pids[1], signal.SIGKILL)
        _, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0
    line = one_error_line(subprocess.CompletedProcess(p.args, p.returncode, "", stderr))
    assert line.startswith("error: rank 0 timed out after 5 s in "), line
    assert " during " in line and " at iteration " in line, line
    assert "rank(s) [1] did not arrive" in line, line


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the workers through /proc (Linux)")
def test_a_killed_dataloader_worker_is_one_line_naming_where_and_a_failed_exit(tmp_path):
    """kill -9 of one DataLoader worker (what the out-of-memory killer does) was torch's traceback, raised from
    its SIGCHLD handler wherever the step was."""
    from tests.launch import job_pids, start_train_sh

    out = tmp_path / "run"
    p = start_train_sh(1, tiny(out, tmp_path / "cache", *BASE, "dataloader.train.num_workers=2",
                               "train.train_iter=100000", "train.checkpointer.period=100000"))
    try:
        assert _wait_for(lambda: len(losses(out)) >= 2, timeout=180), p.stderr.read() if p.poll() else ""
        pids = job_pids(out)
        parent = {pid: int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) for pid in pids}
        cmdline = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in pids}
        # A DataLoader worker is a fork of a rank process (train_net.py itself, not torchrun or train.sh).
        ranks = [pid for pid in pids if b"train_net.py\0--config-file" in cmdline[pid]
                 and b"torch.distributed.run" not in cmdline[pid]]
        loaders = [pid for pid in ranks if parent[pid] in ranks]
        assert len(loaders) == 2, loaders
        os.kill(loaders[0], signal.SIGKILL)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    r = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    line = one_error_line(r)
    assert p.returncode != 0
    # torch words it by where it notices: its SIGCHLD handler, or the queue read that finds the worker gone.
    # Under load the batch it was handing over can break first.
    assert line.startswith((f"error: DataLoader worker (pid {loaders[0]}) is killed by signal: Killed during ",
                            f"error: DataLoader worker (pid(s) {loaders[0]}) exited unexpectedly during ",
                            "error: a DataLoader worker died while handing over a batch (")), line
    assert " at iteration " in line and "lower dataloader.train.num_workers" in line and "--resume" in line, line
    assert _wait_for(lambda: not job_pids(out), timeout=30), job_pids(out)
