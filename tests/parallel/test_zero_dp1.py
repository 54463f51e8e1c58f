"""ZeRO at data-parallel size 1 without offload trains the plain model (nothing to shard), and its
checkpoints resume under FSDP at dp=2 on the same loss curve (DCP reads plain and sharded state alike)."""
import json
import logging
import shutil

import pytest
import torch

from tests.launch import losses, tiny, train_net, train_sh

from libai_lite.parallel.data_parallel import apply_data_parallel

STEPS = 6
ZERO2 = ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=2"]
COMMON = [f"train.train_iter={STEPS}", "train.evaluation.enabled=False", "train.checkpointer.period=3",
          "model.cfg.attention_dropout_prob=0.0", "model.cfg.output_dropout_prob=0.0",
          "train.train_micro_batch_size=2", "train.global_batch_size=8", *ZERO2]


class _OneRankMesh:
    """What apply_data_parallel reads of a dp mesh of one rank."""

    def size(self):
        return 1


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_at_dp1_without_offload_returns_the_plain_model_and_says_so(stage, caplog):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with caplog.at_level(logging.INFO, logger="libai_lite"):
        out = apply_data_parallel(model, _OneRankMesh(), stage)
    assert out is model and not any(type(p).__name__ == "DTensor" for p in model.parameters())
    assert [r.getMessage() for r in caplog.records if "nothing to shard" in r.getMessage()] == [
        f"ZeRO stage {stage} at data-parallel size 1 without offload: nothing to shard, training the plain model "
        f"(no FSDP)"]


@pytest.mark.slow  # two launches (a minute and a half on the loaded 2-core CI machine)
def test_dp1_zero2_checkpoint_resumes_under_fsdp_at_dp2(tmp_path):
    src = tmp_path / "dp1"
    r = train_net(tiny(src, tmp_path / "cache", *COMMON))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "nothing to shard" in (src / "log.txt").read_text()
    reference = losses(src)
    out = tmp_path / "dp2"
    shutil.copytree(src, out)
    # Resume from the iteration-3 checkpoint, as if the one-process run had stopped there.
    (out / "last_checkpoint").write_text("model_0000002")
    with open(out / "metrics.json") as f:
        rows = [line for line in f if json.loads(line)["iteration"] <= 3]
    (out / "metrics.json").write_text("".join(rows))
    r = train_sh(2, tiny(out, tmp_path / "cache", *COMMON) + ["--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    log = (out / "log.txt").read_text()
    assert "data_parallel_size changed from 1 to 2" in log
    curve = losses(out)
    for it in range(4, STEPS + 1):
        assert curve[it] == pytest.approx(reference[it], rel=2e-4, abs=2e-4), it
