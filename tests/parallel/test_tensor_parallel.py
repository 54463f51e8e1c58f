"""Tensor and sequence parallelism from the declared SBP: refusals, the plan, and numerics under torchrun."""
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from libai_lite.layers import Linear1D, MultiheadAttention
from libai_lite.sbp import broadcast, declare, split
from libai_lite.parallel.tensor_parallel import (
    GatherSequence,
    ReplicateParallel,
    check_declared_splits,
    tensor_parallel_plan,
)
from libai_lite.utils.errors import UsageError

from tests.workers import tp_worker
from tests.launch import spawn_ranks, torchrun
from projects.GPT.modeling.gpt_model import GPTForPreTraining
from tests.workers.tp_worker import TINY_GPT, TinyT5, build, reference

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- split sizes named by the model's config


def _refusal(cfg, tp, model=None) -> str:
    """The one-line refusal of tensor_parallel_size ``tp`` for GPT built (on meta) from ``cfg``."""
    if model is None:
        with torch.device("meta"):
            model = GPTForPreTraining(cfg)
    with pytest.raises(UsageError) as info:
        check_declared_splits(model, tp, cfg)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_heads_not_divisible_names_numbers_and_fix():
    assert _refusal(TINY_GPT, 3) == (
        "tensor_parallel_size=3 does not divide model.cfg.num_attention_heads=4; "
        "use a tensor_parallel_size that divides 4 (1, 2 or 4)"
    )


@pytest.mark.parametrize(
    "override,tp,key",
    [
        (dict(ffn_hidden_size=250), 4, "ffn_hidden_size=250"),
        (dict(vocab_size=130), 4, "vocab_size=130"),
    ],
)
def test_each_split_size_is_checked(override, tp, key):
    msg = _refusal({**TINY_GPT, **override}, tp)
    assert msg.startswith(f"tensor_parallel_size={tp} does not divide model.cfg.{key}")


def test_vocab_refusal_points_at_padding():
    assert "make_vocab_size_divisible_by" in _refusal({**TINY_GPT, "vocab_size": 130}, 4)


def test_config_keys_the_layers_do_not_count_name_the_parameter():
    # The layers count their constructor sizes (num_attention_heads, ffn_hidden_size, vocab_size):
    # a config under other names (Hugging Face T5's d_ff) gets the split parameter named instead.
    model = TinyT5(ffn=250)
    msg = _refusal(dict(d_ff=250), 4, model)
    assert msg.startswith("tensor_parallel_size=4 does not divide dim 0 of enc_mlp.dense_h_to_4h.weight: "
                          "250 blocks of 2 (gate/up row pairs);")
    check_declared_splits(TinyT5(heads=4, head_size=64), 2)  # heads, not their 64-wide width, are split


def test_valid_layouts_pass_and_dictconfig_is_accepted():
    with torch.device("meta"):
        model = GPTForPreTraining(TINY_GPT)
    check_declared_splits(model, 4, OmegaConf.create(TINY_GPT))
    check_declared_splits(model, 1)
    assert "must be at least 1" in _refusal(TINY_GPT, 0, model)


# ---------------------------------------------------------------- the plan (no processes needed)


def test_gpt_plan_from_intent():
    plan = tensor_parallel_plan(build("gpt"))
    tok = plan["GPT_model.embeddings.token_embeddings"]
    assert isinstance(tok, RowwiseParallel) and tok.input_layouts == (Replicate(),)
    assert tok.output_layouts == (Replicate(),)
    head = plan["GPT_model.lm_head"]
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Shard(-1),) and not head.use_local_output
    assert isinstance(plan["GPT_model.layers.0.self_attention.query_key_value"], ColwiseParallel)
    assert isinstance(plan["GPT_model.layers.1.mlp.dense_h_to_4h"], ColwiseParallel)
    for name in ("GPT_model.layers.0.self_attention.dense", "GPT_model.layers.1.mlp.dense_4h_to_h"):
        assert isinstance(plan[name], RowwiseParallel) and plan[name].output_layouts == (Replicate(),)
    for name in ("GPT_model.embeddings.position_embeddings", "GPT_model.layers.0.input_layernorm",
                 "GPT_model.final_layernorm"):
        assert isinstance(plan[name], ReplicateParallel) and plan[name].output_layout == Replicate()
    # Without sequence parallelism activations are whole: nothing gathers, dropouts stay plain.
    assert not any(isinstance(s, (GatherSequence, SequenceParallel)) for s in plan.values())


