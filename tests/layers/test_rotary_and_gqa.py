"""Rotary position embeddings against transformers', grouped-query attention against plain math, its
tensor-parallel layout and KV cache, and the refusal of a tensor-parallel size the key/value heads do not allow.
(Beside tests/layers/test_layers.py, which is at the 450-line limit.)"""
import math

import pytest
import torch
from torch import nn

from libai_lite.layers import MultiheadAttention, RMSLayerNorm, RotaryEmbedding, TransformerLayer, apply_rotary
from libai_lite.layers.attention import KVCache
from libai_lite.parallel.tensor_parallel import check_declared_splits
from libai_lite.utils.errors import UsageError

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("theta, scaling", [(10000.0, None), (500000.0, LLAMA3)])
def test_rotary_matches_transformers(theta, scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=512, rope_theta=theta,
                         rope_scaling=scaling)
    positions = torch.tensor([[0, 1, 5, 77, 300, 511]])
    x = torch.randn(1, 2, 6, 32)
    ref_cos, ref_sin = LlamaRotaryEmbedding(config)(x, positions)
    cos, sin = RotaryEmbedding(32, theta, scaling)(positions)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    ref_q, _ = apply_rotary_pos_emb(x, x, ref_cos, ref_sin)
    assert torch.equal(apply_rotary(x, cos, sin), ref_q)


def test_rotary_refuses_unknown_scaling():
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        RotaryEmbedding(16, scaling={"rope_type": "yarn", "factor": 2.0})


def _reference_gqa(x, attn: MultiheadAttention, rotary=None):
    """Plain-math causal attention reading the fused weight as [kv_heads, group + 2, head_size]."""
    bsz, t, _ = x.shape
    kv, g, hd = attn.num_key_value_heads, attn.group, attn.head_size
    y = attn.query_key_value(x).view(bsz, t, kv, g + 2, hd)
    q = y[:, :, :, :g].reshape(bsz, t, kv * g, hd).transpose(1, 2)
    k, v = (y[:, :, :, j].transpose(1, 2) for j in (g, g + 1))
    if rotary is not None:
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    # Query head h reads key/value head h // g (transformers' repeat_kv).
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1),
                                                                   float("-inf"))
    return attn.dense((scores.softmax(-1) @ v).transpose(1, 2).reshape(bsz, t, -1))


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_attention_matches_plain_math(kv_heads):
    attn = MultiheadAttention(64, 4, num_key_value_heads=kv_heads, bias=False, qkv_bias=True, rope_theta=1e4).eval()
    assert attn.query_key_value.weight.shape == (kv_heads * (4 // kv_heads + 2) * 16, 64)
    assert attn.query_key_value.bias is not None and attn.dense.bias is None
    nn.init.normal_(attn.query_key_value.bias)
    x = torch.randn(2, 7, 64)
    rotary = RotaryEmbedding(16, 1e4)(torch.arange(7))
    torch.testing.assert_close(attn(x), _reference_gqa(x, attn, rotary), atol=1e-5, rtol=1e-5)
    shifted = torch.arange(3, 10)[None]
    torch.testing.assert_close(attn(x, position_ids=shifted), _reference_gqa(x, attn, RotaryEmbedding(16)(shifted)),
                               atol=1e-5, rtol=1e-5)


def test_grouped_query_split_over_ranks_reproduces_full():
    """tp=2 over 2 key/value heads: each rank's contiguous half of the fused rows is one whole group."""
    attn = MultiheadAttention(64, 4, num_key_value_heads=2, bias=False, rope_theta=1e4).eval()
    x = torch.randn(2, 5, 64)
    full = attn(x)
    total = 0
    for r in range(2):
        local = MultiheadAttention(64, 4, num_key_value_heads=2, bias=False, rope_theta=1e4).eval()
        rows, cols = attn.query_key_value.weight.shape[0] // 2, attn.dense.weight.shape[1] // 2
        local.query_key_value.weight = nn.Parameter(attn.query_key_value.weight[r * rows:(r + 1) * rows].clone())
        local.dense.weight = nn.Parameter(attn.dense.weight[:, r * cols:(r + 1) * cols].clone())
        total = total + local(x)
    torch.testing.assert_close(total, full, atol=1e-5, rtol=1e-5)


def test_kv_cache_holds_only_key_value_heads_and_decodes_as_full():
    attn = MultiheadAttention(64, 4, num_key_value_heads=1, bias=False, rope_theta=1e4).eval()
    x = torch.randn(2, 6, 64)
    full = attn(x)
    cache = KVCache(capacity=6)
    # Without position_ids the new positions follow the cached ones.
    steps = [attn(x[:, :4], kv_cache=cache)]
    steps += [attn(x[:, i:i + 1], kv_cache=cache) for i in (4, 5)]
    assert cache.key.shape == (2, 1, 6, 16)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_tensor_parallel_size_must_divide_key_value_heads():
    with torch.device("meta"):
        layer = TransformerLayer(64, 128, 4, num_key_value_heads=2, norm="rmsnorm", gated=True, activation="silu")
    check_declared_splits(layer, 2, {"num_key_value_heads": 2})
    with pytest.raises(UsageError) as e:
        check_declared_splits(layer, 4, {"num_attention_heads": 4, "num_key_value_heads": 2})
    msg = str(e.value)
    assert "\n" not in msg
    assert "tensor_parallel_size=4 does not divide model.cfg.num_key_value_heads=2" in msg


def test_llama_style_transformer_layer():
    layer = TransformerLayer(64, 96, 4, num_key_value_heads=2, bias=False, norm="rmsnorm", gated=True,
                             activation="silu", layer_idx=3, rope_theta=5e5, rope_scaling=LLAMA3)
    assert isinstance(layer.input_layernorm, RMSLayerNorm) and isinstance(layer.post_attention_layernorm, RMSLayerNorm)
    assert layer.mlp.gated and layer.mlp.dense_h_to_4h.weight.shape == (192, 64) and layer.mlp.dense_h_to_4h.bias is None
    assert layer.self_attention.num_key_value_heads == 2 and layer.layer_idx == 3
    x = torch.randn(2, 5, 64)
    assert layer.self_attention.rotary.scaling == LLAMA3
    assert layer(x, position_ids=torch.arange(5)[None]).shape == (2, 5, 64)
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads 3"):
        MultiheadAttention(64, 4, num_key_value_heads=3)
