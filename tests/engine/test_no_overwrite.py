"""No command writes over another run: a second training without --resume is refused, and `--fast-dev-run`,
`--eval-only` and the tools that read a trained run leave every file of it byte-identical and write only where
they say (their own folder, or `--output`).

One tiny run is trained once for the module; each test hashes the run folder before and after its command.
The harness (tools/eval_harness.py, `<output_dir>/lm_eval/`) is checked the same way in
tests/evaluation/test_lm_eval_harness.py, where its run already happens.
"""
import argparse
import importlib.util
import json
import math
import shutil

import pytest

from tests.launch import CONFIG, ROOT, kept_logger, losses, one_error_line, tiny, train_net, train_sh
from tests.launch import tree_hashes as hashes

# What each fixture run and check shares: the run trains 4 steps, checkpoints every 2 and keeps 1 periodic
# checkpoint, so a check that wrote there would replace model_final/model_best and prune model_0000001.
RUN = ["train.train_iter=4", "train.checkpointer.period=2", "train.checkpointer.max_to_keep=1",
       "train.evaluation.eval_period=2"]
MODEL = [o for o in tiny("x", "x") if o.startswith("model.")]


def outside(tree: dict, own) -> dict:
    """`tree` without the entries at or under the relative path `own` (None: all of it)."""
    return {k: v for k, v in tree.items() if own is None or not (k == own or k.startswith(own + "/"))}


def tool(name: str):
    """tools/<name>.py as a module (the tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"_no_overwrite_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run folder, data cache, the run's file hashes) of a tiny trained demo run."""
    tmp = tmp_path_factory.mktemp("no_overwrite")
    out, cache = tmp / "run", tmp / "cache"
    r = train_net(tiny(out, cache, *RUN))
    assert r.returncode == 0, r.stderr[-3000:]
    files = hashes(out)
    for name in ("config.yaml", "log.txt", "metrics.json", "last_checkpoint", "model_0000001/.metadata",
                 "model_final/.metadata", "model_best/.metadata"):
        assert name in files, sorted(files)
    return out, cache, files


@pytest.fixture
def in_process(monkeypatch):
    """Run a tool in this process from the repository root; give the `libai_lite` logger back afterwards."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    with kept_logger():
        yield


def check_untouched(run, before: dict, own) -> dict:
    """Assert the run's own files and everything outside `own` are as they were; return the files now."""
    out, _, trained = run
    after = hashes(out)
    assert outside(after, own) == outside(before, own)
    assert {k: after.get(k) for k in trained} == trained
    return after


def test_the_same_training_command_again_is_refused_and_changes_nothing(run):
    """The command that trained the run, through tools/train.sh as the README gives it: it started at iteration 0
    in the same folder and replaced the checkpoints, config.yaml, log.txt, metrics.json and last_checkpoint."""
    out, cache, _ = run
    before = hashes(out)
    last = (out / "last_checkpoint").read_text().strip()
    r = train_sh(1, tiny(out, cache, *RUN), timeout=180)
    assert r.returncode == 1, r.stderr[-3000:]
    assert one_error_line(r) == (f"error: train.output_dir={out} already holds a run (last checkpoint {last}); "
                                 f"continue it with --resume, or give a new train.output_dir=...")
    assert hashes(out) == before


def test_a_training_from_the_runs_config_yaml_is_refused_and_changes_nothing(run):
    out, _, _ = run
    before = hashes(out)
    r = train_net([], config=str(out / "config.yaml"))
    assert r.returncode == 1, r.stderr[-3000:]
    line = one_error_line(r)
    assert f"train.output_dir={out} already holds a run (last checkpoint " in line and "--resume" in line, line
    assert hashes(out) == before


