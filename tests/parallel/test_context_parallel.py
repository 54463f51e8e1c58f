"""Context parallelism: the load-balanced sharding, refusals, and numerics against one process under torchrun."""
from pathlib import Path

import pytest
import torch

from libai_lite.parallel.context_parallel import check_context_parallel, shard_positions
from libai_lite.utils.parallel_dims import layout_sizes
from libai_lite.utils.errors import UsageError
from projects.GPT.modeling.gpt_model import GPTForPreTraining
from projects.MT5 import MT5ForPreTraining
from tests.launch import losses, one_error_line, tiny, torchrun, train_net, train_sh
from tests.workers import cp_worker

# The worker's sums run in fp32 in another order than one process's (split over cp, then reduced):
# each of the at most SEQ * hidden terms can move a sum by one rounding, so a loss or gradient may differ
# by about that many ulps of its scale. Anything broken (a wrong mask, a position, a missing reduction)
# moves the loss in its second or third digit.
ULPS = cp_worker.SEQ * 32
FP32_REL = ULPS * torch.finfo(torch.float32).eps


# ---------------------------------------------------------------- sharding


def test_shards_are_load_balanced_and_cover_the_sequence():
    cp, seq = 4, 16
    shards = [shard_positions(seq, cp, r) for r in range(cp)]
    assert shards[0].tolist() == [0, 1, 14, 15]
    assert shards[3].tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat(shards).tolist()) == list(range(seq))
    # Causal work per rank (keys each query sees) is the same on every rank.
    assert len({int((s + 1).sum()) for s in shards}) == 1


# ---------------------------------------------------------------- refusals in one line


def _message(fn, *args) -> str:
    with pytest.raises(UsageError) as info:
        fn(*args)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_layout_refusals_name_the_fix():
    assert layout_sizes(8, {"context_parallel_size": 2, "tensor_parallel_size": 2}) == (1, 2, 2, 2)
    assert "launch a multiple of 4 processes" in _message(layout_sizes, 6, {"context_parallel_size": 4})
    assert "must be at least 1" in _message(layout_sizes, 2, {"context_parallel_size": -1})
    msg = _message(layout_sizes, 4, {"context_parallel_size": 2, "data_parallel_size": 1})
    assert "context_parallel_size(2)" in msg and "data_parallel_size=2" in msg
    msg = _message(shard_positions, 18, 2, 0)
    assert "not divisible by 2 x train.dist.context_parallel_size = 4" in msg


def test_model_refusals():
    with torch.device("meta"):
        mt5 = MT5ForPreTraining(dict(vocab_size=128, hidden_size=32, hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, model_type="mt5"))
        gpt = GPTForPreTraining(cp_worker.GPT)
    assert "is an encoder-decoder" in _message(check_context_parallel, mt5, 2, 1, False)
    assert "pipeline parallelism" in _message(check_context_parallel, gpt, 2, 2, False)
    assert "MoE" in _message(check_context_parallel, gpt, 2, 1, True)
    check_context_parallel(mt5, 1, 2, True)  # cp=1: nothing to refuse


# ---------------------------------------------------------------- numerics under torchrun


def _run(tmp_path: Path, nproc: int, cp: int, tp: int, zero: int) -> list[dict]:
    torchrun(nproc, "tests/workers/cp_worker.py", tmp_path, cp, tp, zero)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(nproc)]


def _check(ranks: list[dict]) -> None:
    for case in cp_worker.CASES:
        ref = ranks[0][case]["ref"]
        # Each data-parallel replica logs its own half's token mean; every half counts as many tokens,
        # so their mean is the one-process loss.
        ours = [sum(r[case]["cp"][i] for r in ranks) / len(ranks) for i in range(len(ref))]
        assert ours == pytest.approx(ref, rel=FP32_REL), case
        for r in ranks:
            assert r[case]["grad_diff"] <= FP32_REL * r[case]["grad_scale"], case


def test_cp2_matches_one_process(tmp_path):
    """GPT, Llama (grouped-query attention, rotary) and packed documents at cp=2."""
    _check(_run(tmp_path, 2, cp=2, tp=1, zero=0))


def test_cp2_tp2_matches_one_process(tmp_path):
    _check(_run(tmp_path, 4, cp=2, tp=2, zero=0))


@pytest.mark.slow
def test_dp2_cp2_zero2_matches_one_process(tmp_path):
    """Gradients reduced and sharded over dp x cp by FSDP2."""
    _check(_run(tmp_path, 4, cp=2, tp=1, zero=2))


# ---------------------------------------------------------------- end to end, as users launch it

E2E = ["train.train_iter=3", "train.evaluation.enabled=False", "train.checkpointer.period=1000",
       "model.cfg.attention_dropout_prob=0.0", "model.cfg.output_dropout_prob=0.0"]


@pytest.mark.slow
def test_train_sh_cp2_matches_one_process(tmp_path):
    ref = train_net(tiny(tmp_path / "ref", tmp_path / "cache", *E2E))
    assert ref.returncode == 0, ref.stderr[-3000:]
    r = train_sh(2, tiny(tmp_path / "cp", tmp_path / "cache", *E2E, "train.dist.context_parallel_size=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    expected, got = losses(tmp_path / "ref"), losses(tmp_path / "cp")
    assert sorted(got) == sorted(expected) == [1, 2, 3]
    for it in expected:
        assert got[it] == pytest.approx(expected[it], rel=FP32_REL), it


def test_train_net_refuses_cp_that_does_not_divide_the_world(tmp_path):
    r = train_net(tiny(tmp_path / "out", tmp_path / "cache", "train.dist.context_parallel_size=2"))
    assert r.returncode != 0
    assert one_error_line(r) == (
        "error: world size 1 is not divisible by pipeline_parallel_size(1) x context_parallel_size(2) x "
        "tensor_parallel_size(1); launch a multiple of 2 processes or change train.dist")


# ---------------------------------------------------------------- the memory planner


def test_planner_divides_activations_by_cp_and_shards_zero_over_dp_x_cp():
    import dataclasses

    from libai_lite.planning import MemoryPlanner, PlanSettings

    sample = {"input_ids": torch.zeros(cp_worker.SEQ, dtype=torch.long),
              "labels": torch.zeros(cp_worker.SEQ, dtype=torch.long)}
    planner = MemoryPlanner(lambda: GPTForPreTraining(cp_worker.GPT), sample)
    dp4 = PlanSettings(world_size=4, data_parallel_size=4, zero_stage=3, device="cpu")
    dp2_cp2 = dataclasses.replace(dp4, data_parallel_size=2, context_parallel_size=2)
    a, b = planner.estimate(dp4), planner.estimate(dp2_cp2)
    assert b.activations == pytest.approx(a.activations / 2)
    # ZeRO-3 shards over dp x cp: four ranks either way.
    assert (b.params, b.grads, b.optimizer) == (a.params, a.grads, a.optimizer)
    assert "cp=2" in b.settings.describe()
    with pytest.raises(UsageError, match="context_parallel_size"):
        planner.estimate(dataclasses.replace(dp2_cp2, data_parallel_size=4))
