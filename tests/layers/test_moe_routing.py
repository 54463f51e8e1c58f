"""DeepSeek-style MoE routing (libai_lite/layers/moe.py): sigmoid scores with auxiliary-loss-free bias
balancing, shared experts, and their settings' errors.

The bias steers the choice only; after each optimizer step it moves towards balanced loads, which on a
batch that sends every token to the same experts balances them with no auxiliary loss; on 2 gloo ranks
the update is the one-process update of the global batch.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.launch import spawn_ranks

from libai_lite.layers import MoEConfig, MoELayer, collect_moe_outputs
from libai_lite.layers.moe import router_bias_after_optimizer_step, update_router_biases
from libai_lite.layers.router import route
from libai_lite.utils.errors import UsageError


def _layer(**moe) -> MoELayer:
    torch.manual_seed(0)
    cfg = MoEConfig(**{"enabled": True, "num_experts": 4, "top_k": 2, "capacity_factor": None,
                       "router": "sigmoid_bias", "aux_loss_weight": 0.0, **moe})
    return MoELayer(cfg, hidden_size=8, ffn_hidden_size=16, activation="gelu")


# ------------------------------------------------------------------ routing on hand-made logits


def test_sigmoid_routing_chooses_on_score_plus_bias_and_gates_by_the_scores():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = torch.sigmoid(logits)
    r = route(logits, top_k=2, capacity_factor=None, router="sigmoid_bias")
    assert r.expert_index.tolist() == [[0, 1]]
    torch.testing.assert_close(r.gates, s[:, :2] / s[:, :2].sum())
    torch.testing.assert_close(r.probs, s / s.sum())
    # A bias on expert 3 makes it the first choice; its gate is still its own score's share.
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    r = route(logits, top_k=2, capacity_factor=None, router="sigmoid_bias", bias=bias)
    assert r.expert_index.tolist() == [[3, 0]]
    torch.testing.assert_close(r.gates, torch.stack([s[0, 3], s[0, 0]])[None] / (s[0, 0] + s[0, 3]))
    assert r.load.tolist() == [1, 0, 0, 1]


def test_the_bias_gets_no_gradient_and_is_a_checkpointed_buffer():
    layer = _layer()
    assert "expert_bias" in layer.state_dict() and "expert_load" not in layer.state_dict()
    assert "expert_bias" not in dict(layer.named_parameters())
    out = layer(torch.randn(6, 8))
    out.sum().backward()
    assert layer.router.weight.grad is not None and not layer.expert_bias.requires_grad
    # A softmax layer has neither: today's checkpoint keys.
    softmax = _layer(router="softmax")
    assert not any("expert_bias" in k or "shared" in k for k in softmax.state_dict())
    layer.expert_bias.fill_(0.25)
    fresh = _layer()
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(fresh.expert_bias, torch.full((4,), 0.25))


def test_the_load_is_counted_in_training_forwards_only_and_the_update_moves_towards_the_mean():
    layer = _layer(bias_update_rate=0.01, top_k=1)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 10.0  # every token with a positive feature 0 goes to expert 0
    x = torch.rand(5, 8) + 0.1
    layer.eval()
    layer(x)
    assert layer.expert_load.sum() == 0
    layer.train()
    layer(x)
    assert layer.expert_load.tolist() == [5, 0, 0, 0]
    update_router_biases(layer)
    torch.testing.assert_close(layer.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    assert layer.expert_load.sum() == 0
    # A step the trainer skipped (found_inf = 1) leaves the biases where they are.
    layer(x)
    update_router_biases(layer, skip=torch.tensor(1.0))
    torch.testing.assert_close(layer.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))


def _skewed_batch() -> torch.Tensor:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    x[:, 0] = 2.0  # a feature every token shares, which the router below weighs towards experts 0 and 1
    return x


def _skew(layer: MoELayer) -> None:
    with torch.no_grad():
        layer.router.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
        layer.router.weight[:, 0] = torch.tensor([1.0, 1.0, -0.5, -0.5])


def _train(rate: float, steps: int) -> list[float]:
    """Max/min expert load of each step's routing, the bias moved by the optimizer's post-step hook."""
    layer = _layer(bias_update_rate=rate)
    _skew(layer)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    assert router_bias_after_optimizer_step(opt, layer)
    x, ratios = _skewed_batch(), []
    for _ in range(steps):
        out = layer(x)
        assert collect_moe_outputs(layer)["moe_aux_loss"] == 0  # no auxiliary loss at all
        load = layer.expert_load.float()
        ratios.append(float(load.max() / load.min().clamp(min=1)))
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
    return ratios


def test_bias_updates_balance_a_skewed_batch_without_an_auxiliary_loss():
    fixed = _train(rate=0.0, steps=80)
    assert min(fixed) >= 32  # nearly all 128 assignments on experts 0 and 1, throughout
    balanced = _train(rate=0.01, steps=80)
    assert balanced[0] >= 32
    # Once the biases have closed the score gap (about 40 steps at 0.01), every load stays near the mean of 32.
    assert max(balanced[-20:]) <= 1.5, balanced[-20:]


# ------------------------------------------------------------------ two gloo ranks: the global batch's update


def _bias_after(layer: MoELayer, batches, group=None) -> torch.Tensor:
    opt = torch.optim.SGD(layer.parameters(), lr=0.0)
    router_bias_after_optimizer_step(opt, layer, group)
    for x in batches:
        layer(x).sum().backward()
        opt.step()
    return layer.expert_bias.clone()


def _global_batches():
    g = torch.Generator().manual_seed(5)
    # Rank 0's half sends its tokens to experts 0/1, rank 1's to 1/2: the loads differ rank by rank.
    return [torch.cat([torch.rand(8, 8, generator=g) + 0.5, -torch.rand(8, 8, generator=g) - 0.5]) for _ in range(4)]


def _skewed_layer() -> MoELayer:
    layer = _layer(bias_update_rate=0.01)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0], layer.router.weight[1] = 0.5, 0.2
        layer.router.weight[2] = -0.5
    return layer


def _bias_worker(rank, world_size, init_file, out_file):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        mine = [x.chunk(world_size)[rank] for x in _global_batches()]
        bias = _bias_after(_skewed_layer(), mine, dist.group.WORLD)
        if rank == 0:
            torch.save(bias, out_file)
        else:
            torch.save(bias, out_file + ".1")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_the_bias_update_on_two_gloo_ranks_is_the_one_process_update_of_the_global_batch():
    want = _bias_after(_skewed_layer(), _global_batches())
    # Rank 0's own tokens alone would move the biases elsewhere: the test can tell the two apart.
    local = _bias_after(_skewed_layer(), [x.chunk(2)[0] for x in _global_batches()])
    assert not torch.equal(local, want)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bias.pt")
        spawn_ranks(_bias_worker, 2, (2, os.path.join(tmp, "store"), out))
        assert torch.equal(torch.load(out), want) and torch.equal(torch.load(out + ".1"), want)


# ------------------------------------------------------------------ shared experts


def test_shared_experts_add_a_dense_mlp_every_token_passes_through():
    layer = _layer(router="softmax", num_shared_experts=2)
    assert layer.shared_experts.dense_h_to_4h.out_features == 32  # 2 x the experts' 16
    keys = [k for k in layer.state_dict() if k.startswith("shared_experts.")]
    assert keys == ["shared_experts.dense_h_to_4h.weight", "shared_experts.dense_h_to_4h.bias",
                    "shared_experts.dense_4h_to_h.weight", "shared_experts.dense_4h_to_h.bias"]
    x = torch.randn(2, 3, 8)
    out = layer(x)
    shared, layer.shared_experts = layer.shared_experts, None
    torch.testing.assert_close(out, layer(x) + shared(x))
    sized = _layer(num_shared_experts=1, shared_expert_intermediate_size=40)
    assert sized.shared_experts.dense_4h_to_h.in_features == 40


# ------------------------------------------------------------------ settings


@pytest.mark.parametrize("cfg,needle", [
    (dict(router="sigmoid"), "router='sigmoid' is not a router; did you mean 'sigmoid_bias'?"),
    (dict(router="topk"), "router='topk' is not a router; use one of 'softmax', 'sigmoid_bias'"),
    (dict(bias_update_rate=-1e-3), "bias_update_rate=-0.001 must be a number >= 0"),
    (dict(bias_update_rate="fast"), "bias_update_rate='fast' must be a number >= 0"),
    (dict(num_shared_experts=-1), "num_shared_experts=-1 must be an integer >= 0"),
    (dict(num_shared_experts=1, shared_expert_intermediate_size=0),
     "shared_expert_intermediate_size=0 must be a positive integer"),
    (dict(shared_expert_intermediate_size=64), "is set without shared experts; set model.cfg.moe.num_shared_experts"),
    (dict(grouped_gemm="yes"), "grouped_gemm='yes' must be True or False"),
    (dict(num_shared_expert=1), "did you mean 'num_shared_experts'"),
])
def test_bad_deepseek_settings_are_one_usage_error(cfg, needle):
    with pytest.raises(UsageError) as err:
        MoEConfig.from_mapping(dict(enabled=True, **cfg))
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("model.cfg.moe.") or str(err.value).startswith("unknown key model.cfg.moe.")


# ------------------------------------------------------------------ through the launcher


def test_gpt2_moe_demo_trains_with_sigmoid_bias_routing_and_shared_experts_over_two_ranks(tmp_path):
    """Aux-loss-free routing and a shared expert under ep=2 and ZeRO-2: the trainer's optimizer steps
    move the biases (saved with the model), and no auxiliary loss enters the total."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.layers.test_moe import GPT_MOE, _metrics, _tiny_gpt_moe
    from tests.launch import train_sh

    out = tmp_path / "out"
    r = train_sh(2, _tiny_gpt_moe(out, tmp_path / "cache", "train.train_iter=4", "model.cfg.moe.ep_size=2",
                                  "+model.cfg.moe.router=sigmoid_bias", "model.cfg.moe.aux_loss_weight=0.0",
                                  "+model.cfg.moe.bias_update_rate=0.01", "+model.cfg.moe.num_shared_experts=1",
                                  "train.zero_optimization.enabled=True", "train.zero_optimization.stage=2"),
                 config=GPT_MOE)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(out)
    assert [row["iteration"] for row in rows] == [1, 2, 3, 4]
    assert all(row["moe_aux_loss"] == 0.0 and row["total_loss"] == row["lm_loss"] for row in rows)
    dcp_to_torch_save(out / "model_final", tmp_path / "final.pt")
    state = torch.load(tmp_path / "final.pt", weights_only=False)
    flat = {}

    def walk(d, prefix=""):
        for k, v in d.items():
            (walk(v, f"{prefix}{k}.") if isinstance(v, dict) else flat.__setitem__(f"{prefix}{k}", v))

    walk(state)
    biases = [v for k, v in flat.items() if k.endswith("expert_bias")]
    assert len(biases) == 1 and biases[0].shape == (4,)  # one MoE layer of 4 experts
    # 4 steps of +-0.01 each (0 where an expert sits exactly at the mean load).
    assert biases[0].abs().max() > 0 and biases[0].abs().max() <= 0.04 + 1e-6
    assert any("shared_experts.dense_h_to_4h.weight" in k for k in flat)
    assert not any("expert_load" in k for k in flat)


