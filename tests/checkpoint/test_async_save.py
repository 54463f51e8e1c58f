"""train.checkpointer.async_save: checkpoints staged in CPU memory and written in the background.

What must hold (issue 17): the checkpoint holds the state of the step it was taken at, whatever
training does meanwhile; the previous checkpoint stays the one ``last_checkpoint`` names until the
new one is completely written; a failed background write is the synchronous save's one-line error;
a job killed mid-write resumes from the previous checkpoint; and runs that save in the background
resume to exactly the losses of runs that save synchronously, on one process and on two.
"""
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.launch import (CONFIG, ROOT, env, free_port, losses, mounted_tmpfs, one_error_line, tiny, train_net,
                          train_sh)

ARGS = ["train.evaluation.enabled=False", "train.train_iter=8", "train.checkpointer.period=2"]
BACKGROUND = "writing in the background"

# tools/train_net.py holding one save (paused_train_net.py says how).
PAUSED_TRAIN_NET = str(Path(__file__).with_name("paused_train_net.py"))


def _model_and_optimizer(width: int = 64):
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, width)).sum().backward()
    opt.step()  # Adam's moments exist: the optimizer state is saved too
    return model, opt


@pytest.fixture
def held_write(monkeypatch):
    """Holds every background write just before its manifest until ``release`` is set: ``(reached, release)``."""
    from tests.checkpoint.paused_train_net import hold_save

    reached, release = threading.Event(), threading.Event()

    def pause():
        reached.set()
        assert release.wait(60), "the test never released the background write"

    hold_save("background", pause, setattr=monkeypatch.setattr)
    yield reached, release
    release.set()


def _states(trainer_state):
    """The checkpointer's states as DefaultTrainer gives them: RNG streams and the trainer's state."""
    from libai_lite.checkpoint.trainer_state import RngState, TrainerState

    return {"rng": RngState(), "trainer": TrainerState(trainer_state)}


def test_a_background_save_holds_its_step_and_is_published_only_once_written(tmp_path, held_write):
    from libai_lite.checkpoint import Checkpointer, checkpoint_to_resume

    reached, release = held_write
    model, opt = _model_and_optimizer()
    ck = Checkpointer(model, opt, str(tmp_path), async_save=True)
    release.set()
    ck.save("model_0000001", {"iteration": 1})
    assert ck.wait() == str(tmp_path / "model_0000001")
    release.clear()
    reached.clear()

    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert ck.save("model_0000003", {"iteration": 3}) == str(tmp_path / "model_0000003")
    assert ck.in_flight == "model_0000003"
    with torch.no_grad():  # training goes on while the files are written
        for p in model.parameters():
            p.add_(1.0)
    assert reached.wait(30)
    # Written but not yet checksummed: nothing names it, and a resume takes the previous one.
    assert ck.poll() is None
    assert (tmp_path / "last_checkpoint").read_text() == "model_0000001"
    assert not (tmp_path / "model_0000003").exists()
    assert not (tmp_path / "model_0000003.tmp" / "manifest.json").exists()
    assert checkpoint_to_resume(str(tmp_path)) == str(tmp_path / "model_0000001")

    release.set()
    deadline = time.time() + 30
    while ck.poll() is None:
        assert time.time() < deadline, "the background write never finished"
        time.sleep(0.01)
    assert ck.in_flight is None
    assert (tmp_path / "last_checkpoint").read_text() == "model_0000003"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last_checkpoint", "model_0000001", "model_0000003"]

    fresh, fresh_opt = _model_and_optimizer()
    state = Checkpointer(fresh, fresh_opt).load(str(tmp_path / "model_0000003"))
    assert state == {"iteration": 3}
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k]), k  # the values at save time, not the ones changed after


