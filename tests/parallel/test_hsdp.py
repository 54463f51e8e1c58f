"""HSDP: the data-parallel ranks as replicate x shard groups (``train.dist.data_parallel_replicate_size`` x
``data_parallel_shard_size``), FSDP2 over the 2-D ("dp_replicate", "dp_shard") mesh.

In process: the sizes, the refusals and the planner's counting. Under torchrun/gloo: 2 x 2 on four ranks trains the
one-process loss curve, and its checkpoint resumes on two ranks of plain ZeRO-3 and on one process.
"""
import dataclasses
import json
import shutil

import pytest
import torch

from libai_lite.planning import MemoryPlanner, PlanSettings
from libai_lite.utils.errors import UsageError
from libai_lite.utils.parallel_dims import ParallelDims
from tests.launch import losses, one_error_line, tiny, train_net, train_ranks, train_sh

ZERO3 = {"enabled": True, "stage": 3}


@pytest.mark.parametrize("dist,expected", [
    ({}, (1, 4)),
    ({"data_parallel_replicate_size": 2}, (2, 2)),
    ({"data_parallel_shard_size": 4}, (1, 4)),
    ({"data_parallel_shard_size": 1}, (4, 1)),
    ({"data_parallel_replicate_size": 2, "data_parallel_shard_size": 2}, (2, 2)),
    # data_parallel_size keeps its meaning: the flattened replicate x shard ranks.
    ({"data_parallel_size": 4, "data_parallel_shard_size": 2}, (2, 2)),
])
def test_replicate_and_shard_sizes_split_the_data_parallel_size(dist, expected):
    dims = ParallelDims.resolve(4, dist, ZERO3)
    assert dims.data_parallel_size == 4
    assert (dims.data_parallel_replicate_size, dims.data_parallel_shard_size) == expected
    assert dims.hsdp == (expected[0] > 1)


def test_the_start_up_line_names_hsdp():
    dims = ParallelDims.resolve(8, {"data_parallel_replicate_size": 2, "tensor_parallel_size": 2}, ZERO3)
    assert dims.describe_dp() == "dp 4 = 2 replicate x 2 shard (HSDP)"
    assert ParallelDims.resolve(4, {}, ZERO3).describe_dp() == "dp=4"
    assert dims.sizes()["data_parallel_replicate_size"] == 2 and dims.sizes()["data_parallel_shard_size"] == 2


@pytest.mark.parametrize("dist,zero,needle", [
    ({"data_parallel_replicate_size": 2, "data_parallel_shard_size": 3}, ZERO3, "= 6 is not the data-parallel size 4"),
    ({"data_parallel_replicate_size": 3}, ZERO3, "data_parallel_replicate_size=3 does not divide"),
    ({"data_parallel_shard_size": 3}, ZERO3, "data_parallel_shard_size=3 does not divide"),
    ({"data_parallel_replicate_size": 2}, None, "ZeRO stage 0 does not use it"),
    ({"data_parallel_replicate_size": 2}, {"enabled": True, "stage": 1}, "ZeRO stage 1 does not use it"),
    ({"data_parallel_replicate_size": 0}, ZERO3, "must be at least 1"),
    ({"data_parallel_replicate_size": 2, "pipeline_parallel_size": 2, "data_parallel_size": 2}, ZERO3,
     "not supported at ZeRO stage 3; use train.zero_optimization.stage=2"),
])
def test_combinations_that_do_not_split_are_refused_in_one_line(dist, zero, needle):
    with pytest.raises(UsageError, match=needle) as e:
        ParallelDims.resolve(4, dist, zero)
    assert "\n" not in str(e.value)


def test_zero2_and_replication_only_are_accepted():
    assert ParallelDims.resolve(4, {"data_parallel_replicate_size": 2, "pipeline_parallel_size": 2},
                                {"enabled": True, "stage": 2}).hsdp
    assert ParallelDims.resolve(4, {"data_parallel_replicate_size": 2}, {"enabled": True, "stage": 2}).hsdp
    assert ParallelDims.resolve(4, {"data_parallel_replicate_size": 2},
                                {"enabled": True, "stage": 3, "offload": True}).offload


def test_the_planner_counts_a_shard_group_not_the_data_parallel_size():
    """Under HSDP a rank keeps 1/shard of the parameters, gradients and optimizer state, as FSDP over that many
    ranks does: 2 replicate x 2 shard on four ranks holds what ZeRO-3 on two does, twice what it does on four."""
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    cfg = dict(hidden_layers=2, vocab_size=256, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
               max_seq_length=32, embedding_dropout_prob=0.0, attention_dropout_prob=0.0, output_dropout_prob=0.0)
    sample = {"input_ids": torch.zeros(32, dtype=torch.long), "labels": torch.zeros(32, dtype=torch.long)}
    planner = MemoryPlanner(lambda: GPTForPreTraining(cfg), sample)
    base = PlanSettings(world_size=4, data_parallel_size=4, zero_stage=3, device="cpu")
    flat = planner.estimate(base)
    hsdp = planner.estimate(dataclasses.replace(base, data_parallel_replicate_size=2))
    two = planner.estimate(dataclasses.replace(base, world_size=2, data_parallel_size=2))
    assert (hsdp.params, hsdp.grads, hsdp.optimizer) == (two.params, two.grads, two.optimizer)
    assert hsdp.params > flat.params
    assert "dp 4 = 2 replicate x 2 shard (HSDP)" in hsdp.settings.describe()
    with pytest.raises(UsageError, match="ZeRO stage 1 does not use it"):
        planner.estimate(dataclasses.replace(base, data_parallel_replicate_size=2, zero_stage=1))


