"""The job as a process: signals, killed launchers, two runs in one directory, full disks, resuming a finished run."""
import json
import subprocess
from pathlib import Path

import pytest

from tests.launch import ROOT, losses, one_error_line, tiny, train_net

BASE = ["train.evaluation.enabled=False", "train.checkpointer.period=1000"]


def _rows(out) -> dict:
    """iteration -> the metrics.json row of a training step (the last one written for it)."""
    rows = {}
    for line in (Path(out) / "metrics.json").read_text().splitlines():
        row = json.loads(line)
        if "total_loss" in row:
            rows[row["iteration"]] = row
    return rows


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
