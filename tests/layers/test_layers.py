"""Unit tests for libai_lite.layers: intent attributes, shapes, masking, and tensor-parallel-correct layouts."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from libai_lite.layers import (
    MLP,
    Embedding,
    LayerNorm,
    Linear1D,
    MultiheadAttention,
    ParallelCrossEntropyLoss,
    RMSLayerNorm,
    TransformerLayer,
    VocabEmbedding,
    init_method_normal,
    linear_cross_entropy,
    scaled_init_method_normal,
)
from libai_lite.sbp import broadcast, placements, split


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------- helpers


def _tp_shards_of_attention(attn: MultiheadAttention, tp: int):
    """What each tensor-parallel rank holds: a copy of the module with the column-parallel
    weights cut along output rows and the row-parallel ``dense`` cut along input columns,
    exactly as ColwiseParallel/RowwiseParallel would leave the local tensors."""
    shards = []
    for r in range(tp):
        local = copy.deepcopy(attn)
        col_layers = ["query", "key_value"] if attn.is_cross_attention else ["query_key_value"]
        for name in col_layers:
            lin = getattr(local, name)
            rows = lin.weight.shape[0] // tp
            lin.weight = nn.Parameter(lin.weight[r * rows : (r + 1) * rows].clone())
            lin.bias = nn.Parameter(lin.bias[r * rows : (r + 1) * rows].clone())
        cols = local.dense.weight.shape[1] // tp
        local.dense.weight = nn.Parameter(local.dense.weight[:, r * cols : (r + 1) * cols].clone())
        # The row-parallel bias is added once, after the partial outputs are summed.
        local.dense.bias = None
        shards.append(local)
    return shards


def _reference_attention(x, attn: MultiheadAttention, mask_bias=None, causal=True):
    """Plain-math multi-head attention reading the fused weight as [heads, 3, head_size]."""
    bsz, t, _ = x.shape
    nh, hd = attn.num_attention_heads, attn.head_size
    w = attn.query_key_value.weight.view(nh, 3, hd, -1)
    b = attn.query_key_value.bias.view(nh, 3, hd)
    # [batch, heads, seq, head_size] for each of q, k, v
    q, k, v = (torch.einsum("bti,ndi->bntd", x, w[:, j]) + b[None, :, None, j] for j in range(3))
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    if mask_bias is not None:
        scores = scores + mask_bias
    if causal:
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    ctx = scores.softmax(-1) @ v
    return attn.dense(ctx.transpose(1, 2).reshape(bsz, t, -1))


# ---------------------------------------------------------------- init and Linear1D


def test_init_methods():
    w = torch.empty(400, 400)
    init_method_normal(0.02)(w)
    assert abs(w.std().item() - 0.02) < 1e-3
    scaled_init_method_normal(0.02, num_layers=8)(w)
    assert abs(w.std().item() - 0.02 / 4) < 1e-3


@pytest.mark.parametrize("parallel,sbp", [("col", split(0)), ("row", split(1)), ("data", broadcast)])
def test_linear1d_records_intent(parallel, sbp):
    lin = Linear1D(8, 12, parallel=parallel, layer_idx=3, init_method=init_method_normal(0.02))
    assert isinstance(lin, nn.Linear)
    assert lin.parallel == parallel and lin.layer_idx == 3 and placements(lin.sbp.weight) == (sbp,)
    assert lin.weight.shape == (12, 8)
    assert torch.count_nonzero(lin.bias) == 0, "init_method path zeroes the bias"
    assert lin(torch.randn(2, 5, 8)).shape == (2, 5, 12)


def test_linear1d_rejects_unknown_parallel():
    with pytest.raises(ValueError, match="parallel"):
        Linear1D(4, 4, parallel="column")


def test_linear1d_skip_bias_add():
    lin = Linear1D(8, 4, skip_bias_add=True)
    nn.init.normal_(lin.bias)
    x = torch.randn(3, 8)
    out, bias = lin(x)
    assert bias is lin.bias
    torch.testing.assert_close(out + bias, F.linear(x, lin.weight, lin.bias))


def test_linear1d_reset_parameters_on_meta_then_materialise():
    with torch.device("meta"):
        lin = Linear1D(256, 256, init_method=init_method_normal(0.5))
    lin.to_empty(device="cpu")
    lin.reset_parameters()
    assert abs(lin.weight.std().item() - 0.5) < 0.02


# ---------------------------------------------------------------- embeddings and norms


def test_embeddings_record_intent():
    tok = VocabEmbedding(50, 16, padding_idx=1, init_method=init_method_normal(0.02), layer_idx=0)
    pos = Embedding(32, 16)
    assert isinstance(tok, nn.Embedding) and isinstance(pos, nn.Embedding)
    assert tok.parallel == "vocab" and pos.parallel == "data"
    # A position table must never be mistaken for a vocab-parallel one by an isinstance check.
    assert not isinstance(pos, VocabEmbedding) and not isinstance(tok, Embedding)
    assert torch.count_nonzero(tok.weight[1]) == 0
    assert tok(torch.tensor([[1, 2, 3]])).shape == (1, 3, 16)


def test_layer_norm_has_layer_idx():
    ln = LayerNorm(16, eps=1e-6, layer_idx=5)
    assert isinstance(ln, nn.LayerNorm) and ln.layer_idx == 5 and ln.parallel == "data"


def test_rms_layer_norm_matches_hugging_face_t5():
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    ours, theirs = RMSLayerNorm(16, eps=1e-6), T5LayerNorm(16, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
    x = torch.randn(2, 5, 16) * 30
    torch.testing.assert_close(ours(x), theirs(x))
    assert not hasattr(ours, "bias") or ours.bias is None
    # Half-precision weights give half-precision output; the variance itself was fp32.
    ours_bf16 = copy.deepcopy(ours).to(torch.bfloat16)
    out = ours_bf16(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ours(x), atol=0.1, rtol=0.02)


# ---------------------------------------------------------------- attention


def test_attention_shapes_and_intent():
    attn = MultiheadAttention(32, 4, layer_idx=2)
    assert attn.query_key_value.parallel == "col" and attn.dense.parallel == "row"
    assert attn.query_key_value.weight.shape == (96, 32)
    assert attn.layer_idx == attn.query_key_value.layer_idx == attn.dense.layer_idx == 2
    assert attn(torch.randn(2, 7, 32)).shape == (2, 7, 32)


def test_attention_matches_plain_math_with_head_major_layout():
    attn = MultiheadAttention(32, 4).eval()
    x = torch.randn(2, 6, 32)
    torch.testing.assert_close(attn(x), _reference_attention(x, attn), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_qkv_split_over_ranks_reproduces_full_attention(tp):
    """Each rank takes a contiguous block of qkv output rows and of dense input columns;
    the sum of the ranks' outputs (+ bias once) must equal the unsplit module."""
    attn = MultiheadAttention(32, 4, init_method=init_method_normal(0.2)).eval()
    nn.init.normal_(attn.query_key_value.bias)
    nn.init.normal_(attn.dense.bias)
    x = torch.randn(2, 6, 32)
    full = attn(x)
    partial_sum = sum(shard(x) for shard in _tp_shards_of_attention(attn, tp))
    torch.testing.assert_close(partial_sum + attn.dense.bias, full, atol=1e-5, rtol=1e-5)


