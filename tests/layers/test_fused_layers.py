"""Fused norms, gated MLPs and rotary embeddings against the unfused layers they replaced.

RMSNorm (``F.rms_norm``) against Hugging Face's T5 and Llama norms in fp32 and bf16; the gated MLP's
one GEMM against separate gate and up projections (whole and split over two tensor-parallel ranks),
its Hugging Face joins and splits, and a checkpoint written with separate gate and up weights
(``dense_h_to_4h`` + ``dense_h_to_4h_linear``) resuming into the fused model, optimizer state included.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from libai_lite.checkpoint import Checkpointer
from libai_lite.layers import MLP, RMSLayerNorm
from libai_lite.layers.linear import Linear1D
from libai_lite.layers.mlp import join_gate_up, split_gate_up

ACT = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


# ---------------------------------------------------------------- RMSNorm


def _reference_t5_norm(x, weight, eps):
    """Hugging Face's T5LayerNorm (the layer as it was before F.rms_norm)."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        x = x.to(weight.dtype)
    return weight * x


def test_rms_norm_matches_the_unfused_t5_norm_and_its_gradients():
    norm = RMSLayerNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(3, 7, 48) * 20).requires_grad_()
    ref_w = norm.weight.detach().clone().requires_grad_()
    ref = _reference_t5_norm(x, ref_w, 1e-6)
    out = norm(x)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, norm.weight), g)
    rx, rw = torch.autograd.grad(ref, (x, ref_w), g)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


def test_rms_norm_dtypes_follow_t5():
    x = torch.randn(4, 32) * 30
    w = torch.rand(32) + 0.5
    norm = RMSLayerNorm(32)
    with torch.no_grad():
        norm.weight.copy_(w)
    # bf16 input, fp32 weight (autocast's residual stream): fp32 result, as T5LayerNorm gives it.
    xb = x.bfloat16()
    assert norm(xb).dtype == torch.float32
    torch.testing.assert_close(norm(xb), _reference_t5_norm(xb, w, 1e-6))
    # Half weights: half output; one rounding instead of T5's two, so within bf16's resolution of it.
    half = RMSLayerNorm(32).to(torch.bfloat16)
    with torch.no_grad():
        half.weight.copy_(w)
    out = half(xb)
    assert out.dtype == torch.bfloat16
    exact = _reference_t5_norm(xb.double(), w.bfloat16().double(), 1e-6)
    torch.testing.assert_close(out.double(), exact, atol=0, rtol=2 ** -8)


def test_rms_norm_matches_hugging_face_llama_in_fp32():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ours, theirs = RMSLayerNorm(16, eps=1e-5), LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
    x = torch.randn(2, 5, 16) * 10
    torch.testing.assert_close(ours(x), theirs(x))


# ---------------------------------------------------------------- gated MLP: one GEMM


