"""The log line's loss is the mean over the steps since the last line and says so; a metrics.json row
holds the logged step's value (what plots draw) and that mean as `<key>_window_mean`."""
import json
import re

import pytest

from tests.launch import tiny, train_net


def test_log_line_mean_and_last_step_value_are_named_apart(tmp_path):
    out = tmp_path / "out"
    r = train_net(tiny(out, tmp_path / "cache", "train.train_iter=4", "train.log_period=2",
                       "train.evaluation.enabled=False", "train.checkpointer.period=100"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.json").read_text().splitlines()]
    rows = [row for row in rows if "total_loss" in row]
    assert [row["iteration"] for row in rows] == [2, 4]
    log = (out / "log.txt").read_text()
    shown = [float(x) for x in re.findall(r"total_loss: ([\d.]+)", log)]
    assert "lm_loss: " in log and log.count("(mean of 2 steps)") == 2
    for row, value in zip(rows, shown):
        # One process: the printed mean is the row's window mean to the printed 4 decimals.
        assert row["total_loss_window_mean"] == pytest.approx(value, abs=6e-5)
        assert row["lm_loss_window_mean"] == pytest.approx(row["total_loss_window_mean"])
    # Losses fall step to step at lr 1.5e-3: the last step's value is not the window's mean.
    assert rows[0]["total_loss"] != pytest.approx(rows[0]["total_loss_window_mean"], abs=1e-4)