def test_cross_attention_split_over_ranks_reproduces_full():
    attn = MultiheadAttention(32, 4, attn_mask_type="padding", is_cross_attention=True, head_size=6).eval()
    nn.init.normal_(attn.query.bias)
    nn.init.normal_(attn.key_value.bias)
    x, enc = torch.randn(2, 5, 32), torch.randn(2, 9, 32)
    enc_mask = torch.ones(2, 9, dtype=torch.bool)
    enc_mask[1, 6:] = False
    full = attn(x, attention_mask=enc_mask, encoder_states=enc)
    assert full.shape == (2, 5, 32)
    partial_sum = sum(s(x, attention_mask=enc_mask, encoder_states=enc) for s in _tp_shards_of_attention(attn, 2))
    torch.testing.assert_close(partial_sum + attn.dense.bias, full, atol=1e-5, rtol=1e-5)
    # Masked encoder positions do not influence the output.
    enc2 = enc.clone()
    enc2[1, 6:] = 100.0
    torch.testing.assert_close(attn(x, attention_mask=enc_mask, encoder_states=enc2), full)


def test_causal_attention_ignores_future():
    attn = MultiheadAttention(32, 4).eval()
    x = torch.randn(1, 8, 32)
    y = x.clone()
    y[:, 5:] = torch.randn(1, 3, 32)
    torch.testing.assert_close(attn(x)[:, :5], attn(y)[:, :5])
    assert not torch.allclose(attn(x)[:, 5:], attn(y)[:, 5:])


