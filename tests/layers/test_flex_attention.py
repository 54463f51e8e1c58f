"""FlexAttention path (libai_lite.layers.flex_attention) against the dense SDPA path it replaces on a GPU.

The GPU compiles flex; here it runs eagerly on the CPU, the same mask_mod/score_mod and the same
autograd function (torch's eager flex is the reference its kernels are tested against). torch refuses
flex backward on the CPU up front only, so the ``cpu_flex_backward`` fixture lifts that check.
fp32 throughout: outputs agree to a few ulps of the scores' sums, gradients (summed in another order,
over up to q*k terms) to 1e-5 relative.
"""
import logging
import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as torch_flex

import libai_lite.layers.flex_attention as flex_module

from libai_lite.layers import MultiheadAttention
from libai_lite.layers.attention import document_mask
from libai_lite.layers.flex_attention import (AttentionMask, attention_backend, dense_bias, flex_enabled,
                                              relative_index)
from projects.MT5 import MT5Model
from projects.MT5.modeling.relative_position import RelativePositionBias
from projects.MT5.modeling.relative_position import _cached_diagonals

# The GPU paths a CPU can run: CI runs them under the lowest torch setup.py admits too.
pytestmark = pytest.mark.gpu_path

OUT_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture
def cpu_flex_backward(monkeypatch):
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *args: None)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _attention(kind, heads=4, head_size=8, hidden=24, **kw):
    attn = MultiheadAttention(hidden, heads, head_size=head_size, bias=False, softmax_scale=1.0,
                              attn_mask_type="causal" if kind == "causal" else "padding",
                              is_cross_attention=kind == "cross", **kw)
    return attn


def _run(attn, x, backend, enc=None, **kw):
    attn.zero_grad(set_to_none=True)
    table = kw.get("score_table")
    if table is not None:
        table.grad = None
    with attention_backend(backend):
        out = attn(x, encoder_states=enc, **kw)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in attn.named_parameters()}
    if table is not None:
        grads["table"] = table.grad.clone()
    return out.detach(), grads


def _close(a, b):
    out_a, grads_a = a
    out_b, grads_b = b
    torch.testing.assert_close(out_a, out_b, **OUT_TOL)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], **GRAD_TOL, msg=name)


