"""The job as a process: signals, killed launchers, two runs in one directory, full disks, resuming a finished run."""
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.launch import (ROOT, env, free_port, job_pids, losses, one_error_line, start_torchrun_train, start_train_sh,
                          tiny, train_cmd, train_net)

BASE = ["train.evaluation.enabled=False", "train.checkpointer.period=1000"]


def _rows(out) -> dict:
    """iteration -> the metrics.json row of a training step (the last one written for it)."""
    rows = {}
    for line in (Path(out) / "metrics.json").read_text().splitlines():
        row = json.loads(line)
        if "total_loss" in row:
            rows[row["iteration"]] = row
    return rows


@pytest.mark.slow
def test_resume_of_a_finished_run_with_more_iterations_continues_at_the_next_one(tmp_path):
    """train_iter=20, then --resume train_iter=30: iteration 21 runs, 160 -> 168 samples only after it,
    and from 21 on the lr is the lr a fresh 30-iteration run has (the schedule is rebuilt for 30)."""
    cache = tmp_path / "cache"
    fresh = tmp_path / "fresh"
    assert train_net(tiny(fresh, cache, *BASE, "train.train_iter=30")).returncode == 0
    out = tmp_path / "run"
    r = train_net(tiny(out, cache, *BASE, "train.train_iter=20"))
    assert r.returncode == 0, r.stderr[-3000:]
    state = json.loads((out / "model_final" / "trainer_state.json").read_text())
    assert (state["iteration"], state["consumed_samples"]) == (19, 20 * 8)
    r = train_net(tiny(out, cache, *BASE, "train.train_iter=30") + ["--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Starting training from iteration 20 to 30" in r.stdout
    rows, reference = _rows(out), _rows(fresh)
    assert sorted(rows) == list(range(1, 31))
    assert rows[20]["consumed_samples"] == 160 and rows[21]["consumed_samples"] == 168
    for it in range(21, 31):
        # The same float64 formula at the same iteration: equal, not close.
        assert rows[it]["lr"] == reference[it]["lr"], it
    state = json.loads((out / "model_final" / "trainer_state.json").read_text())
    assert (state["iteration"], state["consumed_samples"]) == (29, 30 * 8)


def _wait_for(pred, timeout=120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def _signal_run(tmp_path, start, send):
    """Train with a DataLoader worker; once 5 iterations are logged, `send(process)`; then wait for the end.
    Returns (out, completed process, reference losses of an uninterrupted 30-iteration run)."""
    args = [*BASE, "train.train_iter=30", "dataloader.train.num_workers=1"]
    cache = tmp_path / "cache"
    ref = tmp_path / "ref"
    r = train_net(tiny(ref, cache, *args))
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "run"
    p = start(tiny(out, cache, *args))
    try:
        assert _wait_for(lambda: len(losses(out)) >= 5), "training did not start"
        send(p)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return out, subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr), losses(ref), args


def _check_saved_and_resume(out, r, expected, args, tmp_path):
    assert "Stopped by SIGTERM after iteration" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    assert "is killed by signal" not in r.stderr
    name = (out / "last_checkpoint").read_text().strip()
    assert not (out / "model_final").exists()
    # Saved after the step during which the signal arrived: no logged iteration is lost.
    assert int(name.split("_")[1]) + 1 == max(losses(out))
    r = train_net(tiny(out, tmp_path / "cache", *args) + ["--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    got = losses(out)
    assert sorted(got) == sorted(expected)
    for it in expected:
        # The same computation from the same state on the same machine: equal.
        assert got[it] == expected[it], (it, got[it], expected[it])


@pytest.mark.slow  # the train.sh test below takes the same path (torchrun forwards it) with a DataLoader worker
def test_sigterm_to_torchrun_with_a_dataloader_worker_saves_then_resume_matches(tmp_path):
    """torchrun sends SIGTERM to each worker's process group, DataLoader workers included: the
    trainer still saves at the step boundary instead of crashing on a killed DataLoader worker."""
    out, r, expected, args = _signal_run(tmp_path, lambda a: start_torchrun_train(1, a),
                                         lambda p: p.send_signal(signal.SIGTERM))
    _check_saved_and_resume(out, r, expected, args, tmp_path)


def test_sigterm_to_train_sh_is_passed_on_and_no_process_remains(tmp_path):
    """train.sh (PID 1 of a container) forwards SIGTERM to torchrun and waits for it: a checkpoint,
    the status of a SIGTERM'd process, no traceback and no process of the job left behind."""
    out, r, expected, args = _signal_run(tmp_path, lambda a: start_train_sh(1, a),
                                         lambda p: p.send_signal(signal.SIGTERM))
    assert r.returncode == 128 + signal.SIGTERM, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert job_pids(out) == []
    _check_saved_and_resume(out, r, expected, args, tmp_path)


# (signals, the overrides, what the run has done when they are sent, what its log says it did after)
STOPS = {
    "sigterm": ([signal.SIGTERM], ["train.train_iter=100000"], lambda out: losses(out), "Stopped by SIGTERM after"),
    "two_sigints": ([signal.SIGINT, signal.SIGINT], ["train.train_iter=100000"], lambda out: losses(out),
                    "Stopped by SIGINT after"),
    # The evaluation after the last step: the stop saves model_final and the run ends, stopped all the same.
    "sigterm_in_the_last_evaluation": (
        [signal.SIGTERM], ["train.train_iter=2", "train.evaluation.enabled=True", "train.evaluation.eval_iter=5000"],
        lambda out: (out / "log.txt").exists() and "Evaluating valid window" in (out / "log.txt").read_text(),
        "evaluation stopped by a stop signal after"),
}


@pytest.mark.parametrize("case", sorted(STOPS))
def test_a_run_stopped_by_a_signal_saves_and_exits_with_the_signals_status_without_a_launcher(tmp_path, case):
    """python tools/train_net.py, as a user or a scheduler starts it, exited 0 after the signal's checkpoint, so
    the job looked finished; it now exits 128 + the signal (130 for Ctrl-C), as tools/train.sh does."""
    sent, extra, started, said = STOPS[case]
    out = tmp_path / "run"
    p = subprocess.Popen(train_cmd(tiny(out, tmp_path / "cache", *BASE, *extra)), cwd=ROOT, env=env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert _wait_for(lambda: started(out)), "the run did not get there"
        for sig in sent:
            os.killpg(p.pid, sig)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 128 + sent[0], stdout[-2000:] + stderr[-3000:]
    assert said in stdout and "Traceback" not in stderr, stdout[-2000:] + stderr[-3000:]
    name = (out / "last_checkpoint").read_text().strip()
    assert (out / name / "trainer_state.json").is_file()
    assert (name == "model_final") == (case == "sigterm_in_the_last_evaluation"), name


@pytest.mark.slow  # tests/engine/test_crash_resume.py checks no process outlives each kill by default
def test_kill_9_of_the_launcher_group_leaves_no_worker_and_resume_on_the_same_port_works(tmp_path):
    """kill -9 of train.sh's process group (torchrun's workers live in sessions of their own): the
    workers die with torchrun, and a --resume on the same port starts and finishes."""
    cache, out, port = tmp_path / "cache", tmp_path / "run", free_port()
    args = tiny(out, cache, *BASE, "train.train_iter=100000", "train.checkpointer.period=3",
                "dataloader.train.num_workers=1")
    p = start_train_sh(1, args, port=port)
    try:
        assert _wait_for(lambda: (out / "last_checkpoint").exists()), "no checkpoint was saved"
        assert len(job_pids(out)) >= 3  # bash, torchrun, the worker (and its DataLoader worker)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
        # torch's DataLoader worker checks for its trainer every 5 s.
        assert _wait_for(lambda: not job_pids(out), timeout=15), job_pids(out)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        for pid in job_pids(out):  # orphans of a broken run must not outlive the test
            os.kill(pid, signal.SIGKILL)
    done = max(losses(out))
    p = start_train_sh(1, args[:-3] + ["train.train_iter=" + str(done + 3), "train.checkpointer.period=3",
                                       "dataloader.train.num_workers=1", "--resume"], port=port)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr[-3000:]
    assert "Resumed from" in stdout
    assert "Took over the lock" in stdout
    assert (out / "model_final").exists()


def test_a_second_run_in_the_same_output_dir_is_refused_naming_the_first(tmp_path):
    """While a run trains in train.output_dir, a second (here two ranks under train.sh) is refused
    with one line naming the first's host and pid, and leaves the first's files alone."""
    from tests.launch import train_sh

    cache, out = tmp_path / "cache", tmp_path / "run"
    first = subprocess.Popen(train_cmd(tiny(out, cache, *BASE, "train.train_iter=100000")), cwd=ROOT, env=env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for(lambda: len(losses(out)) >= 2), "the first run did not start"
        config = (out / "config.yaml").read_text()
        r = train_sh(2, tiny(out, cache, *BASE, "train.train_iter=10"), timeout=120)
        assert r.returncode == 1
        line = one_error_line(r)
        assert f"is in use by another run (pid {first.pid} on host {socket.gethostname()}" in line, line
        assert (out / "config.yaml").read_text() == config
        assert "train.train_iter: 10" not in (out / "log.txt").read_text()
    finally:
        first.kill()
        first.communicate()


def test_a_stale_lock_of_a_dead_process_is_taken_over_and_released_at_exit(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    r = train_net(tiny(out, cache, *BASE, "train.train_iter=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"Took over the lock {out / '.lock'} left by pid {dead.pid} on host {socket.gethostname()}, which is gone" \
        in (out / "log.txt").read_text()
    assert not (out / ".lock").exists()
    # Released on an error too: a run that diverges leaves no lock behind.
    out = tmp_path / "diverged"
    r = train_net(tiny(out, cache, *BASE, "train.train_iter=40", "optim.lr=1e6", "optim.params.clip_grad_max_norm=null",
                       "train.warmup_ratio=0"))
    assert r.returncode == 1 and "diverged" in one_error_line(r)
    assert (out / "log.txt").exists() and not (out / ".lock").exists()


_FORKING_OWNER = """
import os, sys, time
from libai_lite.utils.process import OutputDirLock
OutputDirLock(sys.argv[1]).acquire()
if os.fork() == 0:
    sys.exit(0)  # a child ending normally runs atexit: it must not release the parent's lock
os.wait()
if os.fork() == 0:
    # The child speaks once the fork's hooks have run in it, so the test never races them.
    print(os.getpid(), flush=True)
    time.sleep(120)
    os._exit(0)
time.sleep(120)
"""


def test_the_run_lock_is_held_by_its_owner_only_not_by_the_processes_it_forks(tmp_path):
    """A forked child (a DataLoader worker) shares the lock's open file, and an flock stays held while any
    descriptor of it is open: the child closes its copy at the fork, so once the owner is killed the directory
    is free although the child lives on, and a child that ends does not remove its parent's lock."""
    import sys

    from libai_lite.utils.errors import UsageError
    from libai_lite.utils.process import OutputDirLock
    from tests.launch import env

    owner = subprocess.Popen([sys.executable, "-c", _FORKING_OWNER, str(tmp_path)], cwd=ROOT, env=env(),
                             stdout=subprocess.PIPE, text=True)
    child = int(owner.stdout.readline())
    try:
        assert (tmp_path / ".lock").exists()
        with pytest.raises(UsageError, match=f"in use by another run \\(pid {owner.pid} "):
            OutputDirLock(str(tmp_path)).acquire()
        owner.kill()
        owner.wait()
        assert os.path.exists(f"/proc/{child}")
        lock = OutputDirLock(str(tmp_path))
        lock.acquire()
        lock.release()
    finally:
        owner.kill()
        os.kill(child, signal.SIGKILL)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _state(pid: int):
    """The process's state letter (R, S, T, Z, ...), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_while_its_dataloader_worker_lives_and_the_run_ends_as_if_never_killed(
        tmp_path):
    """MAX_RESTARTS=1: the trainer is killed while its DataLoader worker lives on (stopped here once the trainer is
    dead, so it outlives the restart however long that takes; torch ends an orphaned worker within 5 s, a fast
    restart comes sooner). The restarted trainer takes the lock at once, resumes from the last checkpoint, and
    every iteration's loss is the uninterrupted run's."""
    from tests.launch import CONFIG, env

    cache = tmp_path / "cache"
    args = [*BASE, "train.train_iter=12", "train.checkpointer.period=4", "dataloader.train.num_workers=1"]
    r = train_net(tiny(tmp_path / "ref", cache, *args))
    assert r.returncode == 0, r.stderr[-3000:]
    expected = losses(tmp_path / "ref")
    out = tmp_path / "run"
    # Output to files: the stopped worker holds the job's stdout and stderr open until the test ends it.
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        p = subprocess.Popen(["bash", "tools/train.sh", "tools/train_net.py", CONFIG, "1", *tiny(out, cache, *args)],
                             cwd=ROOT, env=env(PORT=str(free_port()), MAX_RESTARTS="1"), stdout=stdout, stderr=stderr,
                             start_new_session=True)
    worker = None
    try:
        assert _wait_for(lambda: len(losses(out)) >= 6), "training did not start"
        pids = job_pids(out)
        trainer = next(pid for pid in pids if b"torch.distributed.run" in
                       Path(f"/proc/{_parent(pid)}/cmdline").read_bytes())
        torchrun, worker = _parent(trainer), next(pid for pid in pids if _parent(pid) == trainer)
        os.kill(trainer, signal.SIGKILL)
        # Stopped once it has left its dead trainer: a process group orphaned with a stopped member gets SIGHUP
        # and SIGCONT from the kernel.
        assert _wait_for(lambda: _state(worker) is not None and _parent(worker) != trainer, timeout=30)
        time.sleep(0.05)
        os.kill(worker, signal.SIGSTOP)
        assert _wait_for(lambda: _state(torchrun) in ("Z", None), timeout=300), "the job did not end"
        assert _state(worker) == "T", "the DataLoader worker did not outlive its trainer's restart"
        os.kill(worker, signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        if worker is not None and _state(worker) not in ("Z", None):
            os.kill(worker, signal.SIGKILL)
    log, err = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert p.returncode == 0, err[-3000:]
    assert "Resumed from" in log and "in use by another run" not in err
    got = losses(out)
    assert sorted(got) == sorted(expected) == list(range(1, 13))
    for it in expected:
        # The same computation from the same state on the same machine: equal.
        assert got[it] == expected[it], (it, got[it], expected[it])


@pytest.fixture
def small_disk(tmp_path):
    """A real 192 KiB filesystem (tmpfs) at tmp_path/disk; skipped where mounting is not permitted."""
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(disk)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


# One process with -m slow: the two-process run takes the same path and the rank coordination too.
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_full_disk_while_logging_stops_with_one_error_line_and_whole_rows(tmp_path, small_disk, nproc):
    """metrics.json, TensorBoard and log.txt fill the disk: one `error:` line naming the file, exit 1,
    every metrics.json line a whole row, and the run's earlier outputs kept. With two ranks the one
    whose write failed stops the other at the step boundary (no rank waits in a collective)."""
    from tests.launch import train_sh

    out = small_disk / "run"
    args = tiny(out, tmp_path / "cache", *BASE, "train.train_iter=100000")
    r = train_net(args) if nproc == 1 else train_sh(nproc, args, timeout=240)
    assert r.returncode == 1
    line = one_error_line(r)
    assert line.startswith(f"error: cannot write {out}/") and "No space left on device" in line, line
    assert "--resume" in line
    rows = [json.loads(x) for x in (out / "metrics.json").read_text().splitlines()]
    assert len(rows) > 10 and [row["iteration"] for row in rows] == list(range(1, len(rows) + 1))
    assert (out / "config.yaml").exists() and not [p for p in out.iterdir() if ".tmp" in p.name]


def test_full_disk_before_training_leaves_no_temporary(tmp_path, small_disk):
    out = small_disk / "run"
    out.mkdir()
    filler = small_disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    r = train_net(tiny(out, tmp_path / "cache", *BASE, "train.train_iter=5"))
    assert r.returncode == 1
    line = one_error_line(r)
    assert line.startswith(f"error: cannot write {out}/") and "No space left on device" in line, line
    assert not [p for p in out.iterdir() if ".tmp" in p.name], list(out.iterdir())
