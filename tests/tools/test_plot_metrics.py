"""tools/plot_metrics.py: a real run's metrics.json drawn into one PNG of 5 metrics x 2 x-axes, runs
overlaid, a resumed run's repeated iterations kept once (the later), bad input in one line."""
import importlib.util
import json
import sys

import pytest

from tests.launch import ROOT, one_error_line, python_tool, tiny, train_net

pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install -e .[plot])")

spec = importlib.util.spec_from_file_location("plot_metrics_tool", ROOT / "tools" / "plot_metrics.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real 4-iteration run, validated at iterations 2 and 4."""
    tmp = tmp_path_factory.mktemp("plot_train")
    out = tmp / "out"
    r = train_net(tiny(out, tmp / "cache", "train.train_iter=4", "train.evaluation.eval_period=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def write_rows(path, rows):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.json").write_text("".join(json.dumps(r) + "\n" for r in rows))


def curve(ax, label):
    line = next(line for line in ax.get_lines() if line.get_label() == label)
    return list(line.get_xdata()), list(line.get_ydata())


def test_a_real_run_is_drawn_into_one_png_of_ten_panels(run_dir, tmp_path):
    import matplotlib.image

    png = tmp_path / "plots" / "run.png"
    fig = tool.plot({"run": tool.read_metrics(str(run_dir))}, str(png))
    assert len(fig.axes) == 2 * len(tool.PANELS) == 10
    height, width = matplotlib.image.imread(png).shape[:2]
    assert (width, height) == (1200, 1500)  # 2 x 6 in by 5 x 3 in at 100 dpi
    assert not list(png.parent.glob("*.tmp*"))

    rows = [json.loads(line) for line in open(run_dir / "metrics.json")]
    logged = [r for r in rows if "total_loss" in r]
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[::2] == ["loss", "validation perplexity", "learning rate", "gradient norm", "throughput (tokens/s)"]
    loss_by_iter, loss_by_tokens = fig.axes[0], fig.axes[1]
    assert curve(loss_by_iter, "run") == ([r["iteration"] for r in logged], [r["total_loss"] for r in logged])
    tokens = [r["consumed_samples"] * 32 for r in logged]  # tiny(): 32 tokens per sample
    xs, ys = curve(loss_by_tokens, "run")
    assert xs == pytest.approx(tokens, rel=1e-12) and ys == [r["total_loss"] for r in logged]
    assert loss_by_tokens.get_xlabel() == "consumed tokens"
    ppl_its, ppl = curve(fig.axes[2], "run")
    assert ppl_its == [2, 4] and ppl == [r["valid/PPL"] for r in rows if "valid/PPL" in r][-2:]
    assert curve(fig.axes[8], "run")[1] == [r["tokens_per_sec"] for r in logged]


def test_the_command_line_overlays_runs_and_keeps_a_resumed_runs_later_rows(run_dir, tmp_path):
    rows = [json.loads(line) for line in open(run_dir / "metrics.json")]
    # Resumed after iteration 2 with a crash before 4: iterations 3 and 4 logged again, differently.
    resumed = rows + [dict(r, total_loss=r["total_loss"] + 1) for r in rows
                      if r["iteration"] >= 3 and "total_loss" in r]
    write_rows(tmp_path / "resumed", resumed)
    r = python_tool([sys.executable, "tools/plot_metrics.py", str(run_dir), str(tmp_path / "resumed"), "-o",
                     str(tmp_path / "both.png")], timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "both.png").stat().st_size > 0

    merged = tool.read_metrics(str(tmp_path / "resumed"))
    assert sorted(merged) == [1, 2, 3, 4]
    first = {r["iteration"]: r for r in rows if "total_loss" in r}
    assert [merged[i]["total_loss"] for i in (1, 2, 3, 4)] == [first[1]["total_loss"], first[2]["total_loss"],
                                                              first[3]["total_loss"] + 1, first[4]["total_loss"] + 1]
    assert merged[4]["valid/PPL"] == [r for r in rows if "valid/PPL" in r][-1]["valid/PPL"]  # the eval row is merged
    fig = tool.plot({"a": tool.read_metrics(str(run_dir)), "b": merged}, str(tmp_path / "two.png"))
    assert {line.get_label() for line in fig.axes[0].get_lines()} == {"a", "b"}


def test_a_model_without_tokens_is_plotted_against_samples(tmp_path):
    write_rows(tmp_path / "r", [{"iteration": i, "total_loss": 5.0 - i, "lr": 1e-3, "grad_norm": 1.0,
                                 "samples_per_sec": 10.0, "consumed_samples": 8 * i} for i in (1, 2, 3)])
    fig = tool.plot({"r": tool.read_metrics(str(tmp_path / "r"))}, str(tmp_path / "r.png"))
    assert fig.axes[1].get_xlabel() == "consumed samples"
    assert fig.axes[8].get_title() == "throughput (samples/s)"
    assert curve(fig.axes[1], "r")[0] == [8, 16, 24]
    assert fig.axes[2].get_lines() == []  # no validation: the panel says "not logged"


@pytest.mark.parametrize("content,expected", [
    (None, "metrics.json not found; pass a training run's train.output_dir"),
    ("", "metrics.json has no rows yet; plot once the run has logged (train.log_period)"),
    ('{"iteration": 1, "total_loss": 1.0}\nnot json\n{"iteration": 2}\n', "metrics.json line 2 is not a metrics row"),
    # A file of garbage once read as a run with "no rows yet": one bad line is no truncated tail.
    ("garbage, not JSON\n", "metrics.json line 1 is not a metrics row"),
    ("\x89PNG\r\n\x1a\n\xff\xfe binary", "metrics.json line 1 is not a metrics row"),
])
def test_bad_input_is_one_line(tmp_path, content, expected):
    out = tmp_path / "run"
    out.mkdir()
    if content is not None:
        (out / "metrics.json").write_text(content)
    r = python_tool([sys.executable, "tools/plot_metrics.py", str(out)], timeout=120)
    assert r.returncode == 1
    assert one_error_line(r).startswith(f"error: {out}/{expected}")
    assert not (out / "metrics.png").exists()


def test_a_truncated_last_line_is_skipped(tmp_path):
    write_rows(tmp_path / "r", [{"iteration": 1, "total_loss": 2.0}])
    with open(tmp_path / "r" / "metrics.json", "a") as f:
        f.write('{"iteration": 2, "total_lo')
    assert tool.read_metrics(str(tmp_path / "r")) == {1: {"total_loss": 2.0}}


def test_missing_matplotlib_is_one_line_naming_the_install(monkeypatch, tmp_path):
    from libai_lite.utils.errors import UsageError

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(UsageError, match=r"^tools/plot_metrics.py needs matplotlib: pip install -e .\[plot\] "
                                         r"\(or pip install matplotlib\)$"):
        tool.plot({"r": {1: {"total_loss": 1.0}}}, str(tmp_path / "r.png"))
    assert not (tmp_path / "r.png").exists()