@pytest.mark.parametrize("kind,q_len", [("padding", 40), ("causal", 114)])  # 114: the recipe's decoder, ragged
def test_table_bias_and_padding_through_flex_match_the_dense_bias(cpu_flex_backward, kind, q_len):
    attn = _attention(kind)
    rel = RelativePositionBias(32, 4, bidirectional=kind != "causal")
    torch.nn.init.normal_(rel.weight, std=1.0)
    x = torch.randn(3, q_len, 24)
    padding = torch.ones(3, q_len, dtype=torch.bool)
    padding[0, q_len - 7:] = False
    padding[2, q_len // 2:] = False
    # Today's path: the dense [1, h, q, k] bias from compute_bias and the [b, k] mask, per layer.
    rel.zero_grad()
    with attention_backend("dense"):
        old = attn(x, attention_mask=padding, position_bias=rel.compute_bias(q_len, q_len))
    old.square().sum().backward()
    old_grads = {n: p.grad.clone() for n, p in attn.named_parameters()}
    old_table_grad = rel.weight.grad.clone()
    assert old_table_grad.abs().sum() > 0

    mask = AttentionMask(q_len, q_len, causal=kind == "causal", key_padding=padding)
    for backend in ("flex", "dense"):
        table = rel.table().detach().requires_grad_()
        out, grads = _run(attn, x, backend, attention_mask=mask, score_table=table,
                          score_buckets=rel.diagonal_buckets(q_len, q_len))
        torch.testing.assert_close(out, old.detach(), **OUT_TOL)
        for name, grad in old_grads.items():
            torch.testing.assert_close(grads[name], grad, **GRAD_TOL, msg=name)
        # The bias gradient reaches the [buckets, heads] table and equals the dense bias's, summed per bucket.
        torch.testing.assert_close(grads["table"], old_table_grad, **GRAD_TOL)


def test_cross_attention_padding_through_flex(cpu_flex_backward):
    attn = _attention("cross")
    x, enc = torch.randn(2, 30, 24), torch.randn(2, 50, 24)
    padding = torch.ones(2, 50, dtype=torch.bool)
    padding[1, 33:] = False
    mask = AttentionMask(30, 50, key_padding=padding)
    flex = _run(attn, x, "flex", enc, attention_mask=mask)
    dense = _run(attn, x, "dense", enc, attention_mask=padding)
    _close(flex, dense)
    # The padding is honoured: changing a padded encoder position changes nothing.
    enc2 = enc.clone()
    enc2[1, 40:] = 100.0
    with torch.no_grad(), attention_backend("flex"):
        torch.testing.assert_close(attn(x, encoder_states=enc2, attention_mask=mask), flex[0], **OUT_TOL)


def _documents(batch, seq):
    ids = torch.zeros(batch, seq, dtype=torch.long)
    ids[0, 9:] = 1
    ids[0, 20:] = 2
    ids[1, 15:] = 1
    return ids


@pytest.mark.parametrize("window", [None, 6])
def test_packed_documents_and_window_through_flex_match_the_dense_mask(cpu_flex_backward, window):
    # Grouped-query attention as in Llama/Mistral.
    attn = _attention("causal", heads=4, head_size=8, hidden=32, num_key_value_heads=2, sliding_window=window)
    x = torch.randn(2, 28, 32)
    docs = _documents(2, 28)
    old = _run(attn, x, "dense", document_ids=docs)  # today's per-layer document mask
    mask = AttentionMask(28, 28, causal=True, window=window, document_ids=docs)
    _close(_run(attn, x, "flex", attention_mask=mask), old)
    _close(_run(attn, x, "dense", attention_mask=mask), old)


@pytest.mark.parametrize("window", [None, 5])
def test_attention_mask_is_the_documented_mask_in_both_forms(window):
    docs = _documents(2, 24)
    padding = torch.rand(2, 24) > 0.2
    mask = AttentionMask(24, 24, causal=True, window=window, document_ids=docs, key_padding=padding)
    expected = document_mask(docs, causal=True) & padding[:, None, None, :]
    if window is not None:
        q = torch.arange(24)
        expected = expected & ((q[:, None] - q[None, :]) < window)
    assert torch.equal(mask.keep_mask, expected)
    materialised = torch_flex.create_mask(mask.mask_mod(), 2, 1, 24, 24, device="cpu")
    assert torch.equal(materialised, expected)
    # Queries that are the last ones of longer keys (a cache's layout): causality is aligned to the end.
    tail = AttentionMask(3, 10, causal=True)
    assert torch.equal(tail.keep_mask[0, 0], torch.ones(3, 10, dtype=torch.bool).tril(7))
    assert torch.equal(torch_flex.create_mask(tail.mask_mod(), 1, 1, 3, 10, device="cpu")[0, 0], tail.keep_mask[0, 0])


def test_a_mask_that_does_not_fit_the_attention_is_refused():
    attn = _attention("causal")
    with pytest.raises(ValueError, match="does not fit"):
        attn(torch.randn(1, 8, 24), attention_mask=AttentionMask(8, 8, causal=False))
    with pytest.raises(ValueError, match="heads"):
        attn(torch.randn(1, 8, 24), score_table=torch.zeros(32, 3), score_buckets=torch.zeros(8, 8, dtype=torch.long))


def test_backend_choice():
    assert not flex_enabled("cpu")
    with attention_backend("flex"):
        assert flex_enabled("cpu") and not flex_enabled("cpu", dropout_p=0.1)
    with attention_backend("dense"):
        assert not flex_enabled("cuda")
    with pytest.raises(ValueError, match="backend"):
        with attention_backend("fast"):
            pass


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def fresh_guard():
    """The flex guard with no probe or failure remembered (other tests proved these shapes), and the
    warnings it logs; restored afterwards so later tests do not inherit a fallback."""
    records = _Records()
    log = logging.getLogger("libai_lite")
    log.addHandler(records)
    flex_module._flex_or_dense.reset()
    yield records.lines
    flex_module._flex_or_dense.reset()
    log.removeHandler(records)


def _identity_with_backward(backward):
    """An identity whose backward returns ``backward(grad)``: a kernel that fails or is wrong only there."""
    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad)

    return Identity.apply


