"""A rank persistently slower than the others is named in the log line (host timers gathered over the
control group at the log period); a balanced run names nobody, a world of one gathers nothing."""
import pytest

from libai_lite.engine.straggler import StragglerWatch
from tests.launch import tiny, train_net, train_sh

RUN = ["train.evaluation.enabled=False", "train.train_iter=24", "train.log_period=6",
       "train.checkpointer.period=1000"]


def _log(out):
    return (out / "log.txt").read_text()


def test_a_rank_sleeping_in_its_forward_is_named_in_log_txt(tmp_path):
    out = tmp_path / "run"
    r = train_sh(2, tiny(out, tmp_path / "cache", *RUN, "model._target_=tests.engine.slow_rank_model.SlowOnRankOne"))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in _log(out).splitlines() if "straggler: " in line]
    # Named from the second slow log period on: periods 2, 3 and 4 of 4.
    assert len(lines) == 3, lines
    assert all("straggler: rank 1 took " in line and "rank 0" not in line for line in lines), lines
    assert "the median step time (" in lines[0] and "over the last 6 steps, 2 log periods running" in lines[0], lines


def test_a_balanced_run_names_nobody(tmp_path):
    out = tmp_path / "run"
    r = train_sh(2, tiny(out, tmp_path / "cache", *RUN))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "straggler" not in _log(out)


def test_the_watch_needs_consecutive_slow_periods_and_compares_within_a_pipeline_stage():
    watch = StragglerWatch(1.2, 2, world_size=4, rank=0)
    assert watch.judge([0.5, 0.5, 0.9, 0.5], 20) is None
    assert watch.judge([0.5, 0.5, 0.5, 0.5], 20) is None  # the run of slow periods is broken
    assert watch.judge([0.5, 0.5, 0.91, 0.5], 20) is None
    line = watch.judge([0.5, 0.5, 0.91, 0.5], 20)
    assert line == ("straggler: rank 2 took 1.8x the median step time (0.91 s vs 0.50 s) over the last 20 steps, "
                    "2 log periods running (host time per step outside backward)")
    # Slower by less than min_seconds: the jitter of millisecond steps.
    fast = StragglerWatch(1.2, 1, world_size=2, rank=0, min_seconds=0.02)
    assert fast.judge([0.010, 0.015], 20) is None and "rank 1 took" in fast.judge([0.010, 0.031], 20)
    # Two stages of two ranks: stage 1's ranks are slower than stage 0's by design, not stragglers.
    staged = StragglerWatch(1.2, 1, world_size=4, rank=0, pipeline_parallel_size=2)
    assert staged.judge([0.5, 0.5, 0.9, 0.9], 20) is None
    assert "rank 3 took" in staged.judge([0.5, 0.5, 0.9, 1.2], 20)


def test_a_world_of_one_gathers_nothing(monkeypatch):
    from libai_lite.engine import straggler

    monkeypatch.setattr(straggler, "all_reduce_sum", lambda *a, **k: pytest.fail("gathered in a world of one"))
    assert StragglerWatch(1.2, 1, world_size=1, rank=0).observe(5.0, 20) is None


def test_the_watch_is_off_in_a_world_of_one_and_when_ratio_is_null():
    from libai_lite.run_sections import LogSettings
    from libai_lite.utils.distributed import Layout
    from libai_lite.utils.parallel_dims import ParallelDims

    one, two = Layout.of(ParallelDims.resolve(1, {})), Layout.of(ParallelDims.resolve(2, {}))
    assert StragglerWatch.for_run(LogSettings(period=20), one) is None
    assert StragglerWatch.for_run(LogSettings(period=20, straggler_ratio=None), two) is None
    assert StragglerWatch.for_run(LogSettings(period=20), two) is not None


@pytest.mark.parametrize("key, value", [("ratio", 1.0), ("ratio", 0.5), ("periods", 0), ("min_seconds", -1)])
def test_a_setting_out_of_its_range_is_one_line(key, value):
    from omegaconf import OmegaConf

    from libai_lite.run_sections import check_settings
    from libai_lite.utils.errors import UsageError

    cfg = OmegaConf.create({"train": {"straggler": {"ratio": 1.2, "periods": 2, "min_seconds": 0.02, key: value}}})
    with pytest.raises(UsageError, match=rf"train\.straggler\.{key}={value} is out of range"):
        check_settings(cfg)