# ------------------------------------------------------------------ under torchrun, gloo

STEPS = 6
COMMON = [
    f"train.train_iter={STEPS}",
    "train.evaluation.enabled=False",
    "train.checkpointer.period=3",
    "model.cfg.attention_dropout_prob=0.0",
    "model.cfg.output_dropout_prob=0.0",
    "model.cfg.num_attention_heads=4",
    # global batch 8 = micro 2 x dp x accumulation, whatever the layout
    "train.train_micro_batch_size=2",
    "train.global_batch_size=8",
    "tokenization.make_vocab_size_divisible_by=256",
]
HSDP = ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=3",
        "train.dist.data_parallel_replicate_size=2", "train.dist.data_parallel_shard_size=2"]
# As tests/parallel/test_parallel_e2e.py compares layouts: fp32 sums in other orders, over a few steps.
TOL = dict(rel=2e-4, abs=2e-4)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    r = train_net(tiny(tmp / "out", tmp / "cache", *COMMON))
    assert r.returncode == 0, r.stderr[-3000:]
    curve = losses(tmp / "out")
    assert sorted(curve) == list(range(1, STEPS + 1))
    return curve, losses(tmp / "out", key="grad_norm")


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hsdp")
    r = train_ranks(4, tiny(tmp / "out", tmp / "cache", *COMMON, *HSDP))
    assert r.returncode == 0, r.stderr[-4000:]
    return tmp


def _matches(out, reference):
    """``out``'s losses and gradient norms (the clipper's, over the 2-D mesh's shards) are the reference's."""
    ref_losses, ref_norms = reference
    curve, norms = losses(out), losses(out, key="grad_norm")
    assert sorted(curve) == sorted(ref_losses)
    for it in ref_losses:
        assert curve[it] == pytest.approx(ref_losses[it], **TOL), it
        assert norms[it] == pytest.approx(ref_norms[it], **TOL), it


def test_hsdp_2x2_on_four_ranks_trains_the_one_process_curve(reference, hsdp_run):
    _matches(hsdp_run / "out", reference)
    log = (hsdp_run / "out" / "log.txt").read_text()
    assert "dp 4 = 2 replicate x 2 shard (HSDP)" in log
    # FSDP2 got the 2-D mesh, not the flat data-parallel group.
    assert "HSDP: FSDP2 shards each parameter over 2 rank(s) and all-reduces its gradient over 2 replica(s)" in log


def test_hsdp_zero2_with_offload_trains_the_one_process_curve(tmp_path, reference):
    """ZeRO-2 (parameters kept gathered from forward to backward) and CPUOffloadPolicy under the 2-D mesh."""
    zero2 = [a for a in HSDP if "stage" not in a] + ["train.zero_optimization.stage=2",
                                                     "train.zero_optimization.offload=True"]
    r = train_ranks(4, tiny(tmp_path / "out", tmp_path / "cache", *COMMON, *zero2, "train.checkpointer.period=0"))
    assert r.returncode == 0, r.stderr[-4000:]
    _matches(tmp_path / "out", reference)


@pytest.mark.parametrize("name,nproc,layout", [
    ("zero3_dp2", 2, ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=3"]),
    ("ddp_dp2", 2, []),
    ("one", 1, []),
])
def test_hsdp_checkpoint_resumes_under_plain_zero3_ddp_and_one_process(tmp_path, hsdp_run, name, nproc, layout):
    """DCP reshards the 2-D mesh's shards: resumed at iteration 3, the run continues the uninterrupted HSDP curve,
    with the data position kept."""
    src = hsdp_run / "out"
    full = losses(src)
    out = tmp_path / name
    shutil.copytree(src, out)
    (out / "last_checkpoint").write_text("model_0000002")
    with open(out / "metrics.json") as f:
        rows = [line for line in f if json.loads(line)["iteration"] <= 3]
    (out / "metrics.json").write_text("".join(rows))
    r = train_ranks(nproc, tiny(out, hsdp_run / "cache", *COMMON, *layout) + ["--resume"])
    assert r.returncode == 0, r.stderr[-4000:]
    curve = losses(out)
    assert sorted(curve) == list(range(1, STEPS + 1))
    for it in range(4, STEPS + 1):
        assert curve[it] == pytest.approx(full[it], **TOL), (name, it)
    assert f"data_parallel_size changed from 4 to {nproc}" in (out / "log.txt").read_text()


def test_hsdp_without_fsdp_is_refused_at_launch_in_one_line(tmp_path):
    out = tmp_path / "out"
    r = train_sh(2, tiny(out, tmp_path / "cache", "train.train_iter=2", "train.dist.data_parallel_replicate_size=2"),
                 timeout=120)
    assert r.returncode != 0
    assert "ZeRO stage 0 does not use it" in one_error_line(r)
    assert not out.exists()