def test_a_save_while_one_is_in_flight_waits_for_it_and_pruning_follows_publication(tmp_path, held_write):
    from libai_lite.checkpoint import Checkpointer

    reached, release = held_write
    model, opt = _model_and_optimizer()
    ck = Checkpointer(model, opt, str(tmp_path), max_to_keep=1, async_save=True)
    ck.save("model_0000001", {"iteration": 1})
    assert reached.wait(30)
    done = []
    second = threading.Thread(target=lambda: done.append(ck.save("model_0000003", {"iteration": 3})))
    second.start()
    time.sleep(0.5)
    assert not done and second.is_alive()  # held behind the first write: at most one in flight
    assert not (tmp_path / "model_0000003.tmp").exists()
    release.set()
    second.join(30)
    assert done == [str(tmp_path / "model_0000003")]
    assert (tmp_path / "last_checkpoint").read_text() == "model_0000001"
    ck.wait()
    # max_to_keep=1 removed model_0000001 only once model_0000003 was complete and named.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last_checkpoint", "model_0000003"]


def test_a_run_that_fails_waits_for_the_write_in_flight_and_publishes_it(tmp_path, held_write):
    """A step raises while model_0000001 is being written: the checkpoint hook's after_train (run by the
    trainer on the way out) finishes the write and publishes it before the exception leaves train()."""
    from libai_lite.checkpoint import Checkpointer
    from libai_lite.engine.hooks import PeriodicCheckpointer
    from libai_lite.engine.trainer import TrainerBase

    reached, release = held_write
    model, opt = _model_and_optimizer()
    ck = Checkpointer(model, opt, str(tmp_path), async_save=True,
                      states=_states(lambda: {"iteration": trainer.iter}))

    class FailsAtStep3(TrainerBase):
        def run_step(self):
            if self.iter == 3:
                assert reached.wait(30) and ck.in_flight == "model_0000001"
                threading.Timer(0.3, release.set).start()  # the write ends while the exception unwinds
                raise RuntimeError("a step failed")

    trainer = FailsAtStep3()
    trainer.register_hooks([PeriodicCheckpointer(ck, 2)])
    with pytest.raises(RuntimeError, match="a step failed"):
        trainer.train(0, 10)
    assert ck.in_flight is None
    assert (tmp_path / "last_checkpoint").read_text() == "model_0000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last_checkpoint", "model_0000001"]


@pytest.mark.parametrize("budget,stagers,closed", [(None, 1, 0), (0, 2, 2)], ids=["fits", "over_budget"])
def test_the_staged_copy_is_reused_while_it_fits_the_budget_and_released_after_each_write_beyond(
        tmp_path, monkeypatch, budget, stagers, closed):
    from libai_lite.checkpoint import Checkpointer
    from libai_lite.checkpoint import dcp_io

    made = []

    class CountingStager(dcp_io.DefaultStager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.closed = False
            made.append(self)

        def close(self):
            self.closed = True
            super().close()

    monkeypatch.setattr(dcp_io, "DefaultStager", CountingStager)
    if budget is not None:
        monkeypatch.setattr(dcp_io, "staging_budget", lambda: budget)
    model, opt = _model_and_optimizer()
    ck = Checkpointer(model, opt, str(tmp_path), async_save=True)
    weights = {}
    for step in (1, 3):
        with torch.no_grad():
            model.weight.add_(1.0)
        weights[step] = model.weight.detach().clone()
        ck.save(f"model_000000{step}", {"iteration": step})
        ck.wait()
    assert (len(made), sum(m.closed for m in made)) == (stagers, closed)
    for step, want in weights.items():
        fresh, fresh_opt = _model_and_optimizer()
        Checkpointer(fresh, fresh_opt).load(str(tmp_path / f"model_000000{step}"))
        assert torch.equal(fresh.weight, want)


def test_a_save_after_the_loop_blocks_so_model_best_after_model_final_is_published(tmp_path):
    """BestCheckpointer saves model_best in after_train, after the periodic hook's model_final: nothing
    would wait for a background write then, so the hook saves it in the foreground."""
    from libai_lite.checkpoint import Checkpointer
    from libai_lite.engine.hooks import HookBase, PeriodicCheckpointer
    from libai_lite.engine.trainer import TrainerBase

    model, opt = _model_and_optimizer()
    ck = Checkpointer(model, opt, str(tmp_path), async_save=True, states=_states(lambda: {"iteration": trainer.iter}))

    class Steps(TrainerBase):
        def run_step(self):
            pass

    class SavesBestAtTheEnd(HookBase):
        def after_train(self):
            periodic.save("model_best")

    trainer = Steps()
    periodic = PeriodicCheckpointer(ck, 2)
    trainer.register_hooks([periodic, SavesBestAtTheEnd()])
    trainer.train(0, 4)
    assert ck.in_flight is None
    assert (tmp_path / "last_checkpoint").read_text() == "model_best"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last_checkpoint", "model_0000001", "model_best",
                                                         "model_final"]


