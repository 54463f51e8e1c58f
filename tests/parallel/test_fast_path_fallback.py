"""Fast paths that fall back, never crash (``libai_lite.utils.fallback.FastPath``), forced to fail on the CPU.

Each GPU fast path is made to fail at its first use, in the forward and in the backward, by a stub where
the GPU would fail (a compiled function or backend that raises, a library kernel that raises): the run
goes on with the plain path's numbers, says so in one warning line, and never calls the failed path
again. The compiled chunked loss and Liger's kernel, whole-model and per-layer compilation, CUDA graphs
and torchao's float8 linears; also the trainer's handling of CUDA graphs under gradient accumulation.
"""
from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from libai_lite.layers import fused_linear_ce as flce
from libai_lite.converters.compile import CompileOptions, apply_compile, compiled_modules_eager
from tests.converters.test_compile import CFG, batches, build_model, eager_step

# The GPU paths a CPU can run: CI runs them under the lowest torch setup.py admits too.
pytestmark = pytest.mark.gpu_path

N, H, V = 45, 32, 96  # as tests/layers/test_fused_linear_ce.py: 45 tokens in chunks of 16, a padded tail


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def warned():
    """The warning lines of the ``libai_lite`` logger during the test (its records do not propagate)."""
    handler, log = Warnings(), logging.getLogger("libai_lite")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


@pytest.fixture
def fresh_loss_paths():
    """The loss kernels' fast paths are per process: each test starts from untried ones."""
    flce.chunk_kernel.cache_clear()
    flce.LIGER.reset()
    yield
    flce.chunk_kernel.cache_clear()
    flce.LIGER.reset()


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    target = torch.randint(0, V, (N,), generator=g)
    target[::7] = -100
    return hidden, weight, target, torch.rand(N, generator=g)


def _loss_steps(kernel, steps=3, **kw):
    """``steps`` forward+backward calls of ``kernel`` (per-token loss, top-1, both gradients each)."""
    hidden, weight, target, grad = _inputs()
    out = []
    for _ in range(steps):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, top1 = flce.gpu_linear_cross_entropy(kernel, h, w, target, -100, torch.float32, True, rows=16, **kw)
        loss.backward(grad)
        out.append((loss.detach(), top1, h.grad, w.grad))
    return out


def _eager_chunked(monkeypatch):
    """The plain path of the compiled chunked kernel: the same chunk functions, run eagerly."""
    with monkeypatch.context() as m:
        m.setattr(flce, "_compiled", lambda fn, backend: fn)
        return _loss_steps("chunked")


def _assert_same(got, ref):
    for a, b in zip(got, ref):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.parametrize("fails_in", ["forward", "backward"])
def test_compiled_chunked_loss_falls_back_to_its_eager_kernels_once(monkeypatch, warned, fresh_loss_paths, fails_in):
    reference = _eager_chunked(monkeypatch)
    calls = []

    def fake_compile(fn, backend):
        def compiled(*args):
            calls.append(fn.__name__)
            if fn.__name__ == f"_{fails_in}_chunk":
                if fails_in == "backward":
                    args[5].add_(1e6)  # a kernel that wrote part of the weight gradient before failing
                raise RuntimeError("No valid triton configs. OutOfMemoryError: out of resource: triton_red_fused_0\n"
                                   "Required: 245760 Hardware limit:232448")
            return fn(*args)
        return compiled

    monkeypatch.setattr(flce, "_compile", fake_compile)
    got = _loss_steps("chunked")
    # The plain path's numbers, bit for bit, in every step, the step of the failure included.
    _assert_same(got, reference)
    assert warned == [f"the compiled chunked cross entropy ({fails_in}, torch.compile backend inductor) failed at "
                      f"its first use (RuntimeError: No valid triton configs. OutOfMemoryError: out of resource: "
                      f"triton_red_fused_0); the same chunk kernel, eager, runs from here on"]
    # Tried once, never again: 3 steps x 3 chunks went to the eager kernels. A working forward kernel stays.
    assert calls.count(f"_{fails_in}_chunk") == 1
    if fails_in == "backward":
        assert calls.count("_forward_chunk") == 3 * 3


