"""The periodic hook and its writers: the log line, metrics.json and TensorBoard rows of fixed steps are
byte for byte those of the hook before the writers were split out of it; a failed metrics.json write
leaves whole rows; the hook order."""
import errno
import json
import logging
import types

import pytest
import torch

from libai_lite.engine import hooks
from libai_lite.engine.writers import JSONWriter
from libai_lite.utils.events import EventStorage

# Written by the pre-split PeriodicWriter (commit 120f1c2) from the steps of `_train` below.
LINES = [
    'iteration: 2/5  consumed_samples: 32  total_loss: 2.4167  lm_loss: 1.5714 (mean of 2 steps)  '
    'lr: 2.000e-04  grad_norm: 0.391  loss_scale: 65536  time: 0.1385 s/it  data_time: 0.0050 s/it  '
    'samples/s: 115.56  tokens/s: 14791  TFLOP/s/rank: 0.098  MFU: 98.2%  max_mem: 1.4G  eta: 0:00:00',
    'iteration: 4/5  consumed_samples: 64  total_loss: 2.2250  lm_loss: 1.8571 (mean of 2 steps)  '
    'lr: 4.000e-04  grad_norm: 0.573  loss_scale: 65536  time: 0.2923 s/it  data_time: 0.0250 s/it  '
    'samples/s: 54.74  tokens/s: 7006  TFLOP/s/rank: 0.047  MFU: 46.5%  max_mem: 1.4G  eta: 0:00:00',
    'iteration: 5/5  consumed_samples: 80  total_loss: 2.1667  lm_loss: 2.0714  lr: 5.000e-04  '
    'grad_norm: 0.664  loss_scale: 65536  time: 0.4077 s/it  data_time: 0.0400 s/it  samples/s: 39.25  '
    'tokens/s: 5023  TFLOP/s/rank: 0.033  MFU: 33.4%  max_mem: 1.4G  eta: 0:00:00',
]
ROWS = [{'consumed_samples': 32,
  'data_time': 0.01,
  'grad_norm': 0.3909091055393219,
  'iteration': 2,
  'lm_loss': 1.6428571939468384,
  'lm_loss_window_mean': 1.5714285969734192,
  'loss_scale': 65536.0,
  'lr': 0.0002,
  'max_mem_bytes': 1500000000.0,
  'mfu': 0.9822222222222221,
  'samples_per_sec': 90.43478260869564,
  'tflops_per_rank': 0.09822222222222221,
  'time': 0.17692307692307693,
  'tokens_per_sec': 11575.652173913042,
  'total_loss': 2.3333332538604736,
  'total_loss_window_mean': 2.416666626930237},
 {'iteration': 3, 'valid/PPL': 12.5},
 {'consumed_samples': 64,
  'data_time': 0.03,
  'grad_norm': 0.5727272629737854,
  'iteration': 4,
  'lm_loss': 1.9285714626312256,
  'lm_loss_window_mean': 1.8571428656578064,
  'loss_scale': 65536.0,
  'lr': 0.0004,
  'max_mem_bytes': 1500000000.0,
  'mfu': 0.4652631578947369,
  'samples_per_sec': 48.37209302325581,
  'tflops_per_rank': 0.046526315789473686,
  'time': 0.3307692307692308,
  'tokens_per_sec': 6191.627906976743,
  'total_loss': 2.200000047683716,
  'total_loss_window_mean': 2.225000023841858},
 {'consumed_samples': 80,
  'data_time': 0.04,
  'grad_norm': 0.6636363863945007,
  'iteration': 5,
  'lm_loss': 2.0714285373687744,
  'lm_loss_window_mean': 2.0714285373687744,
  'loss_scale': 65536.0,
  'lr': 0.0005,
  'max_mem_bytes': 1500000000.0,
  'mfu': 0.33358490566037735,
  'samples_per_sec': 39.24528301886792,
  'tflops_per_rank': 0.033358490566037735,
  'time': 0.4076923076923077,
  'tokens_per_sec': 5023.396226415094,
  'total_loss': 2.1666667461395264,
  'total_loss_window_mean': 2.1666667461395264}]


class _Metric:
    def __init__(self, reduce):
        self.reduce = reduce


