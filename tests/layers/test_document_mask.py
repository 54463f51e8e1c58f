"""Packed documents in the attention layer: ``document_ids`` keep each query inside its own document."""
import pytest
import torch

from libai_lite.layers import MultiheadAttention
from libai_lite.layers.attention import KVCache, document_mask

# The GPU paths a CPU can run: CI runs them under the lowest torch setup.py admits too.
pytestmark = pytest.mark.gpu_path

# fp32: a document's rows run through another SDPA kernel and other matmul shapes than alone, which
# reorders sums of at most head_size (16) or seq (10) terms: a few float32 eps, far under 1e-5.
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_document_mask_is_block_diagonal_and_causal():
    docs = torch.tensor([[0, 0, 1, 1, 1, 2]])
    keep = document_mask(docs)
    assert keep.shape == (1, 1, 6, 6) and keep.dtype == torch.bool
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for lo, hi in ((0, 2), (2, 5), (5, 6)):
        expected[lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
    assert torch.equal(keep[0, 0], expected)
    assert torch.equal(document_mask(docs, causal=False)[0, 0], docs[0, :, None] == docs[0, None, :])
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        document_mask(docs[0])


@pytest.mark.parametrize("kv_heads, mask_type", [(4, "causal"), (2, "causal"), (4, "padding")])
def test_each_document_attends_as_if_alone(kv_heads, mask_type):
    attn = MultiheadAttention(64, 4, num_key_value_heads=kv_heads, attn_mask_type=mask_type, rope_theta=10000.0)
    lengths = [3, 5, 2]
    x = torch.randn(2, sum(lengths), 64)
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths)).expand(2, -1)
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(2, -1)
    with torch.no_grad():
        packed = attn(x, position_ids=positions, document_ids=docs)
        start = 0
        for n in lengths:
            alone = attn(x[:, start:start + n])
            torch.testing.assert_close(packed[:, start:start + n], alone, **TOL)
            start += n
        # Without the ids the later documents read the earlier ones: the comparison above can fail.
        assert (attn(x, position_ids=positions)[:, 3:] - packed[:, 3:]).abs().max() > 1e-3


def test_document_ids_combine_with_a_padding_mask():
    attn = MultiheadAttention(32, 2)
    x = torch.randn(1, 6, 32)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1]])
    pad = torch.tensor([[1, 1, 1, 1, 0, 1]])  # key 4 hidden from everyone
    with torch.no_grad():
        got = attn(x, attention_mask=pad, document_ids=docs)
        # Document 1 alone with its second key masked.
        alone = attn(x[:, 3:], attention_mask=pad[:, 3:])
        torch.testing.assert_close(got[:, 3:], alone, **TOL)
        torch.testing.assert_close(got[:, :3], attn(x[:, :3]), **TOL)


def test_without_document_ids_the_mask_free_causal_kernel_stays():
    attn = MultiheadAttention(32, 2)
    q = k = torch.zeros(1, 2, 5, 16)
    assert attn._score_mask(q, k, None, None, None) == (None, True)


def test_document_ids_refuse_a_cache_cross_attention_and_another_length():
    x = torch.randn(1, 4, 32)
    docs = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="no KV cache"):
        MultiheadAttention(32, 2)(x, kv_cache=KVCache(), document_ids=docs)
    with pytest.raises(ValueError, match="cover 3 positions, the sequence 4"):
        MultiheadAttention(32, 2)(x, document_ids=docs[:, :3])
    with pytest.raises(ValueError, match="no cross-attention"):
        MultiheadAttention(32, 2, is_cross_attention=True, attn_mask_type="padding")(
            x, encoder_states=x, document_ids=docs)