def test_gpt_plan_with_sequence_parallel():
    plan = tensor_parallel_plan(build("gpt"), sequence_parallel=True)
    assert plan["GPT_model.embeddings.token_embeddings"].output_layouts == (Shard(1),)
    assert plan["GPT_model.embeddings.position_embeddings"].output_layout == Shard(-2)
    assert plan["GPT_model.lm_head"].input_layouts == (Shard(1),)
    assert plan["GPT_model.layers.0.self_attention.dense"].output_layouts == (Shard(1),)
    for name in ("GPT_model.layers.0.input_layernorm", "GPT_model.final_layernorm",
                 "GPT_model.embeddings.dropout", "GPT_model.layers.1.mlp.dropout"):
        assert isinstance(plan[name], SequenceParallel), name
    gathers = {n for n, s in plan.items() if isinstance(s, GatherSequence)}
    assert gathers == {f"GPT_model.layers.{i}.{b}" for i in (0, 1) for b in ("self_attention", "mlp")}


def test_t5_plan_splits_bias_over_heads_and_gathers_encoder_states():
    plan = tensor_parallel_plan(TinyT5(), sequence_parallel=True)
    for name in ("enc_bias.relative_attention_bias", "dec_bias.relative_attention_bias",
                 "cross_attn.query", "cross_attn.key_value", "enc_mlp.dense_h_to_4h"):
        assert isinstance(plan[name], ColwiseParallel), name
    assert plan["lm_head"].output_layouts == (Shard(-1),)  # untied, declared parallel="vocab"
    cross = plan["cross_attn"]
    assert isinstance(cross, GatherSequence) and 2 in cross.indices and "encoder_states" in cross.names
    assert not any(n.endswith("bias") and isinstance(s, GatherSequence) for n, s in plan.items())


def test_a_bias_for_other_heads_than_the_attention_holds_is_refused():
    # What a replicated per-head table gives a rank holding half of the heads under tensor parallelism.
    attn = MultiheadAttention(16, 2, attn_mask_type="padding")
    with pytest.raises(ValueError, match=r'holds 4 heads but this attention 2; .*parallel="col"'):
        attn(torch.randn(1, 3, 16), position_bias=torch.zeros(1, 4, 3, 3))


def test_data_marked_block_stays_replicated_whole():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = Linear1D(8, 16, parallel="col")
            self.down = Linear1D(16, 8, parallel="row")

    model = nn.Sequential(Block(), Block())
    model[1].sbp = declare(weight=broadcast)
    plan = tensor_parallel_plan(model)
    assert isinstance(plan["0.up"], ColwiseParallel) and isinstance(plan["0.down"], RowwiseParallel)
    assert isinstance(plan["1"], ReplicateParallel)
    assert not any(n.startswith("1.") for n in plan)


def test_undeclared_container_with_own_parameters_is_refused():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))
            self.proj = Linear1D(8, 8, parallel="col")

    with pytest.raises(UsageError, match=r"^scaled \(Scaled\) has its own parameters"):
        tensor_parallel_plan(nn.ModuleDict({"scaled": Scaled()}))


def test_plan_follows_declarations_not_layer_classes():
    col = nn.Linear(8, 16)
    col.sbp = Linear1D(8, 16, parallel="col").sbp
    assert isinstance(tensor_parallel_plan(nn.ModuleDict({"col": col}))["col"], ColwiseParallel)
    plan = tensor_parallel_plan(nn.ModuleDict({"norm": nn.LayerNorm(8)}), sequence_parallel=True)
    assert isinstance(plan["norm"], SequenceParallel)  # a plain torch norm reads as LayerNorm's declaration