def _out_of_resource(grad):
    raise RuntimeError("No valid triton configs. OutOfMemoryError: out of resource: "
                       "triton_tem_fused_flex_attention_backward_0 Required: 245760 Hardware limit:232448")


def _bias_step(attn, rel, x, padding, q_len, backend="flex"):
    """One forward and backward of a T5-biased, padded attention: its output and every gradient."""
    table = rel.table().detach().requires_grad_()
    return _run(attn, x, backend, attention_mask=AttentionMask(q_len, q_len, key_padding=padding),
                score_table=table, score_buckets=rel.diagonal_buckets(q_len, q_len))


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_flex_kernel_failing_at_first_use_falls_back_to_the_dense_path_once(
        cpu_flex_backward, fresh_guard, monkeypatch, where):
    attn, rel = _attention("padding"), RelativePositionBias(32, 4, bidirectional=True)
    torch.nn.init.normal_(rel.weight, std=1.0)
    x, padding = torch.randn(2, 40, 24), torch.ones(2, 40, dtype=torch.bool)
    padding[1, 30:] = False
    dense = _bias_step(attn, rel, x, padding, 40, backend="dense")
    calls = []
    real_flex = flex_module.flex_attention

    def broken_flex(*args, **kwargs):  # the compiled kernel, failing as on the H200
        calls.append(1)
        if where == "forward":
            raise RuntimeError("No valid triton configs. OutOfMemoryError: out of resource: "
                               "triton_tem_fused_flex_attention_0 Required: 245760 Hardware limit:232448")
        return _identity_with_backward(_out_of_resource)(real_flex(*args, **kwargs))

    monkeypatch.setattr(flex_module, "flex_attention", broken_flex)
    for _ in range(3):  # three steps: one probe, one warning, the dense path's numbers (the same ops) every time
        out, grads = _bias_step(attn, rel, x, padding, 40)
        assert torch.equal(out, dense[0]) and grads.keys() == dense[1].keys()
        assert all(torch.equal(grads[name], dense[1][name]) for name in grads)
    # A new shape after the failure goes straight to the dense path too.
    _bias_step(attn, rel, x[:, :33], padding[:, :33], 33)
    assert len(calls) == 1
    assert len(fresh_guard) == 1, fresh_guard
    assert fresh_guard[0].startswith("FlexAttention (40 queries x 40 keys, 4 heads of 8, float32, relative bias) "
                                     "failed at its first use (RuntimeError: No valid triton configs.")
    assert "Required: 245760" in fresh_guard[0] and fresh_guard[0].endswith("dense SDPA attention runs from here on")
    assert flex_module._flex_or_dense.fell_back


def test_a_flex_kernel_failing_after_it_has_run_is_an_error(cpu_flex_backward, fresh_guard, monkeypatch):
    attn, rel = _attention("padding"), RelativePositionBias(32, 4, bidirectional=True)
    x, padding = torch.randn(2, 40, 24), torch.ones(2, 40, dtype=torch.bool)
    real_flex, broken = flex_module.flex_attention, []

    def flex(*args, **kwargs):
        if broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_flex(*args, **kwargs)

    monkeypatch.setattr(flex_module, "flex_attention", flex)
    _bias_step(attn, rel, x, padding, 40)
    broken.append(1)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _bias_step(attn, rel, x, padding, 40)
    assert fresh_guard == [] and not flex_module._flex_or_dense.fell_back


