"""A tool given its own input as its output refuses before any work: the input byte-identical, exit status 1,
exactly one `error:` line naming both paths and the fix, no temporary left; tools/evaluate.py without --output
writes nothing at all, and its log folder's lock goes even with a traceback.

The trained run is tests/engine/test_no_overwrite.py's fixture; each tool runs in this process from the
repository root, as there.
"""
import contextlib
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.data.test_corpus_formats import _write_fairseq_data_bin
from tests.data.test_preprocess_data import GPT2_FLAGS
from tests.engine.test_no_overwrite import in_process, run, tool  # noqa: F401 - fixtures
from tests.launch import CONFIG, ROOT, mounted_tmpfs, one_error_line, tiny
from tests.launch import tree_hashes as hashes


def refused(code: int, capsys, *paths) -> str:
    """The one error line of a refused tool run, checked to name each of ``paths`` and say where to write."""
    assert code == 1
    line = one_error_line(SimpleNamespace(stderr=capsys.readouterr().err))
    for path in paths:
        assert str(path) in line, line
    assert "; give " in line, line
    return line


def no_temporaries(*folders):
    return [str(p) for folder in folders for p in Path(folder).rglob("*") if ".tmp" in p.name]


def test_preprocess_data_refuses_to_write_over_its_fairseq_input(tmp_path, capsys):
    from tests.data.test_preprocess_data import preprocess

    folder = tmp_path / "data-bin"
    _write_fairseq_data_bin(folder, [["a", "b", "c"], ["b", "d"]])
    for ext in (".bin", ".idx"):
        (folder / f"train{ext}").rename(folder / f"train_text_document{ext}")
    before = hashes(folder)
    source = folder / "train_text_document.bin"
    code = preprocess.main(["--input", str(source), "--output-prefix", str(folder / "train"), *GPT2_FLAGS])
    line = refused(code, capsys, source)
    assert "--output-prefix would write" in line
    assert hashes(folder) == before and not no_temporaries(tmp_path)


@pytest.mark.parametrize("where", ["the checkpoint", "the run holding it"])
def test_hf_convert_export_refuses_its_checkpoint_or_the_run_holding_it(run, in_process, capsys, where):  # noqa: F811
    out, _, _ = run
    before = hashes(out)
    ckpt = out / "model_final"
    target = ckpt if where == "the checkpoint" else out
    code = tool("hf_convert").main(["export", "--config-file", str(out / "config.yaml"), "--checkpoint", str(ckpt),
                                    "--output", str(target), "--force"])
    refused(code, capsys, ckpt, target)
    assert hashes(out) == before and not no_temporaries(out.parent)


def test_evaluate_refuses_to_write_results_over_its_data(run, in_process, tmp_path, capsys):  # noqa: F811
    out, cache, _ = run
    data = tmp_path / "held_out.jsonl"
    shutil.copyfile(ROOT / "data_test" / "lambada_sample.jsonl", data)
    before, run_before = hashes(tmp_path), hashes(out)
    code = tool("evaluate").main(["--config-file", CONFIG, "--checkpoint", str(out / "model_final"), "--task", "ppl",
                                  "--data", str(data), "--output", str(data), *tiny(tmp_path / "ev", cache)])
    refused(code, capsys, data)
    assert hashes(tmp_path) == before and hashes(out) == run_before
    assert not (tmp_path / "ev").exists() and not no_temporaries(tmp_path)


@pytest.mark.parametrize("where", ["metrics.json", "a directory"])
def test_plot_metrics_refuses_its_metrics_file_or_a_directory_as_the_png(run, tmp_path, capsys, where):  # noqa: F811
    out, _, _ = run
    before = hashes(out)
    target = out / "metrics.json" if where == "metrics.json" else tmp_path / "plots"
    if where == "a directory":
        target.mkdir()
    code = tool("plot_metrics").main([str(out), "-o", str(target)])
    refused(code, capsys, target)
    assert hashes(out) == before and not no_temporaries(out, tmp_path)