def test_a_full_disk_during_a_background_write_is_the_synchronous_error_and_keeps_the_previous(tmp_path):
    """The same 1 MiB filesystem as the synchronous test (tests/engine/test_reliability.py): the second
    checkpoint does not fit, and the error surfaces when the trainer next looks (poll or wait)."""
    from libai_lite.checkpoint import Checkpointer
    from libai_lite.checkpoint.integrity import verify_checkpoint
    from libai_lite.utils.errors import UsageError

    with mounted_tmpfs(tmp_path / "disk", "1m") as disk:
        model, opt = _model_and_optimizer(256)
        ck = Checkpointer(model, opt, str(disk), async_save=True)
        ck.save("model_0000001", {"iteration": 1})
        ck.wait()
        ck.save("model_0000002", {"iteration": 2})
        with pytest.raises(UsageError, match=r"^saving checkpoint .*model_0000002 failed \(OSError: \[Errno 28\] No "
                                             r"space left on device\); it needs about .* are free there; the partial "
                                             r"files were removed and the previous checkpoint .*model_0000001 is kept: "
                                             r"free disk space in .* or point train.output_dir elsewhere, "
                                             r"then --resume$"):
            deadline = time.time() + 30
            while ck.poll() is None:  # as the trainer looks, once a step
                assert time.time() < deadline, "the background write never ended"
                time.sleep(0.01)
        assert ck.in_flight is None
        assert (disk / "last_checkpoint").read_text() == "model_0000001"
        assert sorted(p.name for p in disk.iterdir()) == ["last_checkpoint", "model_0000001"]
        verify_checkpoint(str(disk / "model_0000001"))


@pytest.mark.parametrize("value, ok", [("True", True), ("False", True), ("null", True), ("always", False),
                                       ("2", False)])
def test_the_key_takes_true_false_or_null_only(value, ok):
    from omegaconf import OmegaConf

    from libai_lite.run_sections import check_settings
    from libai_lite.utils.errors import UsageError

    # As a command-line override parses it: "always" a string, "2" an int, "null" None ("yes" is YAML for True).
    cfg = OmegaConf.from_dotlist([f"train.checkpointer.async_save={value}"])
    if ok:
        check_settings(cfg)
    else:
        with pytest.raises(UsageError, match=r"^train\.checkpointer\.async_save=.* is not allowed: it must be one of "
                                             r"None, False, True; set train\.checkpointer\.async_save to such a value$"):
            check_settings(cfg)


def test_a_bad_override_is_refused_in_one_line_before_training(tmp_path):
    """The key defaults to null (auto), so a string passes the override and meets the range row."""
    r = train_net(tiny(tmp_path / "run", tmp_path / "cache", *ARGS, "train.checkpointer.async_save=always"))
    assert r.returncode != 0
    assert one_error_line(r) == ("error: train.checkpointer.async_save='always' is not allowed: it must be one of "
                                 "None, False, True; set train.checkpointer.async_save to such a value")
    assert not (tmp_path / "run" / "last_checkpoint").exists()


def _rows(out: Path) -> list:
    """(iteration, total_loss) of every metrics.json row that logs a loss, in the order written."""
    import json

    rows = [json.loads(line) for line in (out / "metrics.json").read_text().splitlines()]
    return [(row["iteration"], row["total_loss"]) for row in rows if "total_loss" in row]


