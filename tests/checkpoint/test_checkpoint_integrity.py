"""Checkpoints that cannot lose or lie: a replacement killed at any step stays resumable, a checkpoint of
another shape or with changed bytes is refused in one line, a full disk during a save leaves the previous one."""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.launch import (CONFIG, ROOT, env, losses, mounted_tmpfs, one_error_line, python_tool, tiny, train_cmd,
                          train_net, train_sh, tree_snapshot)

# tools/train_net.py holding one save (tests/checkpoint/paused_train_net.py says how).
PAUSED_TRAIN_NET = str(Path(__file__).with_name("paused_train_net.py"))
BASE = ["train.evaluation.enabled=False", "model.cfg.hidden_layers=4"]
# generate.py builds the model from the same config and overrides the run used.
MODEL = ["model.cfg.hidden_layers=4", "model.cfg.hidden_size=64", "model.cfg.ffn_hidden_size=128",
         "model.cfg.num_attention_heads=2", "model.cfg.max_seq_length=32"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-layer tiny run: model_0000001 and model_final (4 iterations)."""
    tmp = tmp_path_factory.mktemp("integrity")
    r = train_net(tiny(tmp / "run", tmp / "cache", *BASE, "train.train_iter=4", "train.checkpointer.period=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run", tmp / "cache"


@pytest.fixture
def run(trained, tmp_path):
    """A private copy of the trained run, and the overrides that continue it to iteration 6."""
    src, cache = trained
    out = tmp_path / "run"
    shutil.copytree(src, out)
    return out, tiny(out, cache, *BASE, "train.train_iter=6", "train.checkpointer.period=2")


@pytest.fixture
def generate():
    """tools/generate.py's main() in this process: ``generate(args) -> (rc, stdout, stderr)``."""
    spec = importlib.util.spec_from_file_location("generate_tool", ROOT / "tools" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def call(checkpoint, *extra):
        cwd = os.getcwd()
        os.chdir(ROOT)
        out, err = StringIO(), StringIO()
        try:
            with redirect_stdout(out), redirect_stderr(err):
                rc = module.main(["--config-file", CONFIG, "--checkpoint", str(checkpoint), "--prompt-ids", "5 6 7",
                                  "--max-new-tokens", "2", *MODEL, *extra])
        finally:
            os.chdir(cwd)
        return SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())

    return call


def _flip_bits(path: Path, count: int = 4) -> None:
    """Flip the lowest bit of ``count`` bytes in the middle of a file: what a bad disk or copy does.

    A low bit keeps any float32 finite (it moves the mantissa or the exponent by at most 2), so a
    run that loads these bytes unchecked trains on instead of stopping on a non-finite loss.
    """
    data = bytearray(path.read_bytes())
    for i in range(count):
        data[len(data) // 2 + 101 * i] ^= 0x01
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------ checkpoints of another model


@pytest.mark.parametrize("override, expected", [
    # Fewer layers than saved: the saved layers.2 and layers.3 tensors have no place in the model.
    ("model.cfg.hidden_layers=2", "holds 'GPT_model.layers.2.input_layernorm.weight', which this config does not "
                                  "build"),
    ("model.cfg.hidden_size=32", "with shape [8064, 64] but this config builds [8064, 32]"),
])
def test_resume_with_another_model_shape_is_refused_naming_the_first_mismatch(run, override, expected):
    out, args = run
    before = tree_snapshot(out)
    r = train_net([*args, override, "--resume"])
    assert r.returncode == 1
    line = one_error_line(r)
    assert expected in line and str(out / "model_final") in line, line
    assert tree_snapshot(out) == before  # model_final is not overwritten by a smaller model


def test_generate_refuses_a_checkpoint_with_more_layers(trained, generate):
    r = generate(trained[0] / "model_final", "model.cfg.hidden_layers=2")
    assert r.returncode == 1
    assert "holds 'GPT_model.layers.2.input_layernorm.weight', which this config does not build" in one_error_line(r)


# -m slow: the same check refuses the same checkpoint in test_generate_refuses_a_checkpoint_with_more_layers
@pytest.mark.slow
def test_evaluate_refuses_a_checkpoint_with_more_layers(trained, tmp_path):
    src, cache = trained
    r = python_tool([sys.executable, "tools/evaluate.py", "--config-file", CONFIG, "--checkpoint",
                     str(src / "model_final"), "--task", "ppl",
                     *tiny(tmp_path / "ev", cache, *BASE, "model.cfg.hidden_layers=2")], timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "holds 'GPT_model.layers.2.input_layernorm.weight', which this config does not build" in one_error_line(r)


# ------------------------------------------------------------------ bytes changed on disk


def test_flipped_bytes_in_a_shard_are_refused_naming_the_file_and_no_verify_loads_them(run, generate):
    out, args = run
    shard = out / "model_final" / "__0_0.distcp"
    _flip_bits(shard)
    before = tree_snapshot(out)
    r = train_net([*args, "--resume"])
    assert r.returncode == 1
    line = one_error_line(r)
    assert f"the bytes of {shard} differ from those saved" in line and "--no-verify" in line, line
    assert tree_snapshot(out) == before
    g = generate(out / "model_final")
    assert g.returncode == 1 and str(shard) in one_error_line(g)
    # The user who accepts the risk loads the bytes as they are.
    assert generate(out / "model_final", "--no-verify").returncode == 0
    r = train_net([*args, "--resume", "--no-verify"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert max(losses(out)) == 6


def test_truncated_trainer_state_is_one_line_naming_the_file(run):
    out, args = run
    state = out / "model_final" / "trainer_state.json"
    state.write_text(state.read_text()[:40])
    before = tree_snapshot(out)
    r = train_net([*args, "--resume"])
    assert r.returncode == 1
    line = one_error_line(r)
    assert f"{state} is truncated or garbled" in line and "last_checkpoint" in line, line
    assert tree_snapshot(out) == before


def test_checkpoint_without_its_manifest_is_refused_unless_no_verify(run):
    """manifest.json removed and a shard changed: nothing can tell it from an intact checkpoint, so it is
    refused in one line naming --no-verify, which then loads it as it is."""
    out, args = run
    (out / "model_final" / "manifest.json").unlink()
    _flip_bits(out / "model_final" / "__0_0.distcp")
    before = tree_snapshot(out)
    r = train_net([*args, "--resume"])
    assert r.returncode == 1
    line = one_error_line(r)
    assert f"checkpoint {out / 'model_final'} has no manifest.json" in line and "--no-verify" in line, line
    assert tree_snapshot(out) == before
    r = train_net([*args, "--resume", "--no-verify"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert max(losses(out)) == 6


def _drop_from_manifest(checkpoint: Path, *names: str) -> None:
    """Remove the entries of ``names`` (all of them when none is given) from ``checkpoint``'s manifest.json."""
    manifest = checkpoint / "manifest.json"
    data = json.loads(manifest.read_text())
    data["files"] = {n: r for n, r in data["files"].items() if names and n not in names}
    manifest.write_text(json.dumps(data))


def test_a_shard_dropped_from_the_manifest_is_refused_naming_it(run):
    """The manifest lost a shard's entry and the shard a bit: the files a checkpoint needs come from its
    DCP metadata, not from the manifest, so the unlisted shard is refused instead of trained on."""
    out, args = run
    shard = out / "model_final" / "__0_0.distcp"
    _drop_from_manifest(out / "model_final", "__0_0.distcp")
    _flip_bits(shard)
    before = tree_snapshot(out)
    r = train_net([*args, "--resume"])
    assert r.returncode == 1
    line = one_error_line(r)
    assert f"is corrupt: {shard} is not listed in its manifest.json" in line and "--no-verify" in line, line
    assert tree_snapshot(out) == before


@pytest.mark.parametrize("dropped, expected", [
    ((), "is corrupt: its manifest.json lists none of its files"),
    ((".metadata",), "is corrupt: {checkpoint}/.metadata is not listed in its manifest.json"),
    (("trainer_state.json", "rng_state_0.pt"), "is corrupt: {checkpoint}/rng_state_0.pt is not listed in its"),
])
def test_a_manifest_missing_entries_is_refused(trained, tmp_path, generate, dropped, expected):
    checkpoint = tmp_path / "model_final"
    shutil.copytree(trained[0] / "model_final", checkpoint)
    _drop_from_manifest(checkpoint, *dropped)
    r = generate(checkpoint)
    assert r.returncode == 1
    line = one_error_line(r)
    assert expected.format(checkpoint=checkpoint) in line and "--no-verify" in line, line
    assert generate(checkpoint, "--no-verify").returncode == 0


# ------------------------------------------------------------------ killed while replacing a checkpoint

# Saves model_best twice (weights all 1.0, then all 2.0); the second save replaces the first.
_SAVER = """
import sys, torch
from libai_lite.checkpoint import Checkpointer
from tests.checkpoint.paused_train_net import hold_save_at
model = torch.nn.Linear(32, 32)
opt = torch.optim.AdamW(model.parameters())
model(torch.ones(1, 32)).sum().backward()
opt.step()
hold_save_at(sys.argv[2])
ck = Checkpointer(model, opt, sys.argv[1])
for it in (1, 2):
    with torch.no_grad():
        model.weight.fill_(it)
    ck.save("model_best", {"iteration": it})
"""


def _kill_at(step: str, save_dir: Path, flag: Path) -> None:
    """Run _SAVER until the second save reaches ``step``, then SIGKILL it there."""
    p = subprocess.Popen([sys.executable, "-c", _SAVER, str(save_dir), f"model_best:{step}:{flag}"], cwd=ROOT,
                         env=env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not flag.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert flag.exists(), p.stderr.read() if p.poll() is not None else "the save never reached the pause"
    finally:
        p.send_signal(signal.SIGKILL)
        p.communicate()


def _load_best(path):
    from libai_lite.checkpoint import Checkpointer

    model = torch.nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters())
    state = Checkpointer(model, opt).load(str(path))
    return state["iteration"], model.weight.unique().tolist()


# Step of the replacement -> the iteration model_best holds once repaired: the new one as soon as
# it was completely written, the old one before.
STEPS = {"partial": 1, "written": 2, "aside": 2, "published": 2, "marked": 2}


@pytest.mark.parametrize("step", list(STEPS))
def test_killed_at_each_step_of_a_replacement_the_checkpoint_stays_resumable(tmp_path, step):
    from libai_lite.checkpoint import Checkpointer, checkpoint_to_resume

    save_dir = tmp_path / "out"
    _kill_at(step, save_dir, tmp_path / "paused")
    # What the kill left: never the marker naming nothing recoverable.
    left = sorted(p.name for p in save_dir.iterdir())
    assert (save_dir / "last_checkpoint").read_text() == "model_best"
    expected = STEPS[step]
    # --resume reads the checkpoint where it is, changing nothing before the run holds the directory.
    before = tree_snapshot(save_dir)
    path = checkpoint_to_resume(str(save_dir))
    assert tree_snapshot(save_dir) == before
    assert _load_best(path) == (expected, [float(expected)]), (step, left, path)
    # The start-up repair (with or without --resume) puts it back under its name and deletes nothing complete.
    Checkpointer(torch.nn.Linear(32, 32), save_dir=str(save_dir)).remove_partial()
    assert sorted(p.name for p in save_dir.iterdir()) == ["last_checkpoint", "model_best"], left
    assert checkpoint_to_resume(str(save_dir)) == str(save_dir / "model_best")
    assert _load_best(save_dir / "model_best") == (expected, [float(expected)])


def test_run_killed_while_replacing_model_best_resumes_from_it(tmp_path):
    """The issue's case end to end: killed between moving the old model_best aside and moving the new one
    in, with last_checkpoint naming model_best; --resume continues from the new one and removes nothing."""
    out = tmp_path / "run"
    args = tiny(out, tmp_path / "cache", "train.train_iter=6", "train.evaluation.eval_period=2",
                "train.checkpointer.period=1000")
    flag = tmp_path / "paused"
    p = subprocess.Popen([sys.executable, PAUSED_TRAIN_NET, *train_cmd(args)[2:]], cwd=ROOT,
                         env=env(LIBAI_LITE_TEST_PAUSE_SAVE=f"model_best:aside:{flag}"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not flag.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.01)
    finally:
        p.send_signal(signal.SIGKILL)
        _, stderr = p.communicate()
    if not flag.exists():
        pytest.skip(f"the evaluation never improved, so model_best was never replaced: {stderr[-2000:]}")
    assert not (out / "model_best").exists() and (out / "last_checkpoint").read_text() == "model_best"
    new_iteration = json.loads((out / "model_best.tmp" / "trainer_state.json").read_text())["iteration"]
    r = train_net([*args, "--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"Resumed from {out / 'model_best.tmp'} at iteration {new_iteration + 1}" in r.stdout
    assert "Published" in (out / "log.txt").read_text()
    assert not [d for d in out.iterdir() if d.suffix in (".tmp", ".old")]
    assert max(losses(out)) == 6


# ------------------------------------------------------------------ a full disk


# One process with -m slow: the two-process run takes the same path and the rank coordination too.
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, nproc):
    """A real 16 MiB filesystem: the first checkpoint (about 9.4 MiB) fits, the second does not; with two
    data-parallel ranks DCP's CheckpointException reaches both and rank 0 prints the one line."""
    from libai_lite.checkpoint.integrity import verify_checkpoint

    with mounted_tmpfs(tmp_path / "disk", "16m") as disk:
        out = disk / "run"
        args = tiny(out, tmp_path / "cache", "train.evaluation.enabled=False", "train.train_iter=6",
                    "train.checkpointer.period=2")
        r = train_net(args) if nproc == 1 else train_sh(nproc, args)
        assert r.returncode == 1, r.stderr[-3000:]
        line = one_error_line(r)
        assert line.startswith(f"error: saving checkpoint {out / 'model_0000003'} failed (OSError: [Errno 28] No "
                               f"space left on device"), line
        assert "it needs about " in line and " are free there" in line, line
        assert f"the previous checkpoint {out / 'model_0000001'} is kept" in line, line
        assert not [d for d in out.iterdir() if d.name.endswith((".tmp", ".old"))]
        assert (out / "last_checkpoint").read_text() == "model_0000001"
        verify_checkpoint(str(out / "model_0000001"))  # every byte as saved
        assert shutil.disk_usage(disk).free > 5 * 2**20  # the partial files are gone


def test_read_only_filesystem_during_a_save_is_one_error_and_changes_nothing(tmp_path):
    from libai_lite.checkpoint import Checkpointer
    from libai_lite.utils.errors import UsageError

    with mounted_tmpfs(tmp_path / "disk", "4m") as disk:
        ck = Checkpointer(torch.nn.Linear(8, 8), save_dir=str(disk))
        ck.save("model_0000001", {"iteration": 1})
        before = tree_snapshot(disk)
        assert subprocess.run(["mount", "-o", "remount,ro", str(disk)]).returncode == 0
        with pytest.raises(UsageError, match=r"model_0000002 failed \(OSError: \[Errno 30\] Read-only file system.*"
                                             r"model_0000001 is kept"):
            ck.save("model_0000002", {"iteration": 2})
        assert tree_snapshot(disk) == before


def test_replacement_killed_by_an_older_version_is_restored_not_deleted(tmp_path):
    """Saved without manifests and killed between deleting model_best and renaming model_best.tmp (the
    window of the old protocol): the complete model_best.tmp that last_checkpoint names is put back."""
    from libai_lite.checkpoint import Checkpointer, checkpoint_to_resume

    model = torch.nn.Linear(8, 8)
    Checkpointer(model, save_dir=str(tmp_path)).save("model_best", {"iteration": 7})
    (tmp_path / "model_best" / "manifest.json").unlink()
    (tmp_path / "model_best").rename(tmp_path / "model_best.tmp")
    assert checkpoint_to_resume(str(tmp_path)) == str(tmp_path / "model_best.tmp")
    Checkpointer(model, save_dir=str(tmp_path)).remove_partial()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last_checkpoint", "model_best"]
    assert json.loads((tmp_path / "model_best" / "trainer_state.json").read_text())["iteration"] == 7
    # Without a manifest its files cannot be checked: the old format loads unchecked (--no-verify).
    Checkpointer(model, verify=False).load(str(tmp_path / "model_best"), weights_only=True)


def test_flipped_bytes_found_by_another_rank_stop_every_rank_with_one_line(run):
    """Under tp=2 each rank checks half the files; the shard is rank 1's share (the files in name order:
    .metadata, __0_0.distcp, ...), and rank 0 prints the refusal while neither waits for the other."""
    from tests.launch import torchrun

    out, _ = run
    shard = out / "model_final" / "__0_0.distcp"
    _flip_bits(shard)
    r = torchrun(2, "tools/generate.py", "--config-file", CONFIG, "--checkpoint", out / "model_final",
                 "--prompt-ids", "5 6 7", "--max-new-tokens", "2", *MODEL, timeout=240, check=False)
    assert r.returncode != 0
    # Bare torchrun logs the failed worker and adds its own ChildFailedError traceback; the workers print
    # one line and no traceback (a rank left waiting would have run into the timeout instead).
    workers = SimpleNamespace(stderr=r.stderr.split("torch/distributed/elastic/")[0])
    assert f"the bytes of {shard} differ from those saved" in one_error_line(workers)


@pytest.mark.slow
def test_a_pipelined_run_with_a_tied_head_resumes_at_its_own_layout(tmp_path):
    """pp=2 stores the tied LM head copy under its own name too; the fit check must count it as the
    model's, and a resume from the middle of the run continues its losses exactly."""
    args = [*BASE, "train.dist.pipeline_parallel_size=2", "train.checkpointer.period=2", "train.train_iter=4"]
    ref = tmp_path / "ref"
    r = train_sh(2, tiny(ref, tmp_path / "cache", *args))
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(ref / "model_0000001", out / "model_0000001")
    (out / "last_checkpoint").write_text("model_0000001")
    r = train_sh(2, tiny(out, tmp_path / "cache", *args) + ["--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    expected, got = losses(ref), losses(out)
    assert sorted(got) == [3, 4] and all(got[i] == expected[i] for i in (3, 4)), (got, expected)
