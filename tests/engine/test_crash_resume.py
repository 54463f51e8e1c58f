"""Kill the whole job at random moments, resume, and get the losses of a run that was never killed.

The job is ended the way a user or a dying agent ends it: SIGKILL to the process group of
tools/train.sh (the script, torchrun and, through their parent-death signal, the workers). Moments
are drawn at random over the run, and some are chosen while a checkpoint is being written or
``model_best`` is being replaced, the windows where a crash can destroy the only good checkpoint.
After every kill the last checkpoint named by ``last_checkpoint`` must be complete, and the resumed
run must finish with every iteration's loss equal, bit for bit, to the uninterrupted run's.
"""
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.launch import CONFIG, ROOT, env, free_port, losses, tiny

# Saves every 2 iterations and an evaluation every 3 that replaces model_best when perplexity
# improves; a model wide enough that a save takes long enough to be caught in the act.
ARGS = ["train.train_iter=14", "train.checkpointer.period=2", "train.evaluation.enabled=True",
        "train.evaluation.eval_period=3", "model.cfg.hidden_size=128", "model.cfg.ffn_hidden_size=512"]


def _launch(out, cache, resume: bool) -> subprocess.Popen:
    args = tiny(out, cache, *ARGS) + (["--resume"] if resume else [])
    return subprocess.Popen(["bash", "tools/train.sh", "tools/train_net.py", CONFIG, "1", *args], cwd=ROOT,
                            env=env(PORT=str(free_port())), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _in_save(out: Path) -> bool:
    """A checkpoint is being written or replaced: a temporary or set-aside directory exists."""
    try:
        return any(d.is_dir() and (d.suffix == ".tmp" or (d.name.startswith("model_best") and d.name != "model_best"))
                   for d in out.iterdir())
    except FileNotFoundError:
        return False


def _wait(p: subprocess.Popen, pred, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None:
        if pred():
            return True
        time.sleep(0.002)
    return False


def _kill_job(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.communicate(timeout=60)


def _job_processes_gone(out: Path, timeout: float = 20) -> bool:
    """No process of the killed job is left (a worker training on would write into ``out``)."""
    needle = str(out).encode()
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if needle in f.read():
                        alive.append(pid)
            except OSError:
                continue
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _check_last_checkpoint(out: Path) -> None:
    marker = out / "last_checkpoint"
    if marker.exists():
        name = marker.read_text().strip()
        assert (out / name / ".metadata").is_file(), f"last_checkpoint names {name}, which is not complete"


def _reference(tmp_path) -> dict:
    out = tmp_path / "reference"
    p = _launch(out, tmp_path / "cache", resume=False)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    curve = losses(out)
    assert sorted(curve) == list(range(1, 15))
    return curve


def _crash_and_resume(tmp_path, reference: dict, kinds: list, seed: int) -> None:
    rng = random.Random(seed)
    # Runs take a few seconds to start (imports, the launcher): random moments cover start-up,
    # training and saving alike.
    out, cache, runs = tmp_path / "run_0", tmp_path / "cache", 0
    for i, kind in enumerate(kinds):
        p = _launch(out, cache, resume=(out / "last_checkpoint").exists())
        if kind == "random":
            caught = _wait(p, lambda: False, rng.uniform(0.5, 9.0)) or p.poll() is None
        else:
            caught = _wait(p, lambda: _in_save(out), 120)
        if p.poll() is not None:  # the run finished before the moment came: check it, start another
            _, err = p.communicate()
            assert p.returncode == 0, err[-3000:]
            _assert_same_losses(out, reference)
            runs += 1
            out = tmp_path / f"run_{runs}"
            continue
        _kill_job(p)
        assert _job_processes_gone(out), f"kill {i} ({kind}): a process of the job outlived its process group"
        _check_last_checkpoint(out)
        if _trained_to_the_end(out):  # killed after the last iteration's save: --resume has nothing left to train
            _assert_same_losses(out, reference)
            runs += 1
            out = tmp_path / f"run_{runs}"
    if _trained_to_the_end(out):
        return
    p = _launch(out, cache, resume=(out / "last_checkpoint").exists())
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-3000:]
    _assert_same_losses(out, reference)


def _trained_to_the_end(out: Path) -> bool:
    """The last checkpoint holds all 14 iterations (model_final, or the final evaluation's model_best)."""
    marker = out / "last_checkpoint"
    if not marker.exists():
        return False
    state = json.loads((out / marker.read_text().strip() / "trainer_state.json").read_text())
    return state["iteration"] + 1 >= 14


def _assert_same_losses(out: Path, reference: dict) -> None:
    got = losses(out)
    assert sorted(got) == sorted(reference), (sorted(got), out)
    for it in reference:
        assert got[it] == reference[it], (out, it, got[it], reference[it])
    _check_last_checkpoint(out)
    assert (out / "model_final" / ".metadata").is_file() and (out / "model_best" / ".metadata").is_file()


@pytest.mark.slow
def test_kills_at_a_random_moment_during_a_save_and_during_model_best_replacement_resume_exactly(tmp_path):
    _crash_and_resume(tmp_path, _reference(tmp_path), ["random", "save", "save"], seed=0)


@pytest.mark.slow
def test_twenty_kills_at_random_moments_including_saves_each_resume_continues_exactly(tmp_path):
    kinds = ["random", "save"] * 10
    random.Random(1).shuffle(kinds)
    _crash_and_resume(tmp_path, _reference(tmp_path), kinds, seed=1)