@pytest.mark.parametrize("fails_in", ["import", "forward", "backward"])
def test_liger_falls_back_to_the_chunked_kernel_once(monkeypatch, warned, fresh_loss_paths, fails_in):
    reference = _eager_chunked(monkeypatch)
    monkeypatch.setattr(flce, "_compiled", lambda fn, backend: fn)
    calls = []

    class LigerStub(torch.autograd.Function):
        """Stands for Liger's Triton function: the right numbers (the eager chunked kernel's) until it fails."""

        @staticmethod
        def forward(ctx, hidden, weight, target):
            calls.append("forward")
            if fails_in == "forward":
                raise RuntimeError("triton.runtime.errors.OutOfResources: out of resource: shared memory")
            with torch.enable_grad():
                h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
                loss, top1 = flce._liger_plain(h, w, target, -100, torch.float32, True, 16, "inductor")
            ctx.graph = (h, w, loss)
            return loss.detach(), top1

        @staticmethod
        def backward(ctx, grad, _):
            calls.append("backward")
            if fails_in == "backward":
                raise RuntimeError("CUDA error: no kernel image is available for execution on the device")
            h, w, loss = ctx.graph
            return (*torch.autograd.grad(loss, (h, w), grad), None)

    if fails_in != "import":
        monkeypatch.setattr(flce, "_liger", lambda h, w, t, *rest: LigerStub.apply(h, w, t))
    else:
        monkeypatch.setattr(flce, "liger_available", lambda: False)
    got = _loss_steps("liger")
    _assert_same(got, reference)
    why = {"import": "ImportError: liger-kernel>=0.8.5 with triton is not installed (pip install -e .[gpu])",
           "forward": "RuntimeError: triton.runtime.errors.OutOfResources: out of resource: shared memory",
           "backward": "RuntimeError: CUDA error: no kernel image is available for execution on the device"}[fails_in]
    assert warned == [f"Liger-Kernel's fused linear cross entropy failed at its first use ({why}); the compiled "
                      f"chunked cross entropy runs from here on"]
    # Liger's first use is probed forward and backward; after its failure it is never called again.
    assert calls == {"import": [], "forward": ["forward"], "backward": ["forward", "backward"]}[fails_in]


# ------------------------------------------------------------------------------------ train.compile
def _curve(model, steps=3):
    # Three steps, as the trainer runs them: compiled modules eager, then their graphs built, then replayed.
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step, curve = eager_step(model), []
    for i, (x, y) in enumerate(batches()[:steps]):
        with compiled_modules_eager() if i == 0 else contextlib.nullcontext():
            curve.append(step(x, y))
        opt.step()
        opt.zero_grad()
    return torch.stack(curve)


@pytest.fixture(scope="module")
def eager_curve():
    return _curve(build_model())


def _raising_backend(where, calls):
    """A torch.compile backend whose forward (or backward) compiler fails as inductor does on a GPU whose
    shared memory is too small for a kernel."""
    from torch._dynamo.backends.common import aot_autograd

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            calls.append(kind)
            if kind == where:
                raise RuntimeError("No valid triton configs. OutOfMemoryError: out of resource: "
                                   "triton_tem_fused_0 Required: 245760 Hardware limit:232448")
            return gm
        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))


@pytest.mark.parametrize("fails_in", ["forward", "backward"])
def test_compiled_layers_fall_back_to_eager_at_the_first_call(warned, eager_curve, fails_in):
    """A backward compiler error surfaces in the first (forward) call, where the guard builds the backward
    too: the step runs eager from there, bit for bit the eager losses; nothing is compiled again. (The
    whole model goes through the same guard: the tests below compile it whole.)"""
    import torch._dynamo

    torch._dynamo.reset()
    calls = []
    model = build_model()
    assert apply_compile(model, CompileOptions(enabled=True, backend=_raising_backend(fails_in, calls))) == "layers"
    curve = _curve(model)
    assert torch.equal(curve, eager_curve)
    assert warned == ["train.compile (backend AotAutograd) failed at its first use (BackendCompilerFailed: "
                      "backend='compiler_fn' raised: RuntimeError: No valid triton configs. OutOfMemoryError: out of "
                      "resource: triton_tem_fused_0 Required: 245760 Hardware limit:232448); the eager module runs "
                      "from here on"]
    # One compilation tried (its backward built in the same call), none after.
    assert calls == (["forward"] if fails_in == "forward" else ["forward", "backward"])


def _zero_backward_backend(calls):
    """A backend whose backward runs and returns zero gradients: what torch 2.11's dynamo gave an autograd.Function
    whose output was masked in place. Nothing raises; only the numbers are wrong."""
    from torch._dynamo.backends.common import aot_autograd

    def backward(gm, example_inputs):
        calls.append("backward")

        def run(*args):
            return [torch.zeros_like(o) if isinstance(o, torch.Tensor) else o for o in gm(*args)]
        return run

    return aot_autograd(fw_compiler=lambda gm, example_inputs: gm, bw_compiler=backward)


@pytest.mark.parametrize("scope,dropout", [("layers", 0.0), ("model", 0.0), ("layers", 0.1)],
                         ids=["layers", "model", "layers_with_dropout"])