def test_a_flex_kernel_computing_wrong_gradients_falls_back_at_first_use(cpu_flex_backward, fresh_guard, monkeypatch):
    attn, rel = _attention("padding"), RelativePositionBias(32, 4, bidirectional=True)
    x, padding = torch.randn(2, 40, 24), torch.ones(2, 40, dtype=torch.bool)
    padding[1, 30:] = False
    dense = _bias_step(attn, rel, x, padding, 40, backend="dense")
    real_flex = flex_module.flex_attention
    far_off = _identity_with_backward(lambda grad: grad * 1e16)  # the forward right, every gradient far off
    monkeypatch.setattr(flex_module, "flex_attention", lambda *a, **k: far_off(real_flex(*a, **k)))
    for _ in range(2):
        out, grads = _bias_step(attn, rel, x, padding, 40)
        assert torch.equal(out, dense[0]) and all(torch.equal(grads[n], dense[1][n]) for n in grads)
    assert len(fresh_guard) == 1, fresh_guard
    assert "failed at its first use (MismatchError: its gradient 0 differs from dense SDPA attention's by" in \
        fresh_guard[0], fresh_guard


def test_a_right_flex_kernel_passes_the_comparison_in_bf16(cpu_flex_backward, fresh_guard):
    """bf16 rounding of a correct kernel (flex's reference on the CPU against SDPA) is within the tolerance."""
    q, k, v = (torch.randn(2, 4, 114, 64, dtype=torch.bfloat16) for _ in range(3))
    table = torch.randn(32, 4, requires_grad=True)
    mask = AttentionMask(114, 114, causal=True, key_padding=torch.arange(114)[None] < torch.tensor([[114], [70]]))
    with attention_backend("flex"):
        out = flex_module.flex_attend(q, k, v, mask, table, torch.randint(0, 32, (227,)), 1.0)
    out.float().sum().backward()
    assert fresh_guard == [] and not flex_module._flex_or_dense.fell_back


@pytest.mark.parametrize("q_len,k_len,causal", [(114, 114, True), (114, 512, False), (40, 300, False)])
def test_a_biased_flex_call_runs_on_whole_tiles_and_libai_masks_agree(cpu_flex_backward, fresh_guard, monkeypatch,
                                                                       q_len, k_len, causal):
    """Ragged lengths reach the kernel padded to 128, and LiBai's [batch, query, key] masks (a padded query
    sees no key) give the dense path's outputs and gradients, zero rows included."""
    shapes, real_flex = [], flex_module.flex_attention

    def spy(q, k, *args, **kwargs):
        shapes.append((q.shape[-2], k.shape[-2]))
        return real_flex(q, k, *args, **kwargs)

    monkeypatch.setattr(flex_module, "flex_attention", spy)
    lq, lk = torch.tensor([q_len, q_len - 30]), torch.tensor([k_len, k_len - 50 if not causal else q_len - 30])
    keep = (torch.arange(q_len)[None, :, None] < lq[:, None, None]) & (torch.arange(k_len)[None, None] < lk[:, None, None])
    results = {}
    for backend in ("flex", "dense"):
        torch.manual_seed(1)
        q = torch.randn(2, 4, q_len, 16, requires_grad=True)
        k, v = (torch.randn(2, 4, k_len, 16, requires_grad=True) for _ in range(2))
        table = torch.randn(32, 4, requires_grad=True)
        mask = AttentionMask(q_len, k_len, causal=causal, keep=keep)
        buckets = torch.randint(0, 32, (q_len + k_len - 1,))
        with attention_backend(backend):
            fn = flex_module.flex_attend if backend == "flex" else (
                lambda *a: flex_module.dense_attend(a[0], a[1], a[2], a[4][a[5]], a[3], a[6]))
            out = fn(q, k, v, mask, table, buckets, 1.0)
        out.square().sum().backward()
        results[backend] = [out.detach(), q.grad, k.grad, v.grad, table.grad]
    assert shapes and all(a % 128 == 0 and b % 128 == 0 for a, b in shapes), shapes
    assert fresh_guard == []
    assert torch.equal(results["flex"][0][1, :, q_len - 30:], torch.zeros_like(results["flex"][0][1, :, q_len - 30:]))
    for a, b in zip(results["flex"], results["dense"]):  # float32 sums of up to 512 terms, relative to the largest
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_the_backend_comes_from_the_environment_unless_a_block_sets_it(monkeypatch):
    monkeypatch.setenv("LIBAI_LITE_ATTENTION", "dense")
    assert not flex_enabled("cuda")
    with attention_backend("flex"):
        assert flex_enabled("cpu")
    monkeypatch.setenv("LIBAI_LITE_ATTENTION", "flash")
    with pytest.raises(ValueError, match="LIBAI_LITE_ATTENTION='flash' is not an attention backend; use one of auto"):
        flex_enabled("cuda")
    monkeypatch.delenv("LIBAI_LITE_ATTENTION")
    assert flex_enabled("cuda") and not flex_enabled("cpu")


