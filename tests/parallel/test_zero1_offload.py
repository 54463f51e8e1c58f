"""ZeRO-1 with the optimizer offloaded to the host (DeepSpeed's stage 1 + ``offload_optimizer``) through
tools/train.sh on 2 processes: the losses of plain ZeRO-1, and a resume from its checkpoint that continues the
uninterrupted curve (the host optimizer state saved and loaded through DCP). Its fp16 overflow skips are in
tests/engine/test_fp16_overflow.py, its numerics and DCP round trips in tests/parallel/test_data_parallel.py."""
import json
import shutil

import pytest

from tests.launch import losses, tiny, train_sh

STEPS = 6
ZERO1 = ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=1"]
OFFLOAD = [*ZERO1, "train.zero_optimization.offload=True"]
# Dropout off: the two runs must see the same numbers, not just the same distribution.
COMMON = [f"train.train_iter={STEPS}", "train.evaluation.enabled=False", "train.checkpointer.period=3",
          "model.cfg.attention_dropout_prob=0.0", "model.cfg.output_dropout_prob=0.0"]


def _optim_keys(checkpoint) -> set:
    from torch.distributed.checkpoint import FileSystemReader

    keys = {k for k in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata if k.startswith("optim.")}
    assert any(k.endswith(".exp_avg_sq") for k in keys), sorted(keys)[:5]
    return keys


def _resume_from_iteration_3(src, out, cache):
    """Copy the run at ``src`` to ``out`` as if it had stopped after its iteration-3 checkpoint, and resume it."""
    shutil.copytree(src, out)
    (out / "last_checkpoint").write_text("model_0000002")
    with open(out / "metrics.json") as f:
        rows = [line for line in f if json.loads(line)["iteration"] <= 3]
    (out / "metrics.json").write_text("".join(rows))
    return train_sh(2, tiny(out, cache, *COMMON, *OFFLOAD) + ["--resume"])


def test_zero1_offload_trains_as_zero1_and_resumes_on_its_own_curve(tmp_path):
    cache = tmp_path / "cache"
    plain, offload = tmp_path / "zero1", tmp_path / "zero1_offload"
    for out, zero in ((plain, ZERO1), (offload, OFFLOAD)):
        r = train_sh(2, tiny(out, cache, *COMMON, *zero))
        assert r.returncode == 0, r.stderr[-3000:]
    want, got = losses(plain), losses(offload)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    for it in got:
        assert got[it] == pytest.approx(want[it], rel=1e-5, abs=1e-6), (it, got, want)
    # Both ranks' shards of the optimizer state are saved, under the keys plain ZeRO-1 saves.
    assert _optim_keys(offload / "model_0000002") == _optim_keys(plain / "model_0000002")

    resumed = tmp_path / "resumed"
    r = _resume_from_iteration_3(offload, resumed, cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Resumed from" in (resumed / "log.txt").read_text()
    curve = losses(resumed)
    for it in range(4, STEPS + 1):
        assert curve[it] == pytest.approx(got[it], rel=1e-6, abs=1e-7), (it, curve, got)
