"""Settings that were silently ignored or replaced are refused in one line naming the setting and the fix:
virtual pipeline stages with no pipeline, an evaluation window of 0 tokens (it became 128), an eval_metric
the evaluator never gives (model_best was never written)."""
import sys

import pytest

from libai_lite.utils.errors import UsageError
from libai_lite.utils.parallel_dims import ParallelDims
from tests.launch import one_error_line, python_tool, tiny, train_net


def test_virtual_pipeline_stages_without_a_pipeline_are_refused():
    with pytest.raises(UsageError, match=r"virtual_pipeline_size=2 splits .*pipeline_parallel_size=1 \(no pipeline\)"):
        ParallelDims.resolve(2, {"virtual_pipeline_size": 2})
    # A pipeline capped to one stage on fewer processes (the recipe's documented convenience) still runs.
    dims = ParallelDims.resolve(1, {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2})
    assert dims.pipeline_parallel_size == 1


def test_an_eval_metric_the_evaluator_does_not_give_stops_the_run_at_the_first_evaluation(tmp_path):
    out = tmp_path / "run"
    r = train_net(tiny(out, tmp_path / "cache", "train.train_iter=4", "train.evaluation.enabled=True",
                       "train.evaluation.eval_period=2", "train.evaluation.eval_iter=1",
                       "train.evaluation.eval_metric=Accuracy"))
    line = one_error_line(r)
    assert r.returncode != 0 and "train.evaluation.eval_metric='Accuracy' is not a metric the evaluator gives (" in line
    assert "PPL" in line and "model_best would never be saved" in line, line


def test_evaluate_with_a_window_of_zero_tokens_is_refused(tmp_path):
    r = python_tool([sys.executable, "tools/evaluate.py", "--config-file", "projects/GPT/configs/gpt2_pretrain.py", "--checkpoint",
                     str(tmp_path / "none"), "--task", "ppl", "--seq-length", "0"])
    line = one_error_line(r)
    assert r.returncode != 0 and line.startswith("error: --seq-length 0 must be at least 1"), line
    assert not any(tmp_path.iterdir())
