"""What a run depends on is checked when the config is resolved or the job launched, before anything is written;
a resume never rewrites a finished run; and each refusal names its real cause (docs/bad_input.md lists them).

Each case checks the one line a user sees; where it is a function's refusal it runs in this process (the
command-line path to it is the same ``report_cli_error``), and once per path a user runs it as a process: the
exit status, no traceback, and nothing written.
"""
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import types

import pytest
import torch

from libai_lite.config import LazyConfig
from libai_lite.run_spec import resolve_run, tokenizer_from_config
from libai_lite.utils.errors import UsageError
from libai_lite.utils.parallel_dims import ParallelDims
from tests.launch import CONFIG, ROOT, env, one_error_line, tiny, train_cmd, train_net, tree_snapshot

BASE = ["train.evaluation.enabled=False"]


def _load(tmp_path, *extra):
    cfg = LazyConfig.load(str(ROOT / CONFIG))
    return LazyConfig.apply_overrides(cfg, tiny(tmp_path / "out", tmp_path / "cache", *BASE, *extra))


def _tool(name):
    spec = importlib.util.spec_from_file_location(f"{name}_tool", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------- at resolution

# override -> the part of the one-line refusal checked (tiny(): model.cfg.max_seq_length=32).
RESOLUTION = {
    "dataloader.train.seq_length=64": "dataloader.train.seq_length=64 is longer than the 32 positions the model "
                                      "takes (model.cfg.max_seq_length=32); set dataloader.train.seq_length to at "
                                      "most 32",
    "train.output_dir=[1,2]": "train.output_dir=[1, 2] is not a path: it must be a path (a string);",
    "train.output_dir=5": "train.output_dir=5 is not a path: it must be a path (a string) (a name that looks like a "
                          "number is quoted: train.output_dir=\"'5'\")",
    "dataloader.train.data_prefix=5": "dataloader.train.data_prefix=5 is not a path: it must be a path (a string) or "
                                      "Megatron's blend list [weight1, prefix1, weight2, prefix2, ...]",
    "dataloader.train.data_prefix=[0.5,5]": "dataloader.train.data_prefix=[0.5, 5] is not a path",
    "dataloader.train.data_prefix={a:1}": "dataloader.train.data_prefix={'a': 1} is not a path",
    "train.load_weight=5": "train.load_weight=5 is not a path: it must be a path (a string), or null",
    "dataloader.train.cache_dir=[a]": "dataloader.train.cache_dir=['a'] is not a path",
    "dataloader.train.splits_string='0,0,0'": "dataloader.train.splits_string='0,0,0' gives every split a share of 0, "
                                              "so there are no documents to train on; give the train split a "
                                              "positive share",
    "dataloader.train.seq_length=0": "dataloader.train.seq_length=0 is out of range: it must be an integer >= 1",
    "~train.checkpointer.period": "train.checkpointer.period is missing from the config: set it",
    "~train.log_period": "train.log_period is missing from the config: set it",
}


@pytest.mark.parametrize("override", list(RESOLUTION))
def test_what_the_run_depends_on_is_refused_in_one_line_when_resolved_and_nothing_is_written(tmp_path, override):
    from libai_lite.run_sections import check_settings

    cfg = _load(tmp_path, override)
    before = tree_snapshot(tmp_path)
    with pytest.raises(UsageError) as e:
        check_settings(cfg)  # what default_setup checks first
        resolve_run(cfg, ParallelDims.resolve(1, cfg.train.dist), tokenizer_from_config(cfg.tokenization))
    assert RESOLUTION[override] in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert tree_snapshot(tmp_path) == before


def test_paths_of_the_right_types_pass_and_every_shipped_config_has_them(tmp_path):
    from libai_lite.config.validate import check_paths
    from libai_lite.run_sections import PATHS

    prefix = str(ROOT / "data_test/gpt2/demo_gpt2_text_document")
    for override in (f"dataloader.train.data_prefix=[0.3,{prefix},0.7,{prefix}]",
                     f"dataloader.train.data_prefix=[{prefix}]", "train.load_weight=null",
                     "dataloader.train.cache_dir=null", "train.output_dir=\"'5'\""):
        check_paths(_load(tmp_path, override), PATHS)
    for path in sorted((ROOT / "projects").glob("*/configs/*.py")):
        cfg = LazyConfig.load(str(path))
        if "train" in cfg:
            check_paths(cfg, PATHS)


def test_a_sequence_longer_than_the_model_stops_train_net_before_it_writes(tmp_path):
    """Found at step 1 before, after config.yaml, log.txt and metrics.json were written."""
    out = tmp_path / "out"
    before = tree_snapshot(tmp_path)
    r = train_net(tiny(out, tmp_path / "cache", *BASE, "train.train_iter=2", "dataloader.train.seq_length=64"))
    assert r.returncode == 1
    assert RESOLUTION["dataloader.train.seq_length=64"] in one_error_line(r)
    assert not out.exists() and tree_snapshot(tmp_path) == before


# ------------------------------------------------------------------------------- the launcher

# environment / arguments of tools/train.sh -> its one line.
LAUNCHER = {
    "NPROC=0": "error: NPROC=0 is not a number of processes: give a positive integer",
    "NPROC=-1": "error: NPROC=-1 is not a number of processes",
    "NPROC=two": "error: NPROC=two is not a number of processes",
    "PORT=abc": "error: PORT=abc is not a port number: give an integer from 1 to 65535",
    "PORT=99999": "error: PORT=99999 is not a port number",
    "NODE=0": "error: NODE=0 is not a number of nodes",
    "NODE_RANK=2": "error: NODE_RANK=2 is not a node of NODE=2: give an integer from 0 to 1",
    "MAX_RESTARTS=-1": "error: MAX_RESTARTS=-1 is not a number of restarts",
    "RDZV_TIMEOUT=0": "error: RDZV_TIMEOUT=0 is not a number of seconds: give a positive integer",
    "ADDR=no.such.host.invalid": "error: ADDR=no.such.host.invalid cannot be resolved",
    "FILE=tools/nope.py": "error: tools/nope.py not found",
}


@pytest.mark.parametrize("case", list(LAUNCHER))
def test_launcher_arguments_are_refused_in_one_line_before_torchrun_starts(tmp_path, case):
    key, value = case.split("=", 1)
    extra = {"NODE_RANK": {"NODE": "2"}}.get(key, {})
    nproc = value if key == "NPROC" else "1"
    file = value if key == "FILE" else "tools/train_net.py"
    launch_env = env(**extra, **({key: value} if key not in ("NPROC", "FILE") else {}))
    launch_env.setdefault("PORT", "29555")
    before = tree_snapshot(tmp_path)
    r = subprocess.run(["bash", "tools/train.sh", file, CONFIG, nproc, f"train.output_dir={tmp_path / 'out'}"],
                       cwd=ROOT, env=launch_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert one_error_line(r).startswith(LAUNCHER[case]), r.stderr
    assert "torch.distributed" not in r.stderr and "already in use" not in r.stderr
    assert tree_snapshot(tmp_path) == before


@pytest.mark.parametrize("node_rank, waits, gives_up", [
    ("0", "node 0 of NODE=2: waiting for node 1 to join at 127.0.0.1:{port} (RDZV_TIMEOUT=3 s)",
     "error: node 1 of NODE=2 did not join node 0 at 127.0.0.1:{port} within RDZV_TIMEOUT=3 s; start the same "
     "command on each with NODE=2, its NODE_RANK"),
    ("1", "node 1 of NODE=2: waiting for node 0 at 127.0.0.1:{port} and the other nodes (RDZV_TIMEOUT=3 s)",
     "error: node 0 did not answer at 127.0.0.1:{port} within RDZV_TIMEOUT=3 s; start it (NODE_RANK=0)"),
])
def test_a_node_says_whom_it_waits_for_and_gives_up_in_one_line(tmp_path, node_rank, waits, gives_up):
    """NODE=2 on one machine printed nothing and waited (torchrun's 15 minutes, then a traceback): the first
    line says whom it waits for, where and how long; when RDZV_TIMEOUT passes, one error line, nothing written."""
    from types import SimpleNamespace

    from tests.launch import free_port

    port = free_port()
    p = subprocess.Popen(["bash", "tools/train.sh", "tools/train_net.py", CONFIG, "1",
                          f"train.output_dir={tmp_path / 'out'}"], cwd=ROOT, start_new_session=True,
                         env=env(NODE="2", NODE_RANK=node_rank, ADDR="127.0.0.1", PORT=str(port), RDZV_TIMEOUT="3"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    lines = err.splitlines()
    # The first line is written before the wait begins.
    assert lines and lines[0] == waits.format(port=port), err
    assert p.returncode == 1
    assert one_error_line(SimpleNamespace(stderr=err)).startswith(gives_up.format(port=port)), err
    assert len(lines) == 2 and "torch.distributed" not in err, err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------- a finished run

@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-iteration tiny run (hidden_size 64, max_seq_length 32)."""
    tmp = tmp_path_factory.mktemp("finished")
    r = train_net(tiny(tmp / "run", tmp / "cache", *BASE, "train.train_iter=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run", tmp / "cache"


def test_a_resume_with_no_iterations_left_is_refused_and_leaves_the_finished_run_as_it_was(finished, tmp_path):
    """It logged "from iteration 2 to 1", exited 0 and rewrote model_final, model_best and config.yaml."""
    from libai_lite.checkpoint.trainer_state import check_resume_has_work

    src, cache = finished
    out = tmp_path / "run"
    shutil.copytree(src, out)
    before = tree_snapshot(out)
    r = train_net(tiny(out, cache, *BASE, "train.train_iter=1") + ["--resume"])
    assert r.returncode == 1
    assert f"error: --resume: {out / 'model_final'} {DOC_CASES['resume_with_nothing_left']}" in one_error_line(r)
    assert tree_snapshot(out) == before
    # torchrun restarting a worker that failed after the run's last save finds nothing to do, and writes nothing.
    r = subprocess.run(train_cmd(tiny(out, cache, *BASE, "train.train_iter=2")), cwd=ROOT,
                       env=env(TORCHELASTIC_RESTART_COUNT="1"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Restarted after the run had finished" in r.stdout and "error:" not in r.stderr
    assert tree_snapshot(out) == before
    # At the checkpoint's own count too; one more iteration is work.
    with pytest.raises(UsageError, match="has already trained 2 iterations and train.train_iter=2 asks for no more"):
        check_resume_has_work(str(out / "model_final"), 2, 2)
    check_resume_has_work(str(out / "model_final"), 2, 3)


@pytest.mark.parametrize("changed, named", [
    ("max_seq_length=64", "model.cfg.max_seq_length=64 gives 64 where it has 32"),
    ("hidden_size=32", "model.cfg.hidden_size=32 gives 32 where it has 64"),
])
def test_a_checkpoint_of_another_shape_is_blamed_on_the_key_that_differs_when_two_keys_share_a_size(
        finished, tmp_path, changed, named):
    """hidden_size=64 and max_seq_length=64 both give 64: the refusal of the position table, stored [32, 64],
    named hidden_size; the key whose stored size builds the stored shape is the one named (DefaultTrainer's
    check, on the meta model, before anything is built or written)."""
    from libai_lite.checkpoint.integrity import check_checkpoint_shapes
    from libai_lite.config import instantiate
    from libai_lite.engine.default import DefaultTrainer

    src, _ = finished
    cfg = _load(tmp_path, f"model.cfg.{changed}", "model.cfg.vocab_size=8064")
    with torch.device("meta"):
        model = instantiate(cfg.model)
    trainer = types.SimpleNamespace(cfg=cfg)
    with pytest.raises(UsageError) as e:
        check_checkpoint_shapes(str(src / "model_final"), model.state_dict(), model_config=cfg.model.cfg,
                                rebuild=lambda changes: DefaultTrainer.model_shapes_with(trainer, changes))
    assert named in str(e.value), str(e.value)
    if changed.startswith("max_seq_length"):
        assert DOC_CASES["blamed_on_the_key_that_differs"] == named


# ------------------------------------------------------------------------------- tools and metadata

def test_an_hf_config_with_a_string_where_a_size_goes_is_one_line_naming_the_entry(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": "sixty-four",
                                                "n_head": 2, "vocab_size": 128, "n_positions": 32}))
    before = tree_snapshot(tmp_path)
    assert _tool("hf_convert").main(["import", "--hf-dir", str(hf), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(DOC_CASES["hf_config_value"]), err
    assert err.count("\n") == 1 and tree_snapshot(tmp_path) == before


@pytest.mark.parametrize("tracker, iteration, said", [
    (b"garbage\n", None, "latest_checkpointed_iteration.txt holds 'garbage', not an iteration number (Megatron-LM's "
                         "is the last saved iteration or 'release'); pass --iteration with one of the checkpoint's "
                         "folders (iter_0000005)"),
    (b"\xff\xfe5", None, "latest_checkpointed_iteration.txt holds"),
    (b"5\n", "five", "--iteration holds 'five', not an iteration number"),
])
def test_a_megatron_tracker_or_iteration_that_is_not_a_number_is_one_line(tmp_path, capsys, tracker, iteration, said):
    ckpt = tmp_path / "megatron"
    (ckpt / "iter_0000005" / "mp_rank_00").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_bytes(tracker)
    before = tree_snapshot(tmp_path)
    argv = ["--from", "megatron", "--input", str(ckpt), "--output", str(tmp_path / "out")]
    assert _tool("convert_checkpoint").main(argv + (["--iteration", iteration] if iteration else [])) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and "iter_0000005" in err and err.count("\n") == 1, err
    assert tree_snapshot(tmp_path) == before


@pytest.mark.parametrize("task", ["ppl", "lambada"])
def test_evaluating_a_file_that_is_not_utf8_is_one_line_like_preprocessing(tmp_path, capsys, task):
    data = tmp_path / "held_out.jsonl"
    data.write_bytes(b'{"text": "a first line"}\n{"text": "caf\xe9"}\n')
    before = tree_snapshot(tmp_path)
    rc = _tool("evaluate").main(["--config-file", str(ROOT / CONFIG), "--checkpoint", str(tmp_path / "ckpt"),
                                 "--task", task, "--data", str(data), f"train.output_dir={tmp_path / 'out'}"])
    assert rc == 1
    err = capsys.readouterr().err
    assert err == f"error: {data} {DOC_CASES['not_utf8']}\n"
    assert tree_snapshot(tmp_path) == before


def test_a_prompt_file_that_is_not_text_is_one_line_before_any_model_loads(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"a first prompt\n\xd6\x8f\xff\x00\x01binary\n")
    before = tree_snapshot(tmp_path)
    rc = _tool("generate").main(["--config-file", str(ROOT / CONFIG), "--checkpoint", str(tmp_path / "ckpt"),
                                 "--prompt-file", str(prompts), "--max-new-tokens", "2"])
    assert rc == 1
    err = capsys.readouterr().err
    assert err == f"error: --prompt-file {prompts} {DOC_CASES['prompt_file_not_text']}\n", err
    assert tree_snapshot(tmp_path) == before


def test_a_memory_estimate_of_values_out_of_range_is_the_training_commands_one_line(tmp_path, capsys):
    """train.train_micro_batch_size=0 was a ZeroDivisionError traceback."""
    rc = _tool("estimate_memory").main([str(ROOT / CONFIG), "train.train_micro_batch_size=0"])
    assert rc == 1
    err = capsys.readouterr().err
    assert err == f"error: {DOC_CASES['estimate_out_of_range']}\n", err


def test_an_evaluation_window_longer_than_the_model_is_one_line(finished, tmp_path, capsys):
    """The model refused the first window in its forward, a traceback."""
    src, cache = finished
    before = tree_snapshot(tmp_path)
    rc = _tool("evaluate").main(["--config-file", str(ROOT / CONFIG), "--checkpoint", str(src / "model_final"),
                                 "--task", "ppl", "--seq-length", "100000",
                                 *tiny(tmp_path / "out", cache, *BASE)])
    assert rc == 1
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("error: ")] == [
        f"error: {DOC_CASES['eval_window_longer_than_the_model']}"], err
    assert "Traceback" not in "\n".join(err) and tree_snapshot(tmp_path) == before


# ------------------------------------------------------------------------------- the first error

def test_an_error_on_the_way_out_does_not_replace_the_one_that_stopped_the_run():
    """A periodic save fails on a full disk; model_best, due the same step, is saved on the way out and fails
    too: the first error is reported, the second logged (tests/engine/test_process_faults.py on a real disk)."""
    from libai_lite.engine.trainer import HookBase, TrainerBase

    class Failing(HookBase):
        def __init__(self, after_step=None, after_train=None):
            self.step_error, self.train_error = after_step, after_train

        def after_step(self):
            if self.step_error:
                raise UsageError(self.step_error)

        def after_train(self):
            if self.train_error:
                raise UsageError(self.train_error)

    class Steps(TrainerBase):
        def run_step(self):
            pass

    # The package logger does not propagate (libai_lite.utils.logger): read it with a handler of its own.
    logged = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("libai_lite").addHandler(handler)
    trainer = Steps()
    trainer.register_hooks([Failing(after_step="saving checkpoint model_0000000 failed"),
                            Failing(after_train="saving checkpoint model_best failed")])
    try:
        with pytest.raises(UsageError, match="model_0000000"):
            trainer.train(0, 3)
    finally:
        logging.getLogger("libai_lite").removeHandler(handler)
    assert logged == ["Failing failed after the run stopped on an error: saving checkpoint model_best failed"]
    # Without an error leaving, an after_train failure is the run's error.
    trainer = Steps()
    trainer.register_hooks([Failing(after_train="saving checkpoint model_final failed")])
    with pytest.raises(UsageError, match="model_final"):
        trainer.train(0, 1)


@pytest.mark.slow  # the test above checks the order in process; this one on a real full disk
def test_on_a_full_disk_the_periodic_saves_error_is_reported_not_model_bests(tmp_path):
    """An evaluation makes model_best due at iteration 2, whose periodic save fails first on a 2 MiB disk:
    that failure is the one line, model_best's on the way out goes to the log."""
    from tests.launch import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "disk", "2m") as disk:
        out = disk / "out"
        r = train_net(tiny(out, tmp_path / "cache", "train.train_iter=4", "train.checkpointer.period=2",
                           "train.evaluation.enabled=True", "train.evaluation.eval_period=2"))
        assert r.returncode == 1
        line = one_error_line(r)
        assert line.startswith(f"error: saving checkpoint {out / 'model_0000001'} failed (OSError: [Errno 28]"), line
        assert DOC_CASES["first_error_reported"] in line
        assert "BestCheckpointer failed after the run stopped on an error: saving checkpoint" in (
            out / "log.txt").read_text()


# ------------------------------------------------------------------------------- docs/bad_input.md

# The case column of docs/bad_input.md's section -> the part of its message these tests check.
DOC_CASES = {
    "sequence_longer_than_the_model": RESOLUTION["dataloader.train.seq_length=64"],
    "path_of_the_wrong_type": RESOLUTION["train.output_dir=[1,2]"],
    "splits_all_zero": RESOLUTION["dataloader.train.splits_string='0,0,0'"],
    "launcher_nproc": LAUNCHER["NPROC=0"],
    "launcher_port": LAUNCHER["PORT=abc"],
    "launcher_nodes": LAUNCHER["NODE_RANK=2"],
    "resume_with_nothing_left": "has already trained 2 iterations and train.train_iter=1 asks for no more: nothing to "
                                "train, nothing written; set train.train_iter above 2 to train on",
    # tests/checkpoint/test_checkpoint_integrity.py checks this one.
    "checkpoint_without_its_manifest": "has no manifest.json, so its files cannot be checked against what was saved",
    "manifest_missing_entries": "is not listed in its manifest.json (the entry was lost), so its bytes cannot be "
                                "checked against those saved",
    "blamed_on_the_key_that_differs": "model.cfg.max_seq_length=64 gives 64 where it has 32",
    "first_error_reported": "failed (OSError: [Errno 28] No space left on device)",
    "hf_config_value": "error: config.json: n_embd='sixty-four' is not the number it should be (ValueError: ",
    "megatron_tracker": "latest_checkpointed_iteration.txt holds 'garbage', not an iteration number",
    "not_utf8": "line 2 is not UTF-8 text; re-encode the file as UTF-8",
    "prompt_file_not_text": "line 2 is not UTF-8 text (a binary file?); give a UTF-8 text file with one prompt per "
                            "line, or JSON lines with a \"text\" field",
    "estimate_out_of_range": "train.train_micro_batch_size=0 is out of range: it must be an integer >= 1, or null; "
                             "set train.train_micro_batch_size to such a value",
    "eval_window_longer_than_the_model": "--seq-length 100000 is longer than the 32 positions the model takes; give "
                                         "at most 32, or leave it out for the model's own",
}


def test_the_documented_rows_are_these_cases_with_the_messages_they_check():
    import re

    text = (ROOT / "docs" / "bad_input.md").read_text()
    heading = "\n## What a run depends on, the launcher, resuming, and the real cause\n"
    section = text.split(heading)[1].split("\n## ")[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`test_[a-z_]+\.py::([a-z0-9_]+)`", cells[-1]) if len(cells) >= 4 else None
        if m:
            rows[m.group(1)] = cells[-2]
    assert set(rows) == set(DOC_CASES)
    for case, needle in DOC_CASES.items():
        assert needle in rows[case], (case, needle)


@pytest.mark.parametrize("where", ["host", "device"])
def test_an_allocation_that_fails_is_one_line_naming_the_step_and_what_to_lower(where, capsys, monkeypatch):
    """model.cfg.max_seq_length=100000 on the demo asked the CPU allocator for 24 GiB at the first step: a
    traceback; CUDA's OutOfMemoryError alike."""
    from libai_lite.engine.launch import report_cli_error
    from libai_lite.utils.distributed import set_activity

    monkeypatch.setenv("RANK", "0")
    set_activity("forward/backward (gradient reduction)", 0)
    try:
        if where == "host":
            torch.empty(2**50, dtype=torch.uint8)  # a real failed allocation: 1 PiB
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                     "of 79.19 GiB of which 1.06 GiB is free.")
    except RuntimeError as e:
        try:
            raise RuntimeError("wrapped on the way out") from e
        except RuntimeError as outer:
            assert report_cli_error(outer) == 1
    finally:
        set_activity("setup")
    err = capsys.readouterr().err.strip().splitlines()
    size = "1048576.00 GiB" if where == "host" else "2.00 GiB"
    assert err == [f"error: out of {where} memory during forward/backward (gradient reduction) at iteration 0 "
                   f"(asking for {size}): lower train.train_micro_batch_size or the sequence length, or turn on "
                   f"activation checkpointing or ZeRO (tools/estimate_memory.py CONFIG estimates the peak of a "
                   f"setting), then run it again with --resume (from the last checkpoint, or from the start where "
                   f"none was saved)"], err


def test_a_worker_connection_reset_in_torchs_data_path_is_a_dead_worker_not_a_collective_timeout(capsys,
                                                                                              monkeypatch):
    """Under load the batch a killed worker was handing over broke first (ConnectionResetError in torch's
    multiprocessing reductions), which read as 'connection reset by peer': a collective timeout on a 1-rank run."""
    from libai_lite.engine.launch import report_cli_error
    from libai_lite.utils.distributed import set_activity

    monkeypatch.setenv("RANK", "0")
    where = os.path.join(os.sep, "venv", "torch", "multiprocessing", "reductions.py")
    set_activity("data loading", 2)
    try:
        exec(compile("raise ConnectionResetError(104, 'Connection reset by peer')", where, "exec"))
    except ConnectionResetError as e:
        assert report_cli_error(e) == 1
    finally:
        set_activity("setup")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: a DataLoader worker died while handing over a batch (ConnectionResetError: [Errno 104] "
                   "Connection reset by peer) during data loading at iteration 2: a kill or the kernel's "
                   "out-of-memory killer ends workers so (dmesg says which); free host memory or lower "
                   "dataloader.train.num_workers, then --resume from the last checkpoint"], err


def test_a_second_worker_dying_while_the_first_is_reported_is_still_one_line(capsys, monkeypatch):
    """torch's SIGCHLD handler raises wherever the process is: a second worker's death landed in the report of
    the first (inside linecache, reading the source of the frames it named) and left as a traceback."""
    import linecache

    from libai_lite.engine.launch import report_cli_error
    from libai_lite.utils.distributed import set_activity

    def second_death(*args, **kwargs):
        raise RuntimeError("DataLoader worker (pid 2) is killed by signal: Killed. ")

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(linecache, "getlines", second_death)
    monkeypatch.setattr(linecache, "updatecache", second_death)
    where = os.path.join(os.sep, "venv", "torch", "utils", "data", "dataloader.py")
    set_activity("data loading", 5)
    try:
        exec(compile("raise EOFError()", where, "exec"))
    except EOFError as e:
        assert report_cli_error(e) == 1
    finally:
        set_activity("setup")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: a DataLoader worker died while handing over a batch (EOFError: ) "
                                               "during data loading at iteration 5"), err


def test_a_worker_death_landing_anywhere_in_the_report_of_another_error_is_the_one_line(capsys, monkeypatch):
    """The same signal landing in the report of an error that is not a worker's: the worker's death is the line."""
    import libai_lite.engine.launch as launch

    def second_death(exc):
        raise RuntimeError("DataLoader worker (pid 3) is killed by signal: Killed. ")

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(launch, "describe_out_of_memory", second_death)
    assert launch.report_cli_error(RuntimeError("an error of the step")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: DataLoader worker (pid 3) is killed by signal: Killed during "), err