def _run(nproc: int, args: list):
    r = train_net(args) if nproc == 1 else train_sh(nproc, args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory) -> dict:
    """The losses of an uninterrupted one-process run that saves synchronously."""
    tmp = tmp_path_factory.mktemp("synchronous")
    _run(1, tiny(tmp / "run", tmp / "cache", *ARGS))
    return losses(tmp / "run")


def _save_in_background_then_resume_from_the_middle(out: Path, nproc: int) -> list:
    """A run saving in the background, then the same run continued from its middle checkpoint."""
    args = tiny(out, out.parent / "cache", *ARGS, "train.checkpointer.async_save=True")
    r = _run(nproc, args)
    assert BACKGROUND in r.stdout, r.stdout[-3000:]
    (out / "last_checkpoint").write_text("model_0000003")
    r = _run(nproc, args + ["--resume"])
    assert "model_0000003 at iteration 4" in r.stdout, r.stdout[-3000:]
    assert (out / "last_checkpoint").read_text() == "model_final"
    assert not [p.name for p in out.iterdir() if p.name.endswith((".tmp", ".old"))]
    rows = _rows(out)
    assert [it for it, _ in rows] == [*range(1, 9), *range(5, 9)]
    return rows


def test_background_checkpoints_resume_to_the_losses_of_synchronous_ones(tmp_path, synchronous):
    rows = _save_in_background_then_resume_from_the_middle(tmp_path / "run", 1)
    assert sorted(synchronous) == list(range(1, 9))
    # Bit for bit, before and after the resume: the same state was saved and restored.
    assert rows == [(it, synchronous[it]) for it in [*range(1, 9), *range(5, 9)]]


# -m slow: two ranks write in the background beside training by default in
# test_a_full_disk_under_a_background_write_stops_both_ranks_with_the_synchronous_line
@pytest.mark.slow
def test_background_checkpoints_on_two_data_parallel_ranks_resume_to_the_same_losses(tmp_path):
    """torchrun dp=2 (gloo): the background write's own gloo group runs beside the gradient all-reduces."""
    rows = _save_in_background_then_resume_from_the_middle(tmp_path / "run", 2)
    first = dict(rows[:8])
    assert rows[8:] == [(it, first[it]) for it in range(5, 9)]