def _unfused(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    gate, up = split_gate_up(mlp.dense_h_to_4h.weight)
    h = ACT[mlp.activation](F.linear(x, gate)) * F.linear(x, up)
    return F.linear(h, mlp.dense_4h_to_h.weight)


def test_gated_mlp_is_one_gemm_equal_to_separate_gate_and_up():
    torch.manual_seed(0)
    for activation in ACT:
        mlp = MLP(16, 24, activation=activation, gated=True, bias=False)
        assert mlp.dense_h_to_4h.weight.shape == (48, 16)
        x = torch.randn(2, 5, 16)
        torch.testing.assert_close(mlp(x), _unfused(mlp, x))


def test_gated_mlp_draws_the_weights_two_linears_drew():
    # Same seed, same draws: a run from scratch starts where it started before gate and up were fused.
    init = lambda t: nn.init.normal_(t, 0.0, 0.02)  # noqa: E731
    torch.manual_seed(3)
    mlp = MLP(16, 24, gated=True, bias=False, init_method=init)
    torch.manual_seed(3)
    gate = Linear1D(16, 24, bias=False, init_method=init)
    up = Linear1D(16, 24, bias=False, init_method=init)
    torch.testing.assert_close(mlp.dense_h_to_4h.weight, join_gate_up(gate.weight, up.weight), atol=0, rtol=0)


def test_gated_mlp_split_over_two_tensor_parallel_ranks_reproduces_the_whole():
    # A column split hands rank r the contiguous rows [r * 2F/tp, (r + 1) * 2F/tp): with interleaved
    # rows those are gate AND up of features [r * F/tp, (r + 1) * F/tp), what the down split expects.
    torch.manual_seed(0)
    mlp = MLP(16, 24, activation="silu", gated=True, bias=True)
    x = torch.randn(3, 16)
    total = 0
    for r in range(2):
        rows, cols = slice(r * 24, (r + 1) * 24), slice(r * 12, (r + 1) * 12)
        w = mlp.dense_h_to_4h.weight[rows]
        # The rank's own [gate_r; up_r], checked against the whole model's halves.
        gate_r, up_r = split_gate_up(w)
        gate, up = split_gate_up(mlp.dense_h_to_4h.weight)
        assert torch.equal(gate_r, gate[cols]) and torch.equal(up_r, up[cols])
        local = F.linear(x, w, mlp.dense_h_to_4h.bias[rows]).unflatten(-1, (-1, 2))
        h = F.silu(local[..., 0]) * local[..., 1]
        total = total + F.linear(h, mlp.dense_4h_to_h.weight[:, cols])
    torch.testing.assert_close(total + mlp.dense_4h_to_h.bias, mlp(x))


def test_join_and_split_gate_up_are_inverse():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    fused = join_gate_up(gate, up)
    assert fused.shape == (12, 4) and torch.equal(fused[0], gate[0]) and torch.equal(fused[1], up[0])
    g, u = split_gate_up(fused)
    assert torch.equal(g, gate) and torch.equal(u, up)


# ---------------------------------------------------------------- checkpoints from before the fusion


class _OldGatedMLP(nn.Module):
    """The gated MLP as it was: separate gate (``dense_h_to_4h``) and up (``dense_h_to_4h_linear``) GEMMs."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, ffn, bias=False)
        self.dense_h_to_4h_linear = nn.Linear(hidden, ffn, bias=False)
        self.dense_4h_to_h = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.dense_4h_to_h(F.silu(self.dense_h_to_4h(x)) * self.dense_h_to_4h_linear(x))


class _Block(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.norm = RMSLayerNorm(16)
        self.mlp = mlp

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def _train_step(model, opt, x):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def test_a_checkpoint_with_separate_gate_and_up_resumes_into_the_fused_mlp(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    old = _Block(_OldGatedMLP(16, 24))
    old_opt = torch.optim.AdamW(old.parameters(), lr=1e-2)
    for _ in range(2):
        _train_step(old, old_opt, x)
    path = Checkpointer(old, old_opt, str(tmp_path)).save("model_0000001", {"iteration": 1})

    new = _Block(MLP(16, 24, activation="silu", gated=True, bias=False))
    new_opt = torch.optim.AdamW(new.parameters(), lr=1e-2)
    Checkpointer(new, new_opt, str(tmp_path)).load(path)
    fused = new.mlp.dense_h_to_4h.weight
    torch.testing.assert_close(fused, join_gate_up(old.mlp.dense_h_to_4h.weight, old.mlp.dense_h_to_4h_linear.weight),
                               atol=0, rtol=0)
    state = new_opt.state[fused]
    for name in ("exp_avg", "exp_avg_sq"):
        want = join_gate_up(old_opt.state[old.mlp.dense_h_to_4h.weight][name],
                            old_opt.state[old.mlp.dense_h_to_4h_linear.weight][name])
        torch.testing.assert_close(state[name], want, atol=0, rtol=0)
    # The resumed run continues the old one's curve.
    for _ in range(2):
        _train_step(old, old_opt, x)
        _train_step(new, new_opt, x)
    torch.testing.assert_close(new(x), old(x), atol=1e-6, rtol=1e-5)


def test_an_old_state_dict_loads_through_load_state_dict():
    torch.manual_seed(0)
    old = _OldGatedMLP(16, 24)
    new = MLP(16, 24, activation="silu", gated=True, bias=False)
    new.load_state_dict(old.state_dict())
    x = torch.randn(3, 16)
    torch.testing.assert_close(new(x), old(x))


# ---------------------------------------------------------------- rotary: once per step, one cheaper apply


def test_rotary_apply_is_bit_for_bit_the_rotate_half_formula():
    from libai_lite.layers.rotary import RotaryEmbedding, apply_rotary, rotate_half

    cos, sin = RotaryEmbedding(32, 5e5)(torch.tensor([[0, 3, 9, 700]]))
    x = torch.randn(2, 3, 4, 32)
    want = x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)
    assert torch.equal(apply_rotary(x, cos, sin), want)
    # A sin the cache never saw (a caller's own) gives the same.
    assert torch.equal(apply_rotary(x, cos, sin.clone()), want)


def test_rotary_angles_are_computed_once_per_positions_tensor(monkeypatch):
    from libai_lite.layers.rotary import RotaryEmbedding

    calls = []
    angles = RotaryEmbedding._angles
    monkeypatch.setattr(RotaryEmbedding, "_angles", lambda self, *a: calls.append(1) or angles(self, *a))
    layers = [RotaryEmbedding(16) for _ in range(3)]
    pos = torch.arange(6)[None]
    first = [r(pos) for r in layers]
    assert len(calls) == 1 and all(c[0] is first[0][0] for c in first)
    # Another step's positions, another dtype or other frequencies compute again.
    layers[0](torch.arange(6)[None])
    layers[0](pos, torch.bfloat16)
    RotaryEmbedding(16, theta=500.0)(pos)
    assert len(calls) == 4
    # Positions changed in place are not mistaken for the old ones.
    fresh = torch.arange(6)[None]
    cos_before = layers[0](fresh)[0]
    fresh.add_(1)
    assert not torch.equal(layers[0](fresh)[0], cos_before)


def test_llama_computes_its_rotary_angles_once_per_forward(monkeypatch):
    from projects.Llama.configs.model import cfg as base
    from projects.Llama.modeling.llama_model import LlamaForPreTraining

    from libai_lite.layers.rotary import RotaryEmbedding

    cfg = dict(base)
    cfg.update(hidden_layers=3, vocab_size=64, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
               num_key_value_heads=2, max_seq_length=16, attention_dropout_prob=0.0, output_dropout_prob=0.0)
    torch.manual_seed(0)
    model = LlamaForPreTraining(cfg).eval()
    ids = torch.randint(0, 64, (2, 10))
    calls = []
    angles = RotaryEmbedding._angles
    monkeypatch.setattr(RotaryEmbedding, "_angles", lambda self, *a: calls.append(1) or angles(self, *a))
    implicit = model(ids)["logits"]
    assert len(calls) == 1
    explicit = model(ids, position_ids=torch.arange(10)[None].expand(2, -1))["logits"]
    torch.testing.assert_close(implicit, explicit)


def _load_old_checkpoint_under_fsdp(rank, world, store, path, expected_file, result_file):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        new = _Block(MLP(16, 24, activation="silu", gated=True, bias=False))
        fully_shard(new.mlp, mesh=mesh)
        fully_shard(new, mesh=mesh)
        opt = torch.optim.AdamW(new.parameters(), lr=1e-2)
        Checkpointer(new, opt).load(path)
        expected = torch.load(expected_file)
        fused = new.mlp.dense_h_to_4h.weight
        assert type(fused).__name__ == "DTensor" and fused.to_local().shape[0] == 48 // world
        torch.testing.assert_close(fused.full_tensor(), expected["weight"], atol=0, rtol=0)
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[fused][name].full_tensor(), expected[name], atol=0, rtol=0)
        if rank == 0:
            with open(result_file, "w") as f:
                f.write("ok")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_an_old_checkpoint_loads_into_the_fused_mlp_sharded_over_two_ranks(tmp_path):
    from tests.launch import spawn_ranks

    torch.manual_seed(0)
    x = torch.randn(4, 16)
    old = _Block(_OldGatedMLP(16, 24))
    old_opt = torch.optim.AdamW(old.parameters(), lr=1e-2)
    _train_step(old, old_opt, x)
    path = Checkpointer(old, old_opt, str(tmp_path)).save("model_0000000", {"iteration": 0})
    gate, up = old.mlp.dense_h_to_4h.weight, old.mlp.dense_h_to_4h_linear.weight
    expected = {"weight": join_gate_up(gate, up).detach()}
    for name in ("exp_avg", "exp_avg_sq"):
        expected[name] = join_gate_up(old_opt.state[gate][name], old_opt.state[up][name])
    torch.save(expected, tmp_path / "expected.pt")
    spawn_ranks(_load_old_checkpoint_under_fsdp, 2,
                (2, str(tmp_path / "store"), path, str(tmp_path / "expected.pt"), str(tmp_path / "result")))
    assert (tmp_path / "result").read_text() == "ok"


def test_rotary_angles_from_inference_mode_are_not_reused_for_training():
    from libai_lite.layers.rotary import RotaryEmbedding, apply_rotary

    rotary, pos = RotaryEmbedding(16), torch.arange(5)[None]
    with torch.inference_mode():
        rotary(pos)
    q = torch.randn(1, 2, 5, 16, requires_grad=True)
    apply_rotary(q, *rotary(pos)).sum().backward()  # an inference tensor saved for backward would raise
    assert q.grad is not None