def test_sigmoid_bias_training_curve_is_the_one_process_curve_under_dp2_and_pp2_with_recomputation(tmp_path):
    """The bias moves by the global batch's loads: data parallelism (loads all-reduced) and a pipeline with
    activation checkpointing (each stage's layers, recomputed micro-batches counted twice) log the
    one-process losses step for step, with the biases moving fast enough to change the routing."""
    from tests.layers.test_moe import GPT_MOE, _assert_same_curve, _metrics, _tiny_gpt_moe
    from tests.launch import train_net, train_sh

    common = ["train.train_iter=5", "model.cfg.moe.every_n_layers=1", "model.cfg.attention_dropout_prob=0.0",
              "model.cfg.output_dropout_prob=0.0", "model.cfg.moe.capacity_factor=null",
              "+model.cfg.moe.router=sigmoid_bias", "model.cfg.moe.aux_loss_weight=0.0",
              "+model.cfg.moe.bias_update_rate=0.05"]
    one = tmp_path / "one"
    r = train_net(_tiny_gpt_moe(one, tmp_path / "cache", *common), config=GPT_MOE)
    assert r.returncode == 0, r.stderr[-4000:]
    keys = ("total_loss", "lm_loss", "moe_load_max", "grad_norm")
    for name, extra in (("dp2", []), ("pp2_actckpt", ["train.dist.pipeline_parallel_size=2",
                                                      "train.activation_checkpoint.enabled=True"])):
        out = tmp_path / name
        r = train_sh(2, _tiny_gpt_moe(out, tmp_path / "cache", *common, *extra), config=GPT_MOE)
        assert r.returncode == 0, r.stderr[-4000:]
        _assert_same_curve(_metrics(out), _metrics(one), keys=keys, tol=1e-4)