def test_a_split_torch_cannot_make_is_refused():
    bad = nn.Linear(8, 8)
    bad.sbp = declare(weight=split(1), output=split(-1))
    with pytest.raises(UsageError, match=r"^bad \(Linear\) declares weight S\(1\), bias None, output S\(-1\)"):
        tensor_parallel_plan(nn.ModuleDict({"bad": bad}))


# ---------------------------------------------------------------- numerics under torchrun



def _torchrun(out: Path, nproc: int, tp: int, dp: int) -> list[dict]:
    torchrun(nproc, "tests/workers/tp_worker.py", out, tp, dp)
    return [torch.load(out / f"rank{i}.pt") for i in range(nproc)]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """Results of every rank of one 2-process run (tp=2) of all TP cases."""
    return _torchrun(tmp_path_factory.mktemp("tp2"), nproc=2, tp=2, dp=1)


@pytest.fixture(scope="module")
def references():
    return {kind: reference(kind) for kind in ("gpt", "t5")}


def _assert_matches(got: dict, ref: dict) -> None:
    torch.testing.assert_close(got["loss0"], ref["loss0"], rtol=1e-5, atol=0)
    torch.testing.assert_close(got["nll_sum0"], ref["nll_sum0"], rtol=1e-5, atol=0)
    assert got["grads0"].keys() == ref["grads0"].keys()
    for name, expected in ref["grads0"].items():
        grad = got["grads0"][name]
        assert grad.shape == expected.shape, name
        # Relative to the tensor's scale: single elements near zero have no useful relative error.
        err = (grad - expected).abs().max() / expected.abs().max()
        assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-4, atol=0)
    torch.testing.assert_close(got["grad_norms"], ref["grad_norms"], rtol=1e-4, atol=0)


@pytest.mark.parametrize("kind", ["gpt", "t5"])
@pytest.mark.parametrize("sp", [0, 1], ids=["tp2", "tp2-sequence-parallel"])
def test_tp2_matches_one_process(tp2, references, kind, sp):
    """Loss, every gradient and ten clipped AdamW steps under tp=2 equal one process's."""
    for rank in tp2:
        _assert_matches(rank[f"{kind}_sp{sp}"], references[kind])
    assert len(references[kind]["losses"]) == tp_worker.STEPS


def test_tp2_parameters_are_split_as_declared(tp2):
    gpt, t5 = tp2[0]["gpt_sp0"]["placements"], tp2[0]["t5_sp1"]["placements"]
    assert gpt["GPT_model.embeddings.token_embeddings.weight"] == ["S(0)"]
    assert gpt["GPT_model.layers.0.self_attention.query_key_value.weight"] == ["S(0)"]
    assert gpt["GPT_model.layers.0.self_attention.dense.weight"] == ["S(1)"]
    assert gpt["GPT_model.layers.0.self_attention.dense.bias"] == ["R"]
    assert gpt["GPT_model.embeddings.position_embeddings.weight"] == ["R"]
    assert gpt["GPT_model.final_layernorm.weight"] == ["R"]
    assert "GPT_model.lm_head.weight" not in gpt  # tied: one parameter, listed once
    assert t5["enc_bias.relative_attention_bias.weight"] == ["S(1)"]  # each rank's heads
    assert t5["cross_attn.key_value.weight"] == ["S(0)"]
    assert t5["lm_head.weight"] == ["S(0)"]
    assert t5["dec_ln1.weight"] == ["R"]