def test_padding_mask_and_position_bias_match_plain_math():
    attn = MultiheadAttention(32, 4, attn_mask_type="padding").eval()
    x = torch.randn(2, 6, 32)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, 4:] = False
    position_bias = torch.randn(1, 4, 6, 6)
    additive = position_bias + torch.where(keep, 0.0, float("-inf"))[:, None, None, :]
    expected = _reference_attention(x, attn, mask_bias=additive, causal=False)
    got = attn(x, attention_mask=keep.long(), position_bias=position_bias)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_causal_with_padding_mask_keeps_fully_masked_rows_finite():
    attn = MultiheadAttention(32, 4).eval()
    keep = torch.ones(1, 6, dtype=torch.bool)
    keep[0, :2] = False  # left padding: query 0 and 1 see no key at all
    out = attn(torch.randn(1, 6, 32), attention_mask=keep)
    assert torch.isfinite(out).all()


def test_attention_dropout_only_in_training():
    attn = MultiheadAttention(32, 4, attention_dropout_prob=0.5, output_dropout_prob=0.5)
    x = torch.randn(2, 6, 32)
    attn.eval()
    torch.testing.assert_close(attn(x), attn(x))
    attn.train()
    assert not torch.allclose(attn(x), attn(x))


def test_attention_rejects_causal_cross_attention():
    with pytest.raises(ValueError, match="cross-attention"):
        MultiheadAttention(32, 4, is_cross_attention=True)


# ---------------------------------------------------------------- MLP and transformer layer


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("gated", [False, True])
def test_mlp_split_over_ranks_reproduces_full(activation, gated):
    mlp = MLP(16, 64, activation=activation, gated=gated, layer_idx=1).eval()
    assert mlp.dense_h_to_4h.parallel == "col" and mlp.dense_4h_to_h.parallel == "row"
    x = torch.randn(2, 5, 16)
    full = mlp(x)
    assert full.shape == x.shape
    total = 0
    for r in range(2):
        sl = slice(r * 32, (r + 1) * 32)
        # A gated MLP's gate and up rows are interleaved, so a rank's contiguous block holds both halves.
        rows = slice(2 * r * 32, 2 * (r + 1) * 32) if gated else sl
        up = F.linear(x, mlp.dense_h_to_4h.weight[rows], mlp.dense_h_to_4h.bias[rows])
        if gated:
            gate, linear = up[..., 0::2], up[..., 1::2]
        act = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu}[activation]
        h = act(gate) * linear if gated else act(up)
        total = total + F.linear(h, mlp.dense_4h_to_h.weight[:, sl])
    torch.testing.assert_close(total + mlp.dense_4h_to_h.bias, full, atol=1e-5, rtol=1e-5)


def test_mlp_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation"):
        MLP(8, 32, activation="swish2")


def test_transformer_layer_is_pre_ln_and_stamps_layer_idx():
    layer = TransformerLayer(32, 128, 4, layer_idx=7).eval()
    for mod in layer.modules():
        if not isinstance(mod, nn.Dropout):
            assert getattr(mod, "layer_idx", None) == 7, type(mod).__name__
    x = torch.randn(2, 6, 32)
    h = x + layer.self_attention(layer.input_layernorm(x))
    expected = h + layer.mlp(layer.post_attention_layernorm(h))
    torch.testing.assert_close(layer(x), expected)
    y = x.clone()
    y[:, 4:] = 0
    torch.testing.assert_close(layer(x)[:, :4], layer(y)[:, :4])


# ---------------------------------------------------------------- loss


def test_parallel_cross_entropy_matches_torch_and_ignores_index():
    loss_fn = ParallelCrossEntropyLoss()
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16)
    target = torch.randint(0, 11, (2, 5))
    target[0, 1] = -100
    loss = loss_fn(logits, target)
    assert loss.shape == (2, 5) and loss.dtype == torch.float32
    assert loss[0, 1] == 0
    expected = F.cross_entropy(logits.float().view(-1, 11), target.view(-1), reduction="none").view(2, 5)
    torch.testing.assert_close(loss, expected)
    target[0, 1] = 3
    target[target == 3] = 7
    assert loss_fn(logits, target, ignore_index=7)[target == 7].abs().sum() == 0