def _tiny_mt5():
    return MT5Model(dict(vocab_size=64, hidden_size=32, hidden_layers=2, num_attention_heads=4, head_size=8,
                         intermediate_size=48, embedding_dropout_prob=0.0, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0))


def test_mt5_logits_and_every_gradient_match_between_flex_and_dense(cpu_flex_backward):
    """The recipe's attention (12 heads of 64, the ragged decoder's 114 positions, an encoder past
    max_distance 128), two layers per stack (the second reads the first's table): logits and every
    gradient, the bias tables' included."""
    model = MT5Model(dict(vocab_size=64, hidden_size=32, hidden_layers=2, num_attention_heads=12, head_size=64,
                          intermediate_size=32, embedding_dropout_prob=0.0, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RelativePositionBias):
                module.weight.normal_(0.0, 2.0)
    enc, dec = torch.randint(0, 64, (2, 200)), torch.randint(0, 64, (2, 114))
    enc_mask, dec_mask = torch.ones(2, 200, dtype=torch.bool), torch.ones(2, 114, dtype=torch.bool)
    enc_mask[1, 150:] = False
    dec_mask[1, 70:] = False
    results = {}
    for backend in ("flex", "dense"):
        model.zero_grad(set_to_none=True)
        with attention_backend(backend):
            logits = model(enc, dec, enc_mask, dec_mask)
        logits.square().mean().backward()
        results[backend] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    _close(results["flex"], results["dense"])
    for name in ("encoder_layers.0.relative_attention_bias.weight", "decoder_layers.2.relative_attention_bias.weight"):
        assert results["flex"][1][name].abs().sum() > 0, name


def test_diagonal_buckets_are_computed_once_per_shape_and_are_the_bucket_map():
    model = _tiny_mt5()
    enc, dec = torch.randint(0, 64, (2, 19)), torch.randint(0, 64, (2, 7))
    model(enc, dec)
    misses = _cached_diagonals.cache_info().misses
    model(enc, dec)
    model(enc, dec)
    assert _cached_diagonals.cache_info().misses == misses
    rel = model.encoder_layers["0"].relative_attention_bias
    assert rel.diagonal_buckets(19, 19) is rel.diagonal_buckets(19, 19)
    torch.testing.assert_close(dense_bias(rel.table(), rel.diagonal_buckets(19, 19), 19), rel.compute_bias(19, 19),
                               rtol=0, atol=0)
    # Every (query, key) pair reads the bucket_map's bucket, square or not, with queries after a cache too,
    # both directions, and distances past max_distance (the last bucket).
    for bidirectional in (True, False):
        table = RelativePositionBias(32, 3, bidirectional=bidirectional, max_distance=20)
        for q_len, k_len, offset in ((19, 19, 0), (5, 40, 35), (1, 30, 29), (30, 9, 0)):
            diagonal = table.diagonal_buckets(q_len, k_len, offset)
            assert diagonal.shape == (q_len + k_len - 1,)
            assert torch.equal(diagonal[relative_index(q_len, k_len)], table.buckets(q_len, k_len, offset))
            torch.testing.assert_close(dense_bias(table.table(), diagonal, q_len),
                                       table.compute_bias(q_len, k_len, offset), rtol=0, atol=0)


def test_packed_document_mask_is_built_once_for_every_layer(monkeypatch):
    import libai_lite.layers.flex_attention as flex_module

    built = []

    class Counting(AttentionMask):
        def __init__(self, *args, **kwargs):
            built.append(kwargs.get("document_ids"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(flex_module, "AttentionMask", Counting)
    layers = [_attention("causal", hidden=32, sliding_window=9) for _ in range(3)]
    x, docs = torch.randn(2, 28, 32), _documents(2, 28)
    with torch.no_grad():
        outs = [layer(x, document_ids=docs) for layer in layers]
        assert len(built) == 1
        fresh = docs.clone()
        assert all(torch.equal(layer(x, document_ids=fresh), out) for layer, out in zip(layers, outs))
        assert len(built) == 2
        fresh[0, 3:] = 7  # changed in place: the kept mask is stale and rebuilt
        layers[0](x, document_ids=fresh)
        assert len(built) == 3
        for layer in layers:  # a window alone (no documents) is shared too
            layer(x)
        assert len(built) == 4


def test_a_mask_built_under_fake_tensors_is_not_kept_for_a_real_step():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    layer = _attention("causal", hidden=32, sliding_window=9)
    with torch.no_grad():
        with FakeTensorMode(allow_non_fake_inputs=True):  # as the memory planner's start-up estimate
            layer(torch.randn(2, 28, 32))
        out = layer(torch.randn(2, 28, 32))
    assert not isinstance(out, FakeTensor) and torch.isfinite(out).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m gpu on a GPU machine)")
def test_on_cuda_compiled_flex_matches_the_dense_path_in_bf16_and_compiles_once(fresh_guard):
    """The MT5 recipe's attention (mT5-base's 12 heads of 64, encoder 512, ragged decoder 114) in a two-layer
    model: compiled flex (not its dense fallback) against the dense path under bf16 autocast; logits within
    bf16's resolution of the scores, every gradient (the tables' included) close, and a second step
    compiles nothing."""
    from torch._dynamo.utils import counters

    model = MT5Model(dict(vocab_size=256, hidden_size=128, hidden_layers=2, num_attention_heads=12, head_size=64,
                          intermediate_size=256, embedding_dropout_prob=0.0, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)).cuda()
    enc, dec = torch.randint(0, 256, (4, 512), device="cuda"), torch.randint(0, 256, (4, 114), device="cuda")
    enc_mask = torch.ones(4, 512, dtype=torch.bool, device="cuda")
    enc_mask[1, 300:] = False
    dec_mask = torch.ones(4, 114, dtype=torch.bool, device="cuda")
    dec_mask[2, 80:] = False
    results = {}
    for backend in ("flex", "dense", "flex"):
        model.zero_grad(set_to_none=True)
        frames = counters["stats"]["unique_graphs"]
        with attention_backend(backend), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(enc, dec, enc_mask, dec_mask)
        logits.float().square().mean().backward()
        if backend in results:  # the second flex step: nothing new compiled
            assert counters["stats"]["unique_graphs"] == frames
        results[backend] = (logits.float().detach(), {n: p.grad.float().clone() for n, p in model.named_parameters()})
    # The compiled kernels ran: a fallback would compare the dense path with itself.
    assert not flex_module._flex_or_dense.fell_back and fresh_guard == [], fresh_guard
    flex, dense = results["flex"], results["dense"]
    torch.testing.assert_close(flex[0], dense[0], rtol=2e-2, atol=2e-2)
    for name, grad in dense[1].items():
        scale = grad.abs().max().clamp(min=1e-6)
        assert (flex[1][name] - grad).abs().max() / scale < 5e-2, name
    assert flex[1]["encoder_layers.0.relative_attention_bias.weight"].abs().sum() > 0