@pytest.mark.parametrize("sp", [0, 1])
def test_loss_parallel_never_gathers_the_vocabulary(tp2, sp):
    info = tp2[0][f"loss_comms_sp{sp}"]
    assert info["placements"] == ["S(2)"]
    assert info["local_shape"] == [tp_worker.BATCH, tp_worker.SEQ, tp_worker.VOCAB // 2]
    assert info["grad_local_shape"] == info["local_shape"]
    # Softmax statistics are all-reduced per token; nothing is gathered.
    assert info["comms"] and set(info["comms"]) == {"c10d_functional.all_reduce"}


# With -m slow: test_parallel_e2e's dp2_tp2_zero2 runs the same composition by default.
@pytest.mark.slow
def test_dp2_tp2_matches_one_process_mean_over_batch_halves(tmp_path):
    """("dp", "tp") = (2, 2), FSDP2 over dp and sequence-parallel TP: each dp rank trains on half
    of every batch, and the dp mean equals one process accumulating both halves."""
    ranks = _torchrun(tmp_path, nproc=4, tp=2, dp=2)
    ref = reference("gpt", parts=2)
    by_dp = {}
    for r in ranks:
        by_dp.setdefault(r["meta"]["dp_rank"], []).append(r["gpt_sp1"])
    assert sorted(by_dp) == [0, 1] and all(len(v) == 2 for v in by_dp.values())
    halves = [by_dp[d][0] for d in (0, 1)]
    mean = {
        "loss0": (halves[0]["loss0"] + halves[1]["loss0"]) / 2,
        "nll_sum0": halves[0]["nll_sum0"] + halves[1]["nll_sum0"],
        "losses": [(a + b) / 2 for a, b in zip(halves[0]["losses"], halves[1]["losses"])],
    }
    for r in ranks:
        # Gradients and norms are dp-averaged already, so every rank holds the reference's.
        got = {**r["gpt_sp1"], **mean}
        _assert_matches(got, ref)
    assert ranks[0]["gpt_sp1"]["placements"]["GPT_model.layers.0.mlp.dense_h_to_4h.weight"][1] == "S(0)"


def _vocab_parallel_head_loss(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from libai_lite.layers import linear_cross_entropy

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 6, 16, generator=g)
    weight = torch.randn(40, 16, generator=g) * 0.5  # 40 ids: 20 per rank
    target = torch.randint(0, 40, (2, 6), generator=g)
    target[0, :2] = -100
    token_weights = torch.rand(2, 6, generator=g)
    results = {}
    for amp in (False, True):
        for layout in ("replicated", "sequence"):
            w = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
            full = hidden.clone().requires_grad_()
            # Under sequence parallelism the head gets this rank's slice of the sequence.
            h = full if layout == "replicated" else full.chunk(world, dim=1)[rank]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss, top1 = linear_cross_entropy(h, w, target, return_top1=True)
            (loss * token_weights).sum().backward()
            results[(amp, layout)] = {"loss": loss.detach(), "top1": top1, "grad_hidden": full.grad,
                                      "grad_weight": w.grad.full_tensor()}
    if rank == 0:
        torch.save(results, os.path.join(out, "tp.pt"))
    # Every rank past its last collective before teardown: tearing gloo down while a peer still
    # talks to it can abort the process ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def test_vocab_parallel_fused_head_loss_matches_one_process(tmp_path):
    """The fused head + loss with the vocabulary split over 2 ranks (replicated or sequence-split
    input, fp32 and bf16 autocast): the one-process loss, top-1 and gradients."""
    import socket

    from libai_lite.layers import linear_cross_entropy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_ranks(_vocab_parallel_head_loss, 2, (2, port, str(tmp_path)))
    got = torch.load(tmp_path / "tp.pt")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 6, 16, generator=g)
    weight = torch.randn(40, 16, generator=g) * 0.5
    target = torch.randint(0, 40, (2, 6), generator=g)
    target[0, :2] = -100
    token_weights = torch.rand(2, 6, generator=g)
    for amp in (False, True):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss, top1 = linear_cross_entropy(h, w, target, return_top1=True)
        (loss * token_weights).sum().backward()
        tol = dict(atol=2e-2, rtol=2e-2) if amp else dict(atol=1e-5, rtol=1e-5)
        for layout in ("replicated", "sequence"):
            res = got[(amp, layout)]
            torch.testing.assert_close(res["loss"], loss.detach(), atol=1e-5, rtol=1e-5)
            assert torch.equal(res["top1"], top1)
            grad_hidden = h.grad
            if layout == "sequence":  # rank 0 holds (and gets the gradient of) the first half of the sequence
                grad_hidden = torch.cat([h.grad[:, :3], torch.zeros_like(h.grad[:, 3:])], dim=1)
            torch.testing.assert_close(res["grad_hidden"], grad_hidden, **tol, msg=lambda m, k=(amp, layout): f"{k}: {m}")
            torch.testing.assert_close(res["grad_weight"], w.grad, **tol)