def test_resume_continues_the_refused_run(run, tmp_path):
    out, cache, _ = run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    r = train_net(tiny(copy, cache, *RUN, "train.train_iter=5") + ["--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Starting training from iteration 4 to 5" in r.stdout
    assert sorted(losses(copy)) == [1, 2, 3, 4, 5]


def test_what_counts_as_a_run_in_the_output_dir(tmp_path):
    """Checkpoints, last_checkpoint, or config.yaml with metrics.json refuse a new training; a missing or empty
    folder, or one of unrelated files (a config.yaml alone included), is trained into."""
    from libai_lite.engine.run_folder import existing_run_refusal

    out = tmp_path / "out"
    assert existing_run_refusal(str(out)) is None
    out.mkdir()
    assert existing_run_refusal(str(out)) is None
    (out / "notes.txt").write_text("mine")
    (out / "config.yaml").write_text("train: {}\n")
    (out / ".lock").write_text("{}")  # left by a killed run, held by no one
    assert existing_run_refusal(str(out)) is None
    (out / "metrics.json").write_text("{}\n")
    assert existing_run_refusal(str(out)) == (
        f"train.output_dir={out} already holds a run (config.yaml, metrics.json) with no last_checkpoint to "
        f"continue from; give a new train.output_dir=..., or add --resume to train it again from iteration 0 there")
    (out / "metrics.json").unlink()
    (out / "model_0000003.tmp").mkdir()
    assert "already holds a run (model_0000003.tmp, config.yaml) with no last_checkpoint" in \
        existing_run_refusal(str(out))
    (out / "last_checkpoint").write_text("model_0000003")
    assert "already holds a run (last checkpoint model_0000003); continue it with --resume" in \
        existing_run_refusal(str(out))


def test_fast_dev_run_on_a_trained_run_writes_only_its_own_folder(run):
    """The demo's check, as `--help` suggests it, on a trained run's own command line (train.output_dir too)."""
    out, cache, _ = run
    before = hashes(out)
    r = train_net(tiny(out, cache, *RUN) + ["--fast-dev-run"])
    assert r.returncode == 0, r.stderr[-3000:]
    after = check_untouched(run, before, "fast_dev_run")
    own = out / "fast_dev_run"
    said = [line for line in r.stdout.splitlines() if "--fast-dev-run writes to" in line]
    assert len(said) == 1 and f"writes to {own}," in said[0], r.stdout[-3000:]
    assert sorted(losses(own)) == list(range(1, 21))
    for name in ("config.yaml", "log.txt", "last_checkpoint", "model_final/.metadata", "model_best/.metadata"):
        assert f"fast_dev_run/{name}" in after, name
    from libai_lite.config import LazyConfig

    saved = LazyConfig.load(str(own / "config.yaml"))
    assert saved.train.output_dir == str(own) and saved.train.train_iter == 20


def test_eval_only_resume_evaluates_the_run_and_writes_only_its_own_folder(run, in_process):
    from libai_lite.config import default_argument_parser
    from libai_lite.engine.launch import launch

    out, cache, _ = run
    before = hashes(out)
    last = out / (out / "last_checkpoint").read_text().strip()
    args = default_argument_parser().parse_args(["--config-file", CONFIG, "--eval-only", "--resume",
                                                 *tiny(out, cache, *RUN)])
    assert launch(args) == 0
    after = check_untouched(run, before, "eval_only")
    assert {k for k in after if k.startswith("eval_only/")} >= {"eval_only/log.txt", "eval_only/config.yaml",
                                                                 "eval_only/results.json"}
    record = json.loads((out / "eval_only" / "results.json").read_text())
    assert record["checkpoint"] == str(last)
    assert {"valid/PPL", "test/PPL"} <= set(record["results"])
    assert all(math.isfinite(v) for v in record["results"].values())
    log = (out / "eval_only" / "log.txt").read_text()
    assert f"Resumed from {last}" in log and f"--eval-only writes to {out / 'eval_only'}," in log


def _evaluate(out, cache, tmp):
    return (["--config-file", CONFIG, "--checkpoint", str(out / "model_final"), "--task", "ppl",
             "--data", "data_test/lambada_sample.jsonl", "--stride", "16", "--output", str(tmp / "ppl.json"),
             *tiny(out, cache)], "evaluate", tmp / "ppl.json")


def _generate(out, cache, tmp):
    return (["--config-file", CONFIG, "--checkpoint", str(out / "model_final"), "--prompt", "The history of",
             "--max-new-tokens", "2", f"train.output_dir={out}", *MODEL], None, None)


def _estimate_memory(out, cache, tmp):
    return ([str(out / "config.yaml"), "--device", "cpu"], None, None)


def _hf_export(out, cache, tmp):
    return (["export", "--config-file", str(out / "config.yaml"), "--checkpoint", str(out / "model_final"),
             "--output", str(tmp / "hf")], None, tmp / "hf" / "config.json")


def _plot_metrics(out, cache, tmp):
    return ([str(out)], "metrics.png", out / "metrics.png")


# tool -> (argv, the path under the run it writes (None: nothing), a file it must have written)
TOOLS = {"evaluate": _evaluate, "generate": _generate, "estimate_memory": _estimate_memory, "hf_convert": _hf_export,
         "plot_metrics": _plot_metrics}


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_a_tool_reading_the_run_writes_only_where_it_says(run, in_process, tmp_path, name):
    out, cache, _ = run
    argv, own, written = TOOLS[name](out, cache, tmp_path)
    before = hashes(out)
    assert tool(name).main(argv) == 0
    check_untouched(run, before, own)
    if own is not None:
        assert any(k == own or k.startswith(own + "/") for k in hashes(out)), own
    if written is not None:
        assert written.is_file(), written


def test_hf_convert_refuses_a_run_folder_as_output(run, in_process, capsys):
    out, _, _ = run
    before = hashes(out)
    argv = ["export", "--config-file", str(out / "config.yaml"), "--checkpoint", str(out / "model_final"),
            "--output", str(out)]
    assert tool("hf_convert").main(argv) == 1
    assert f"which holds the input {out / 'model_final'}" in capsys.readouterr().err
    check_untouched(run, before, None)


def test_the_checks_own_folders_follow_train_output_dir():
    """The demo's own folder, and train.output_dir given on the command line, both get the subfolder."""
    from libai_lite.config import LazyConfig
    from libai_lite.engine.launch import own_output_dir

    def where(flags, *opts):
        cfg = LazyConfig.apply_overrides(LazyConfig.load(str(ROOT / CONFIG)), list(opts))
        resume_dir = own_output_dir(cfg, argparse.Namespace(**flags))
        return cfg.train.output_dir, resume_dir

    assert where({"fast_dev_run": True}) == ("output/gpt2_pretrain/fast_dev_run", None)
    assert where({"eval_only": True}) == ("output/gpt2_pretrain/eval_only", "output/gpt2_pretrain")
    assert where({"eval_only": True, "fast_dev_run": True}, "train.output_dir=/r") == ("/r/eval_only", "/r")
    assert where({"fast_dev_run": False, "eval_only": False}, "train.output_dir=/r") == ("/r", None)
    # An empty output_dir stays empty, for the trainer to refuse naming the key.
    assert where({"fast_dev_run": True}, "train.output_dir=''") == ("", None)