def _head_and_loss(fused, hidden, weight, target, amp):
    """Per-token loss of ``hidden @ weight.T`` (fused, or the unfused Linear + ParallelCrossEntropyLoss)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        if fused:
            return linear_cross_entropy(hidden, weight, target)
        return ParallelCrossEntropyLoss()(F.linear(hidden, weight), target)


def _loss_and_grads(fused, hidden, weight, target, token_weights, amp):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = _head_and_loss(fused, h, w, target, amp)
    (loss * token_weights).sum().backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16-autocast"])
def test_linear_cross_entropy_matches_unfused_head_and_loss(amp):
    hidden = torch.randn(3, 40, 32)
    weight = torch.randn(500, 32) * 0.3
    target = torch.randint(0, 500, (3, 40))
    target[0, :7] = -100
    token_weights = torch.rand(3, 40)  # as a loss mask / token-count normalisation would scale them
    fused = _loss_and_grads(True, hidden, weight, target, token_weights, amp)
    unfused = _loss_and_grads(False, hidden, weight, target, token_weights, amp)
    assert fused[0].shape == target.shape and fused[0].dtype == torch.float32
    assert (fused[0][0, :7] == 0).all()
    # The loss is an fp32 softmax of the same logits on both paths.
    torch.testing.assert_close(fused[0], unfused[0], atol=1e-5, rtol=1e-5)
    if not amp:
        for got, expected in zip(fused[1:], unfused[1:]):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
        return
    # Under bf16 both paths round different intermediates; measured against the exact gradient
    # of the same bf16 logits, the fused one must be at least as close as the unfused one.
    exact = _loss_and_grads(False, hidden.bfloat16().double(), weight.bfloat16().double(), target,
                            token_weights.double(), False)
    for got, ref, expected in zip(fused[1:], unfused[1:], exact[1:]):
        fused_err = (got.double() - expected).norm() / expected.norm()
        unfused_err = (ref.double() - expected).norm() / expected.norm()
        assert fused_err < 1e-2 and fused_err <= 1.1 * unfused_err, (fused_err, unfused_err)


def test_linear_cross_entropy_exact_when_the_target_probability_underflows():
    # Logits in the hundreds: the target's softmax probability is 0 in fp32, -log(p) would be inf.
    hidden = torch.randn(4, 8, dtype=torch.float64) * 100
    weight = torch.randn(50, 8, dtype=torch.float64)
    target = torch.tensor([0, 1, 2, 3])
    expected = F.cross_entropy(hidden @ weight.t(), target, reduction="none")
    got = linear_cross_entropy(hidden.float(), weight.float(), target)
    assert torch.isfinite(got).all() and (expected > 100).any()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-3)


def test_linear_cross_entropy_keeps_one_vocab_sized_tensor_for_backward():
    tokens, vocab = 64, 1000
    hidden = torch.randn(tokens, 32, requires_grad=True)
    weight = torch.randn(vocab, 32, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))

    def vocab_sized_saved(fused, amp):
        """(count, bytes) of the distinct [tokens, vocab]-sized tensors kept for backward."""
        saved = {}

        def pack(t):
            if t.numel() >= tokens * vocab:
                saved[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _head_and_loss(fused, hidden, weight, target, amp)
        return len(saved), sum(saved.values())

    for amp in (False, True):
        count, size = vocab_sized_saved(True, amp)
        # One buffer, the softmax in the compute dtype (bf16 under autocast).
        assert count == 1 and size == tokens * vocab * (2 if amp else 4)
        _, unfused_size = vocab_sized_saved(False, amp)
        assert size < unfused_size if amp else size <= unfused_size


def test_transformer_layer_residual_post_layernorm_option():
    layer = TransformerLayer(32, 128, 4, apply_residual_post_layernorm=True).eval()
    x = torch.randn(2, 6, 32)
    normed = layer.input_layernorm(x)
    h = normed + layer.self_attention(normed)
    normed = layer.post_attention_layernorm(h)
    torch.testing.assert_close(layer(x), normed + layer.mlp(normed))
