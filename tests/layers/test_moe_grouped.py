"""The MoE experts as grouped GEMMs (libai_lite/layers/experts.py: ``grouped_experts`` behind ``GROUPED_EXPERTS``).

``torch._grouped_mm`` has a CPU implementation in torch 2.11 and 2.13, so the grouped path's numbers are
checked here against the per-expert loop; ``_grouped_eligible`` (CUDA and bf16 only) is forced open to run
the guard on the CPU: a grouped call that raises, or returns wrong values forward or backward, falls back
to the loop with one warning and the loop's results. Expert weights keep their per-expert state-dict keys.
"""
from __future__ import annotations

import logging

import pytest
import torch

from libai_lite.layers import MoEConfig, MoELayer
from libai_lite.layers import experts as experts_module
from libai_lite.layers.experts import GROUPED_EXPERTS, expert_weights, grouped_experts, looped_experts
from libai_lite.utils.fallback import tolerance

pytestmark = pytest.mark.gpu_path


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def fresh_guard():
    """The grouped-GEMM guard with nothing remembered, and the warnings it logs; reset afterwards."""
    records = _Records()
    log = logging.getLogger("libai_lite")
    log.addHandler(records)
    GROUPED_EXPERTS.reset()
    yield records.lines
    GROUPED_EXPERTS.reset()
    log.removeHandler(records)


@pytest.fixture
def eligible_on_cpu(monkeypatch):
    """The grouped path taken on the CPU, as it is on CUDA in bf16."""
    monkeypatch.setattr(experts_module, "_grouped_eligible", lambda experts, tokens: True)


def _layer(gated: bool = True, bias: bool = False, experts: int = 8, top_k: int = 2, **moe) -> MoELayer:
    torch.manual_seed(0)
    cfg = MoEConfig(enabled=True, num_experts=experts, top_k=top_k, capacity_factor=None, **moe)
    return MoELayer(cfg, hidden_size=16, ffn_hidden_size=24, activation="silu" if gated else "gelu", gated=gated,
                    bias=bias)


def _step(layer: MoELayer, x: torch.Tensor):
    """Output and every parameter's gradient of one forward and backward."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    out = layer(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _close(got, want, dtype):
    got, want = got.detach().float(), want.detach().float()
    assert float((got - want).abs().max()) <= tolerance(dtype) * float(want.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated,bias", [(True, False), (False, True)])
def test_grouped_experts_match_the_loop_forward_and_backward(dtype, gated, bias):
    layer = _layer(gated=gated, bias=bias).to(dtype)
    weights = [None if w is None else w.detach().clone().requires_grad_(True) for w in expert_weights(layer.experts)]
    sizes = [5, 0, 3, 7, 1, 0, 4, 4]  # an expert without tokens still gets a (zero) gradient
    offsets = torch.tensor(torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32)
    tokens = torch.randn(sum(sizes), 16, dtype=dtype, requires_grad=True)
    options = dict(activation=layer.experts["0"].activation, gated=gated)
    results = []
    for fn in (grouped_experts, looped_experts):
        out = fn(tokens, offsets, *weights, **options)
        live = [w for w in weights if w is not None]
        grads = torch.autograd.grad(out, [tokens, *live], torch.ones_like(out))
        results.append((out, grads))
    (out, grads), (want, want_grads) = results
    assert out.dtype == dtype
    _close(out, want, dtype)
    for g, w in zip(grads, want_grads):
        _close(g, w, dtype)
    # The second expert's (no tokens) first weight gradient is exactly zero on both paths.
    second = 1 + (4 if bias else 2)
    assert not grads[second].any() and not want_grads[second].any()


def test_the_guarded_grouped_path_gives_the_loops_numbers_and_keeps_the_state_dict(fresh_guard, eligible_on_cpu,
                                                                                  monkeypatch):
    calls = []
    monkeypatch.setattr(GROUPED_EXPERTS, "fast_fn", lambda *a, **k: calls.append(1) or grouped_experts(*a, **k))
    x = torch.randn(2, 12, 16)
    plain = _layer(grouped_gemm=False)
    grouped = _layer()
    # Same parameters and the per-expert keys of today's layout: the weights are stacked at call time only.
    assert list(grouped.state_dict()) == list(plain.state_dict())
    assert "experts.0.dense_h_to_4h.weight" in grouped.state_dict()
    for _ in range(2):  # the probe's step, then a proven one
        got, want = _step(grouped, x), _step(plain, x)
        _close(got[0], want[0], torch.float32)
        _close(got[1], want[1], torch.float32)
        for name in want[2]:
            _close(got[2][name], want[2][name], torch.float32)
    assert fresh_guard == [] and not GROUPED_EXPERTS.fell_back
    assert len(calls) == 3  # the probe, then each step's own call


def _raising(*args, **kwargs):
    raise RuntimeError("grouped gemm is only supported on CUDA devices with compute capability 9.0")


def _wrong_forward(*args, **kwargs):
    return grouped_experts(*args, **kwargs) * 1.01


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.01


def _wrong_backward(*args, **kwargs):
    return grouped_experts(_ScaleGrad.apply(args[0]), *args[1:], **kwargs)


@pytest.mark.parametrize("broken,reason", [
    (_raising, "RuntimeError: grouped gemm is only supported"),
    (_wrong_forward, "MismatchError: its output 0 differs from the per-expert loop's"),
    (_wrong_backward, "MismatchError: its gradient 0 differs from the per-expert loop's"),
])
def test_a_failing_or_wrong_grouped_gemm_falls_back_to_the_loop_with_one_warning(
        fresh_guard, eligible_on_cpu, monkeypatch, broken, reason):
    monkeypatch.setattr(GROUPED_EXPERTS, "fast_fn", broken)
    x = torch.randn(2, 12, 16)
    plain, layer = _layer(grouped_gemm=False), _layer()
    want = _step(plain, x)
    for _ in range(3):  # the failed probe, then the loop every time
        got = _step(layer, x)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert all(torch.equal(got[2][n], want[2][n]) for n in want[2])
    assert GROUPED_EXPERTS.fell_back
    assert len(fresh_guard) == 1, fresh_guard
    line = fresh_guard[0]
    assert line.startswith("MoE grouped GEMM (torch._grouped_mm) failed at its first use (" + reason), line
    assert line.endswith("the per-expert loop runs from here on") and "\n" not in line


def test_the_grouped_path_is_taken_only_on_cuda_in_bf16():
    layer = _layer()
    assert not experts_module._grouped_eligible(layer.experts, torch.randn(4, 16))
    assert not experts_module._grouped_eligible(layer.experts, torch.randn(4, 16, dtype=torch.bfloat16))


def test_no_rows_run_the_loop_and_leave_the_guard_alone(fresh_guard, eligible_on_cpu, monkeypatch):
    monkeypatch.setattr(GROUPED_EXPERTS, "fast_fn", _raising)
    layer = _layer()
    out = layer.experts(torch.randn(0, 16), [0] * 8)
    assert out.shape == (0, 16) and fresh_guard == [] and not GROUPED_EXPERTS.fell_back