def test_a_compiled_module_whose_backward_is_wrong_falls_back_to_eager(warned, scope, dropout):
    """Compiled, the module's first call is compared with the eager module on the same inputs, forward and
    backward (with dropout off for the comparison, since compiled dropout draws other numbers): wrong gradients
    end in one warning line and the eager losses, where they once trained on silently."""
    import torch._dynamo

    torch._dynamo.reset()
    cfg = dict(attention_dropout_prob=dropout, output_dropout_prob=dropout)
    reference = _curve(build_model(**cfg))  # the dropout draws follow build_model's seeding
    calls = []
    model = build_model(**cfg)
    assert apply_compile(model, CompileOptions(enabled=True, backend=_zero_backward_backend(calls), scope=scope),
                         whole_model_ok=scope == "model") == scope
    curve = _curve(model)
    assert torch.equal(curve, reference)
    assert len(warned) == 1 and warned[0].startswith("train.compile (backend AotAutograd) failed at its first use "
                                                     "(MismatchError: its gradient "), warned
    assert "differs from the eager module's" in warned[0] and warned[0].endswith("the eager module runs from here on")
    assert calls == ["backward"]


def test_cuda_graphs_fall_back_to_the_same_compilation_without_them(monkeypatch, warned, eager_curve):
    """reduce-overhead records its CUDA graph on a later call than the first compiled one (the third step,
    after the eager first step): a recording that fails on the second compiled call falls back to the same compilation without CUDA graphs (here: the eager call, so the
    losses are the eager ones), which the later calls take; the graphs are never replayed again."""
    real_compile, graph_calls = torch.compile, []

    def fake_compile(fn, *, mode=None, **kwargs):
        if mode != "reduce-overhead":
            return fn  # "compiled without CUDA graphs": the eager call itself, for exact losses

        def graphs(*args, **kw):
            graph_calls.append(1)
            if len(graph_calls) == 2:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            return fn(*args, **kw)
        return graphs

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = build_model()
    apply_compile(model, CompileOptions(enabled=True, mode="reduce-overhead"), whole_model_ok=True)
    monkeypatch.setattr(torch, "compile", real_compile)
    assert torch.equal(_curve(model), eager_curve)
    assert warned == ["CUDA graphs (train.compile.mode=reduce-overhead) failed at its first use (RuntimeError: CUDA "
                      "error: operation not permitted when stream is capturing); the same compilation without CUDA "
                      "graphs (mode default) runs from here on"]
    assert len(graph_calls) == 2


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 2))

    def forward(self, x):
        return torch.tanh(x @ self.w)


def test_a_fast_path_that_worked_and_then_fails_is_an_error(warned):
    """After its first use succeeded, a failure is raised: not a silent switch of numerics mid-run."""
    calls = []

    def backend(gm, example_inputs):
        def run(*args):
            calls.append(1)
            # The first compiled call is the probe's comparison with the eager module, the second the step's.
            if len(calls) > 2:
                raise RuntimeError("illegal memory access")
            return gm(*args)
        return run

    import torch._dynamo

    torch._dynamo.reset()
    model = Tiny()
    apply_compile(model, CompileOptions(enabled=True, backend=backend), whole_model_ok=True)
    x = torch.randn(3, 4)
    with compiled_modules_eager():
        model(x).sum().backward()
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        model(x)
    assert warned == [] and len(calls) == 3


# ------------------------------------------------------------------------------------ train.fp8
def _fp8_model():
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    torch.manual_seed(0)
    return GPTForPreTraining({**CFG, "hidden_size": 64, "ffn_hidden_size": 128})


@pytest.fixture(scope="module")
def fp8_plain_curve():
    pytest.importorskip("torchao", reason="train.fp8 needs torchao: pip install -e .[fp8]")
    return _curve(_fp8_model())


def test_fp8_conversion_that_fails_keeps_the_model_in_high_precision(monkeypatch, warned, fp8_plain_curve):
    from libai_lite.converters import float8
    from libai_lite.converters.float8 import Float8Options, apply_float8

    def broken():
        raise ImportError("torchao/_C.so: undefined symbol: _ZN3c104cuda9SetDevice")

    monkeypatch.setattr(float8, "_torchao_float8", broken)
    model = _fp8_model()
    assert apply_float8(model, Float8Options(enabled=True, filter="all"), compile_backend=None) == 0
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())
    assert torch.equal(_curve(model), fp8_plain_curve)
    assert warned == ["train.fp8: torchao's float8 conversion failed (ImportError: torchao/_C.so: undefined symbol: "
                      "_ZN3c104cuda9SetDevice); the linears train in high precision"]


