"""Evaluation says how far it is (LiBai's `Inference done X/Y ... ETA`) and a stop signal during it
ends it on the next batch; the trainer's eval hook then lets the stop checkpoint and exit."""
import logging
import os
import signal
from types import SimpleNamespace

import pytest
import torch

import libai_lite.evaluation.evaluator as ev
from libai_lite.engine.hooks import EvalHook
from libai_lite.utils.process import defer_stop_signals


class _Count(ev.DatasetEvaluator):
    def reset(self):
        self.n = 0

    def process(self, inputs, outputs):
        self.n += 1

    def evaluate(self):
        return {"batches": self.n}


class _Model(torch.nn.Module):
    def forward(self, x):
        return x


def _loader(n):
    return [{"x": torch.ones(2)} for _ in range(n)]


def test_progress_lines_with_done_total_and_eta(monkeypatch, caplog):
    monkeypatch.setattr(ev, "PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="libai_lite"):
        out = ev.inference_on_dataset(_Model(), _loader(5), _Count(), eval_iter=3)
    assert out == {"batches": 3}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Inference done")]
    assert lines and lines[-1].startswith("Inference done 2/3.") and "ETA=" in lines[-1]


def test_stop_signal_during_evaluation_stops_it_and_the_hook_goes_on(caplog):
    seen = []

    class _Stopper(_Count):
        def process(self, inputs, outputs):
            super().process(inputs, outputs)
            if self.n == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # recorded, as during training

    defer_stop_signals(True)
    try:
        with pytest.raises(ev.EvaluationStopped, match="after 2/10 batches"):
            ev.inference_on_dataset(_Model(), _loader(10), _Stopper())
        hook = EvalHook(1, lambda: ev.inference_on_dataset(_Model(), _loader(10), _Count()))
        hook.trainer = SimpleNamespace(storage=SimpleNamespace(put_scalar=lambda k, v: seen.append(k)))
        with caplog.at_level(logging.WARNING, logger="libai_lite"):
            hook._run()  # the signal is still pending: the hook logs it and leaves the stop to the checkpointer
    finally:
        defer_stop_signals(False)
    assert seen == [] and "checkpointing, then stopping" in caplog.text