def test_a_job_killed_while_a_background_write_is_in_flight_resumes_from_the_previous_checkpoint(tmp_path,
                                                                                               synchronous):
    """The background write of model_0000003 is held before its manifest while training goes on; the whole
    job is SIGKILLed (its process group, as tests/engine/test_crash_resume.py does) and resumed."""
    out, flag = tmp_path / "run", tmp_path / "held"
    args = tiny(out, tmp_path / "cache", *ARGS, "train.checkpointer.async_save=True")
    e = env(PORT=str(free_port()), LIBAI_LITE_TEST_PAUSE_SAVE=f"model_0000003:background:{flag}")
    p = subprocess.Popen(["bash", "tools/train.sh", PAUSED_TRAIN_NET, CONFIG, "1", *args], cwd=ROOT, env=e,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not flag.exists():
            assert p.poll() is None and time.time() < deadline, p.stderr.read()[-3000:] if p.poll() else "timeout"
            time.sleep(0.05)
        # Training went on past the save (iteration 5 is logged) while the write was held.
        while 5 not in losses(out):
            assert p.poll() is None and time.time() < deadline
            time.sleep(0.05)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.communicate(timeout=60)
    assert (out / "last_checkpoint").read_text() == "model_0000001"
    assert (out / "model_0000003.tmp" / ".metadata").exists()  # written, but never checksummed and published
    assert not (out / "model_0000003.tmp" / "manifest.json").exists()

    r = train_net(args + ["--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "model_0000001 at iteration 2" in r.stdout, r.stdout[-3000:]
    assert "Removed partial checkpoint" in r.stdout and "model_0000003.tmp" in r.stdout, r.stdout[-3000:]
    assert losses(out) == synchronous
    assert (out / "last_checkpoint").read_text() == "model_final"


@pytest.mark.slow
def test_a_full_disk_under_a_background_write_stops_both_ranks_with_the_synchronous_line(tmp_path):
    """The 16 MiB filesystem of the synchronous test (tests/checkpoint/test_checkpoint_integrity.py), two
    data-parallel ranks: model_0000003 does not fit; the failure, seen in the background, stops the run
    at a step boundary with the synchronous save's line, and the previous checkpoint stays."""
    from libai_lite.checkpoint.integrity import verify_checkpoint

    with mounted_tmpfs(tmp_path / "disk", "16m") as disk:
        out = disk / "run"
        args = tiny(out, tmp_path / "cache", "train.evaluation.enabled=False", "train.train_iter=6",
                    "train.checkpointer.period=2", "train.checkpointer.async_save=True")
        r = train_sh(2, args)
        assert r.returncode == 1, r.stderr[-3000:]
        line = one_error_line(r)
        assert line.startswith(f"error: saving checkpoint {out / 'model_0000003'} failed (OSError: [Errno 28] No "
                               f"space left on device"), line
        assert "it needs about " in line and " are free there" in line, line
        assert f"the previous checkpoint {out / 'model_0000001'} is kept" in line, line
        assert not [d for d in out.iterdir() if d.name.endswith((".tmp", ".old"))]
        assert (out / "last_checkpoint").read_text() == "model_0000001"
        verify_checkpoint(str(out / "model_0000001"))
        assert shutil.disk_usage(disk).free > 5 * 2**20  # the partial files are gone


# -m slow: a kill during a background write (test_a_job_killed_while_...) and SIGTERM through train.sh
# (tests/engine/test_process_faults.py) run by default
@pytest.mark.slow
def test_sigterm_with_background_writes_in_flight_saves_waits_and_resumes_exactly(tmp_path):
    """A save every step, so a write is in flight when SIGTERM reaches tools/train.sh: the stop's checkpoint
    waits for it, the process exits as SIGTERM'd with nothing half-written, and --resume continues exactly."""
    args = ["train.evaluation.enabled=False", "train.train_iter=30", "train.checkpointer.period=1"]
    reference = tmp_path / "reference"
    _run(1, tiny(reference, tmp_path / "cache", *args))
    out = tmp_path / "run"
    run_args = tiny(out, tmp_path / "cache", *args, "train.checkpointer.async_save=True")
    p = subprocess.Popen(["bash", "tools/train.sh", "tools/train_net.py", CONFIG, "1", *run_args], cwd=ROOT,
                         env=env(PORT=str(free_port())), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.time() + 120
        while len(losses(out)) < 5:
            assert p.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Stopped by SIGTERM after iteration" in stdout and BACKGROUND in stdout, stdout[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    stopped = int(stdout.split("Stopped by SIGTERM after iteration ")[1].split(";")[0])
    assert (out / "last_checkpoint").read_text() == f"model_{stopped:07d}"
    assert not [d.name for d in out.iterdir() if d.name.endswith((".tmp", ".old"))]
    _run(1, run_args + ["--resume"])
    assert losses(out) == losses(reference)


def test_a_checkpoint_that_cannot_be_moved_into_place_does_not_blame_the_disk(tmp_path, monkeypatch):
    """A publish refused by the file system (a rename not permitted) with the disk nearly empty: the line names
    the permission and the folder to fix, not free space (it said "free disk space" with 63 GB free)."""
    import errno
    import os

    from libai_lite.checkpoint import Checkpointer, protocol
    from libai_lite.utils.errors import UsageError

    model, opt = _model_and_optimizer()
    ck = Checkpointer(model, opt, str(tmp_path))
    ck.save("model_0000001", {"iteration": 1})
    real = os.replace

    def refused(src, dst):
        if str(src).endswith("model_0000002.tmp"):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(src))
        return real(src, dst)

    monkeypatch.setattr(protocol.os, "replace", refused)
    with pytest.raises(UsageError) as e:
        ck.save("model_0000002", {"iteration": 2})
    line = str(e.value)
    assert "Operation not permitted" in line and "free disk space" not in line and "are free there" not in line, line
    assert f"make {tmp_path} writable (and its checkpoints movable) or point train.output_dir elsewhere" in line, line
    assert (tmp_path / "last_checkpoint").read_text() == "model_0000001"