@pytest.mark.parametrize("fails_in", ["forward", "backward"])
def test_fp8_linears_that_fail_at_first_use_train_in_high_precision(monkeypatch, warned, fp8_plain_curve, fails_in):
    """The float8 GEMM missing on this GPU, in the forward or the backward (probed on a detached copy of the
    first input): every linear trains in high precision on the same weights, the plain model's losses."""
    from torchao.float8 import float8_linear

    from libai_lite.converters.float8 import Float8Options, apply_float8

    calls = []

    class Missing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input_hp, weight_hp_t, linear_mm_config, config):
            calls.append("forward")
            if fails_in == "forward":
                raise RuntimeError("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0")
            return input_hp @ weight_hp_t

        @staticmethod
        def backward(ctx, grad):
            calls.append("backward")
            raise RuntimeError("torch._scaled_mm: e5m2 x e4m3 is not supported on this device")

    monkeypatch.setattr(float8_linear, "matmul_with_hp_or_float8_args", Missing)
    model = _fp8_model()
    converted = apply_float8(model, Float8Options(enabled=True, filter="all"), compile_backend=None)
    assert converted > 0
    assert torch.equal(_curve(model), fp8_plain_curve)
    why = ("torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0" if fails_in == "forward"
           else "torch._scaled_mm: e5m2 x e4m3 is not supported on this device")
    assert warned == [f"train.fp8 (torchao float8 linears, tensorwise scaling) failed at its first use (RuntimeError: "
                      f"{why}); the high-precision linear (same weights) runs from here on"]
    assert calls == (["forward"] if fails_in == "forward" else ["forward", "backward"])


# ------------------------------------------------------------------------------ CUDA graphs x accumulation
class ReplaysIntoStaticMemory(torch.nn.Module):
    """What a CUDA-graph replay does to what the trainer holds: each call overwrites the outputs of the
    previous call and the gradient tensors the previous backward left as ``.grad`` (the graph's memory).
    ``marks`` counts ``cudagraph_mark_step_begin`` calls seen before each forward."""

    def __init__(self, marks):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        self.marks, self.seen_marks = marks, []
        self.last_outputs, self.last_grads, self.grad_before = [], [], None
        self.w.register_post_accumulate_grad_hook(self._graph_gradient)

    def _graph_gradient(self, p):
        # Without a .grad before, autograd keeps the backward's own output tensor as .grad: the graph's memory.
        if p.grad is not self.grad_before:
            self.last_grads.append(p.grad)

    def forward(self, x):
        self.seen_marks.append(len(self.marks))
        with torch.no_grad():
            for t in self.last_outputs + self.last_grads:
                t.fill_(float("nan"))
        self.last_grads, self.grad_before = [], self.w.grad
        loss = ((self.w * x).sum() - 1.0) ** 2
        self.last_outputs = [loss]
        return {"loss": loss}


def _accumulating_trainer(model, cuda_graphs):
    from libai_lite.engine.trainer import Trainer
    from libai_lite.model import LOSS
    from libai_lite.utils.events import EventStorage

    data = [{"x": torch.tensor([float(i), 1.0 - i])} for i in range(6)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = Trainer(model, data, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0), {"loss": LOSS},
                      num_accumulation_steps=3, cuda_graphs=cuda_graphs)
    trainer.storage = EventStorage()
    losses = []
    for i in range(2):
        trainer.iter = i
        trainer.storage.begin(i)
        trainer.run_step()
        losses.append(trainer.storage.latest()["total_loss"])
    return torch.stack([torch.as_tensor(v) for v in losses]), model.w.detach().clone()


def test_cuda_graphs_with_accumulation_train_the_eager_losses(monkeypatch):
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))

    class Plain(ReplaysIntoStaticMemory):
        def forward(self, x):
            loss = ((self.w * x).sum() - 1.0) ** 2
            return {"loss": loss}

    ref_losses, ref_w = _accumulating_trainer(Plain([]), cuda_graphs=False)
    model = ReplaysIntoStaticMemory(marks)
    losses, w = _accumulating_trainer(model, cuda_graphs=True)
    assert torch.equal(losses, ref_losses) and torch.equal(w, ref_w)
    # A new graph step before each of the 2 x 3 micro-batches' forward.
    assert model.seen_marks == [1, 2, 3, 4, 5, 6]
    # Without the trainer's copies the replays overwrite what it stacks and accumulates: the test can fail.
    with pytest.raises(FloatingPointError, match="loss is nan at iteration 0: training diverged"):
        _accumulating_trainer(ReplaysIntoStaticMemory(marks), cuda_graphs=False)
