"""Megatron-LM's moving validation windows: evaluation k of a run reads window k of the valid split.

Megatron's validation iterator runs on from one evaluation to the next (``evaluate`` books
``consumed_valid_samples += eval_batch_size`` per eval iteration, and a resumed run derives it as
``iteration // eval_interval * eval_iters * global_batch_size``), so its k-th evaluation reads the
samples ``[k * W, (k + 1) * W)`` of the split, ``W = eval_iters * global_batch_size``.
"""
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from libai_lite.data import build_gpt_train_valid_test_loaders, megatron_consumed_valid_samples, megatron_valid_samples
from libai_lite.data.samplers import SequentialEvalSampler
from libai_lite.engine.default import DefaultTrainer
from libai_lite.utils.errors import UsageError
from tests.launch import DATA, ROOT, tiny, train_net

TRAIN_ITER, PERIOD, EVAL_ITER, GLOBAL_BATCH, EVAL_MICRO_BATCH = 6, 2, 2, 8, 2


def _valid_loader(tmp_path, rank=0, dp=1):
    nums = [TRAIN_ITER * GLOBAL_BATCH, megatron_valid_samples(TRAIN_ITER, PERIOD, EVAL_ITER, GLOBAL_BATCH), 0]
    _, valid, _ = build_gpt_train_valid_test_loaders(
        str(ROOT / DATA), "949,50,1", seq_length=32, num_workers=0, cache_dir=str(tmp_path / "cache"),
        train_valid_test_num_samples=nums, micro_batch_size=4, eval_micro_batch_size=EVAL_MICRO_BATCH,
        data_parallel_rank=rank, data_parallel_size=dp)
    return valid


def _evaluations(valid, iterations):
    """The input_ids DefaultTrainer.evaluate feeds its evaluator after each step in `iterations`
    (`TRAIN_ITER`: the evaluation at the end)."""
    cfg = OmegaConf.create({"train": {"global_batch_size": GLOBAL_BATCH, "evaluation": {
        "eval_period": PERIOD, "eval_iter": EVAL_ITER, "evaluator": None}}})
    # What DefaultTrainer.evaluate reads of the run's spec (libai_lite.run_spec.RunSpec).
    spec = SimpleNamespace(eval_iter=EVAL_ITER, batch=SimpleNamespace(global_batch_size=GLOBAL_BATCH),
                           evaluation=SimpleNamespace(period=PERIOD))
    read = []

    def inference(loader, evaluator, eval_iter):
        batches = [b["input_ids"] for _, b in zip(range(eval_iter), loader)]
        read.append(torch.cat(batches))
        return {}

    runs = []
    for it in iterations:
        trainer = SimpleNamespace(cfg=cfg, spec=spec, valid_loader=valid, trainer=SimpleNamespace(iter=it),
                                  _inference=inference)
        DefaultTrainer.evaluate(trainer)
        runs.append(read.pop())
    return runs


def test_sizing_and_window_starts_are_megatrons():
    # (train_iters // eval_interval + 1) windows of eval_iters global batches.
    assert megatron_valid_samples(6, 2, 2, 8) == 4 * 16
    assert megatron_valid_samples(7, 2, 2, 8) == 4 * 16
    # An evaluation reading more than a window (24 > 16 samples) gets room after the last start.
    assert megatron_valid_samples(6, 2, 2, 8, samples_read=24) == 3 * 16 + 24
    assert [megatron_consumed_valid_samples(k, 2, 8) for k in range(4)] == [0, 16, 32, 48]


def test_evaluation_k_reads_window_k(tmp_path):
    valid = _valid_loader(tmp_path)
    samples = valid.dataset
    window = EVAL_ITER * GLOBAL_BATCH
    read = EVAL_ITER * EVAL_MICRO_BATCH
    # EvalHook runs after steps 1 and 3 (0-based: iterations 2 and 4 done) and at the end (6 done).
    # Megatron evaluates at iterations 2, 4, 6 and once more after training: windows 0, 1, 2 and 3;
    # this run skips the periodic one at its last step, so its end evaluation is Megatron's last.
    got = _evaluations(valid, [1, 3, TRAIN_ITER])
    for k, ids in zip([0, 1, 3], got):
        expected = torch.stack([samples[i]["input_ids"] for i in range(k * window, k * window + read)])
        assert torch.equal(ids, expected), k
    assert not torch.equal(got[0], got[1])
    # A run resumed after step 3 (iteration 4 done) evaluates at the same iterations: the same windows.
    assert all(torch.equal(a, b) for a, b in zip(_evaluations(_valid_loader(tmp_path), [3, TRAIN_ITER]), got[1:]))


def test_data_parallel_ranks_share_the_window(tmp_path):
    one = _evaluations(_valid_loader(tmp_path), [3])[0]
    ranks = [_evaluations(_valid_loader(tmp_path, r, 2), [3])[0] for r in range(2)]
    # Rank r holds the r-th micro-batch of every global micro-batch of the same window.
    merged = torch.cat([torch.cat([ranks[r][i:i + EVAL_MICRO_BATCH] for r in range(2)])
                        for i in range(0, len(ranks[0]), EVAL_MICRO_BATCH)])
    assert torch.equal(merged[:len(one)], one)


def test_seek_past_the_split_is_refused():
    sampler = SequentialEvalSampler(10, 0, 2, 0, 1)
    sampler.seek(6)
    assert next(iter(sampler)) == [6, 7]
    with pytest.raises(UsageError, match="cannot start after 11 samples of a split of 10"):
        sampler.seek(11)


def test_resumed_run_evaluates_the_same_windows(tmp_path):
    """tools/train_net.py: the end evaluation of a run resumed mid-way reads the same window and
    gives the same perplexity as the uninterrupted run's."""
    import json

    cache = tmp_path / "cache"
    args = ["train.train_iter=4", "train.evaluation.enabled=True", "train.evaluation.eval_period=2",
            "train.checkpointer.period=2", "train.evaluation.eval_metric=null"]
    out = tmp_path / "run"
    r = train_net(tiny(out, cache, *args))
    assert r.returncode == 0, r.stderr[-3000:]
    log = (out / "log.txt").read_text()
    assert "Evaluating valid window 0: samples from 0 on" in log
    assert "Evaluating valid window 2: samples from 32 on" in log

    def final_ppl(run):
        rows = [json.loads(line) for line in open(run / "metrics.json")]
        return [row["valid/PPL"] for row in rows if "valid/PPL" in row][-1]

    expected = final_ppl(out)
    # Back to the checkpoint after iteration 2 and on again from there.
    (out / "last_checkpoint").write_text("model_0000001")
    r = train_net([*tiny(out, cache, *args), "--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = (out / "log.txt").read_text()[len(log):]
    assert "at iteration 2" in resumed and "Evaluating valid window 2: samples from 32 on" in resumed
    assert final_ppl(out) == expected