def test_evaluate_without_output_writes_nothing_under_the_output_dir_or_the_cwd(run, in_process, tmp_path,  # noqa: F811
                                                                               capsys):
    out, cache, _ = run
    # A relative train.output_dir, as the project configs have, starts at the working directory (the repository).
    rel = os.path.relpath(tmp_path / "ev", ROOT)
    top, run_before = sorted(os.listdir(ROOT)), hashes(out)
    code = tool("evaluate").main(["--config-file", CONFIG, "--checkpoint", str(out / "model_final"), "--task",
                                  "lambada", "--data", "data_test/lambada_sample.jsonl", *tiny(rel, cache)])
    assert code == 0, capsys.readouterr().err[-3000:]
    assert "lambada: lambada_acc: " in capsys.readouterr().out
    assert not (tmp_path / "ev").exists() and sorted(os.listdir(ROOT)) == top and hashes(out) == run_before


def test_evaluate_with_output_releases_its_log_folder_lock_after_a_traceback(run, in_process, tmp_path,  # noqa: F811
                                                                             monkeypatch):
    from libai_lite.engine.eval_only import EvalOnlyTrainer

    out, cache, _ = run

    def fail(*args):
        raise RuntimeError("not a user error")

    monkeypatch.setattr(EvalOnlyTrainer, "_inference", fail)
    with pytest.raises(RuntimeError, match="not a user error"):
        tool("evaluate").main(["--config-file", CONFIG, "--checkpoint", str(out / "model_final"), "--task",
                               "lambada", "--data", "data_test/lambada_sample.jsonl", "--output",
                               str(tmp_path / "r.json"), *tiny(tmp_path / "ev", cache)])
    assert (tmp_path / "ev" / "evaluate" / "log.txt").is_file()
    assert not (tmp_path / "ev" / "evaluate" / ".lock").exists() and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("where", ["the checkpoint", "inside it"])
def test_convert_checkpoint_refuses_its_megatron_checkpoint_or_a_folder_in_it(tmp_path, capsys, where):
    from tests.tools.test_convert_checkpoint import _tool, _weights, write_megatron_legacy

    src = tmp_path / "megatron"
    write_megatron_legacy(src, _weights())
    before = hashes(src)
    target = src if where == "the checkpoint" else src / "converted"
    code = _tool().main(["--from", "megatron", "--input", str(src), "--output", str(target), "--force"])
    refused(code, capsys, src, target)
    assert hashes(src) == before and not no_temporaries(tmp_path)


@pytest.mark.parametrize("name", ["evaluate", "plot_metrics", "hf_convert"])
@pytest.mark.parametrize("where", ["under a regular file", "on a read-only filesystem"])
def test_an_output_that_cannot_be_written_is_one_line_and_leaves_nothing(run, in_process, tmp_path, capsys,  # noqa: F811
                                                                         name, where):
    """hf_convert's staging folder on a read-only filesystem was an OSError traceback."""
    out, cache, _ = run
    before = hashes(out)
    with contextlib.ExitStack() as stack:
        if where == "under a regular file":
            base = tmp_path / "a_file"
            base.write_text("not a folder")
        else:
            base = stack.enter_context(mounted_tmpfs(tmp_path / "ro", "1m", readonly=True))
        target = base / {"evaluate": "results.json", "plot_metrics": "curves.png", "hf_convert": "hf"}[name]
        argv = {
            "evaluate": ["--config-file", CONFIG, "--checkpoint", str(out / "model_final"), "--task", "lambada",
                         "--data", "data_test/lambada_sample.jsonl", "--output", str(target),
                         *tiny(tmp_path / "ev", cache)],
            "plot_metrics": [str(out), "-o", str(target)],
            "hf_convert": ["export", "--config-file", str(out / "config.yaml"), "--checkpoint",
                           str(out / "model_final"), "--output", str(target)],
        }[name]
        code = tool(name).main(argv)
        assert code == 1
        line = one_error_line(SimpleNamespace(stderr=capsys.readouterr().err))
        assert str(base) in line and " give " in line, line
        assert ("is a file, not a directory" if where == "under a regular file" else "Read-only file system") \
            in line, line
        assert hashes(out) == before and not no_temporaries(tmp_path) and not target.exists()