class _Wandb:
    """Records what a WandbWriter is given."""

    def __init__(self):
        self.rows = []

    def write(self, iteration, scalars):
        self.rows.append({"iteration": iteration, **scalars})

    def close(self):
        pass


def _train(out, monkeypatch, caplog, wandb=None):
    """Five fixed steps through a PeriodicWriter logging every 2, an evaluation result after step 3."""
    monkeypatch.setattr(hooks, "time", types.SimpleNamespace(perf_counter=lambda: 1.0))
    monkeypatch.setattr(hooks, "peak_memory_bytes", lambda device: 1.5e9)
    layout = types.SimpleNamespace(device=torch.device("cpu"), world_size=2, group=lambda name: None)
    storage = EventStorage()
    trainer = types.SimpleNamespace(max_iter=5, start_iter=0, iter=0, storage=storage, check_skipped=lambda: None)
    writer = hooks.PeriodicWriter(output_dir=str(out), period=2, global_batch_size=16, tokens_per_sample=128,
                                  flops_per_sample=1.7e9, peak_flops=1e11,
                                  consumed_fn=lambda: 16 * (trainer.iter + 1), layout=layout,
                                  metrics={"lm_loss": _Metric("mean")}, wandb=wandb)
    writer.trainer = trainer
    with caplog.at_level(logging.INFO, logger="libai_lite"):
        writer.before_train()
        for it in range(5):
            trainer.iter = it
            storage.begin(it)
            storage.put_scalars(total_loss=torch.tensor(2.0 + 1 / (it + 2)), lm_loss=torch.tensor(1.5 + it / 7),
                                lr=1e-4 * (it + 1), grad_norm=torch.tensor(0.3 + it / 11), time=0.1 + it / 13,
                                data_time=0.01 * it, loss_scale=65536.0)
            if it == 2:
                storage.put_scalar("valid/PPL", 12.5)
            writer.after_step()
        trainer.iter = 5
        writer.after_train()
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("iteration: ")]


def test_log_line_and_metrics_json_are_the_pre_split_ones(tmp_path, monkeypatch, caplog):
    wandb = _Wandb()
    assert _train(tmp_path, monkeypatch, caplog, wandb) == LINES
    text = (tmp_path / "metrics.json").read_text()
    assert text == "".join(json.dumps(row, sort_keys=True) + "\n" for row in ROWS)
    # W&B gets exactly metrics.json's rows.
    assert [json.loads(line) for line in text.splitlines()] == wandb.rows


def test_tensorboard_gets_every_scalar_but_consumed_samples(tmp_path, monkeypatch, caplog):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _train(tmp_path, monkeypatch, caplog)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {k for row in ROWS for k in row} - {"iteration", "consumed_samples"}
    assert [e.step for e in events.Scalars("total_loss")] == [2, 4, 5]
    assert [e.step for e in events.Scalars("valid/PPL")] == [3]


def test_a_failed_metrics_json_write_leaves_the_whole_rows(tmp_path):
    writer = JSONWriter(str(tmp_path))
    writer.write(1, {"loss": 1.0})

    class HalfFull:
        """Takes 5 bytes, then the disk is full."""

        def __init__(self, file):
            self.file, self.taken = file, False

        def fileno(self):
            return self.file.fileno()

        def write(self, data):
            if self.taken:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.taken = True
            return self.file.write(data[:5])

    writer._file = HalfFull(writer._file)
    with pytest.raises(OSError):
        writer.write(2, {"loss": 2.0})
    assert (tmp_path / "metrics.json").read_text() == '{"iteration": 1, "loss": 1.0}\n'
    writer._file = writer._file.file
    writer.close()


def test_hooks_in_order_puts_the_row_before_the_checkpoints_and_the_signal_stop_after_them():
    made = {name: hooks.HookBase() for name in ("timer", "evaluation", "writer", "checkpointer", "best",
                                                 "signal_checkpointer", "profiler")}
    names = {id(h): name for name, h in made.items()}
    assert [names[id(h)] for h in hooks.hooks_in_order(**made)] == list(made)
    assert [names[id(h)] for h in hooks.hooks_in_order(made["timer"], made["writer"], made["checkpointer"],
                                                        made["signal_checkpointer"])] == [
        "timer", "writer", "checkpointer", "signal_checkpointer"]
