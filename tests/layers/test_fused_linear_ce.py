"""The GPU fused LM head + cross entropy (``libai_lite.layers.fused_linear_ce``) against the unfused loss.

The compiled chunked kernel runs on the CPU here, forced with ``kernel="chunked"``: with ``aot_eager``
(the traced graph, fast to build) for most checks and once with inductor (the generated code a GPU run
compiles to Triton). Which kernel a CUDA tensor gets is checked without a GPU; the kernels on CUDA
(Liger's included) run in ``gpu``-marked tests.
"""
from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.nn.functional as F

from libai_lite.layers import fused_linear_ce as flce
from libai_lite.layers import loss as loss_mod
from libai_lite.layers import linear_cross_entropy

# The GPU paths a CPU can run: CI runs them under the lowest torch setup.py admits too.
pytestmark = pytest.mark.gpu_path

# A fresh inductor cache per run, as tests/converters/test_compile.py keeps it (cached CPU kernels reused
# across ATEN_CPU_CAPABILITY gave NaNs there).
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import atexit
    import shutil

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchinductor_libai_lite_")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)

N, H, V = 45, 32, 96  # 45 tokens in chunks of 16: a padded tail chunk


def _inputs(dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    target = torch.randint(0, V, (N,), generator=g)
    target[::7] = -100
    target[3] = int((hidden[3] @ weight.t()).argmax())  # at least one top-1 hit
    grad = torch.rand(N, generator=g)
    return (hidden.to(device, dtype), weight.to(device, dtype), target.to(device), grad.to(device))


def _unfused(hidden, weight, target, grad, compute_dtype):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = h.to(compute_dtype) @ w.to(compute_dtype).t()
    loss = F.cross_entropy(logits.float(), target, reduction="none")
    loss.backward(grad)
    top1 = (logits.float().argmax(-1) == target) & (target != -100)
    return loss.detach(), top1, h.grad, w.grad


def _top1_agrees(top1, ref_top1, hidden, weight, target, compute_dtype) -> bool:
    """Top-1 hits equal to the reference's, except where the target ties the best other logit within one rounding
    of the compute dtype: there another kernel's summation order may pick either (a bf16 near-tie under AVX2)."""
    top1, ref_top1, target = top1.flatten().cpu(), ref_top1.flatten().cpu(), target.cpu()
    differ = top1 != ref_top1
    if not differ.any():
        return True
    logits = (hidden.cpu().to(compute_dtype) @ weight.cpu().to(compute_dtype).t()).float()
    own = logits.gather(1, target.clamp(min=0)[:, None]).squeeze(1)
    others = logits.scatter(1, target.clamp(min=0)[:, None], float("-inf")).amax(1)
    tie = (own - others).abs() <= 4 * torch.finfo(compute_dtype).eps * logits.abs().amax(1)
    return bool(tie[differ].all())


def _tolerance(compute_dtype, grad_ref):
    """One rounding of the compute dtype per result (the logits, ``softmax - onehot`` and each GEMM's
    output are rounded once, as in the unfused path), relative to the largest gradient entry; fp32 also
    reorders the vocabulary's sum (V terms)."""
    eps = torch.finfo(compute_dtype).eps
    scale = float(grad_ref.abs().max())
    if compute_dtype == torch.float32:
        return dict(rtol=V * eps, atol=V * eps * scale)
    return dict(rtol=4 * eps, atol=4 * eps * scale)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_chunked_kernel_matches_the_unfused_loss_and_gradients(compute_dtype):
    hidden, weight, target, grad = _inputs()
    ref_loss, ref_top1, ref_gh, ref_gw = _unfused(hidden, weight, target, grad, compute_dtype)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, top1 = flce.gpu_linear_cross_entropy("chunked", h, w, target, -100, compute_dtype, True, rows=16,
                                               backend="aot_eager")
    loss.backward(grad)
    assert loss.dtype == torch.float32 and torch.all(loss[target == -100] == 0)
    assert _top1_agrees(top1, ref_top1, hidden, weight, target, compute_dtype) and top1.any()
    # The loss is fp32 arithmetic on the same rounded logits.
    torch.testing.assert_close(loss, ref_loss, rtol=V * torch.finfo(torch.float32).eps, atol=1e-5)
    torch.testing.assert_close(h.grad, ref_gh, **_tolerance(compute_dtype, ref_gh))
    torch.testing.assert_close(w.grad, ref_gw, **_tolerance(compute_dtype, ref_gw))
    assert h.grad.dtype == w.grad.dtype == torch.float32


def inductor_autocast_check():
    """``linear_cross_entropy(kernel="chunked")`` compiled by inductor, bf16 autocast, on a [batch, seq] target."""
    hidden, weight, target, grad = _inputs(seed=1)
    ref_loss, ref_top1, ref_gh, ref_gw = _unfused(hidden, weight, target, grad, torch.bfloat16)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, top1 = linear_cross_entropy(h.view(5, 9, H), w, target.view(5, 9), return_top1=True, kernel="chunked")
    assert loss.shape == top1.shape == (5, 9)
    loss.backward(grad.view(5, 9))
    assert _top1_agrees(top1, ref_top1, hidden, weight, target, torch.bfloat16)
    torch.testing.assert_close(loss.flatten(), ref_loss, rtol=V * torch.finfo(torch.float32).eps, atol=1e-5)
    torch.testing.assert_close(h.grad, ref_gh, **_tolerance(torch.bfloat16, ref_gh))
    torch.testing.assert_close(w.grad, ref_gw, **_tolerance(torch.bfloat16, ref_gw))


def test_chunked_kernel_under_inductor_and_autocast_through_linear_cross_entropy(tmp_path):
    """``inductor_autocast_check`` in a fresh interpreter with its own inductor cache: in a worker that ran other
    inductor tests first (test_flex_budget's mocked-capability queries among them) torch 2.11's CPU kernels
    have given other results and, in CI, aborted the worker, ending the suite."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), PYTHONPATH=str(root))
    code = "from tests.layers.test_fused_linear_ce import inductor_autocast_check as c; c()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"


def test_chunked_kernel_joins_a_compiled_model_without_graph_breaks():
    """Under a whole-model ``torch.compile`` (fullgraph: a break raises) the kernel's ops are traced in."""
    import torch._dynamo

    hidden, weight, target, grad = _inputs()
    results = []
    for compiled in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

        def model(a, b):  # the tanh stands for the layers before the head
            return linear_cross_entropy(torch.tanh(a), b, target, kernel="chunked" if compiled else "buffer")

        if compiled:
            torch._dynamo.reset()
            model = torch.compile(model, backend="aot_eager", fullgraph=True)
        loss = model(h, w)
        loss.backward(grad)
        results.append((loss.detach(), h.grad, w.grad))
    (ref_loss, ref_gh, ref_gw), (loss, gh, gw) = results
    torch.testing.assert_close(loss, ref_loss, rtol=V * torch.finfo(torch.float32).eps, atol=1e-5)
    torch.testing.assert_close(gh, ref_gh, **_tolerance(torch.float32, ref_gh))
    torch.testing.assert_close(gw, ref_gw, **_tolerance(torch.float32, ref_gw))


def test_on_cuda_the_plain_head_runs_while_its_logits_fit_and_the_chunked_kernel_beyond(monkeypatch):
    """The rule: fp32 logits within 1/32 of the device's memory run plain, larger ones chunked; a head split
    over tensor-parallel ranks is always chunked; LIBAI_LITE_CE_KERNEL overrides the size rule."""
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv(flce.KERNEL_ENV, raising=False)
    h100 = 80 * 10**9
    monkeypatch.setattr(flce, "_device_memory", lambda index: h100)
    # (tokens, vocab): GPT-2 124M at micro-batch 12, 345M at 8, the demo, Llama 3 8B at 8k, GPT-2 at micro-batch 32.
    shapes = {(12 * 1024, 50304): "plain", (8 * 1024, 50304): "plain", (16 * 128, 8064): "plain",
              (8192, 128256): "chunked", (32 * 1024, 50304): "chunked"}
    for (tokens, vocab), want in shapes.items():
        assert flce.select_kernel(cuda, False, tokens=tokens, vocab=vocab) == want, (tokens, vocab)
        assert flce.plain_fits(tokens, vocab, h100) == (want == "plain")
        assert flce.select_kernel(cuda, True, tokens=tokens, vocab=vocab) == "chunked"
    monkeypatch.setenv(flce.KERNEL_ENV, "chunked")
    assert flce.select_kernel(cuda, False, tokens=16, vocab=128) == "chunked"
    monkeypatch.setenv(flce.KERNEL_ENV, "plain")
    assert flce.select_kernel(cuda, False, tokens=8192, vocab=128256) == "plain"
    assert flce.select_kernel(cuda, True, tokens=16, vocab=128) == "chunked"


@pytest.mark.parametrize("with_top1", [False, True])
def test_the_plain_kernel_gives_the_buffered_loss_and_gradients(with_top1):
    """``plain`` (logits, then cross entropy) against the CPU's one-buffer kernel, ignored targets included."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 24, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 40, (2, 24))
    target[0, :5] = -100
    got = linear_cross_entropy(hidden, weight, target, return_top1=with_top1, kernel="plain")
    want = linear_cross_entropy(hidden, weight, target, return_top1=with_top1, kernel="buffer")
    if with_top1:
        assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    # float64 throughout: the two differ by summation order only.
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_got = torch.autograd.grad(got.sum(), (hidden, weight))
    g_want = torch.autograd.grad(want.sum(), (hidden, weight))
    for a, b in zip(g_got, g_want):
        # The buffered kernel forms its gradients in fp32 (2^-24 relative per element, sums of 40 terms).
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_cuda_tensor_gets_the_chunked_kernel_liger_only_when_asked_and_a_cpu_tensor_the_buffer(monkeypatch):
    """Liger reads the host twice a micro-batch (``target_mask.sum().item()``): CUDA's default is the chunked
    kernel, which reads nothing, installed Liger or not; ``LIBAI_LITE_CE_KERNEL=liger`` asks for Liger."""
    from libai_lite.utils.errors import UsageError

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.delenv(flce.KERNEL_ENV, raising=False)
    assert flce.select_kernel(cpu, False) == flce.select_kernel(cpu, True) == "buffer"
    monkeypatch.setattr(flce, "liger_available", lambda: True)
    assert flce.select_kernel(cuda, False) == flce.select_kernel(cuda, True) == "chunked"
    monkeypatch.setenv(flce.KERNEL_ENV, "liger")
    assert flce.select_kernel(cuda, False) == "liger"
    assert flce.select_kernel(cuda, True) == "chunked"  # Liger has no vocabulary-parallel form
    assert flce.select_kernel(cpu, False) == "buffer"
    monkeypatch.setenv(flce.KERNEL_ENV, "triton")
    with pytest.raises(UsageError, match="LIBAI_LITE_CE_KERNEL='triton' is not a GPU cross-entropy kernel; use "
                                         "plain, chunked or liger"):
        flce.select_kernel(cuda, False)


def test_gpu_chunks_are_a_few_hundred_mb_of_logits_and_split_the_tokens_evenly():
    cuda = torch.device("cuda", 0)
    for tokens in (1, 17, 2048, 8192, 12288, 65536):
        rows = flce.chunk_rows(cuda, 50304, tokens)
        chunks = -(-tokens // rows)
        assert rows * 50304 * 4 <= (1 << 28) + 16 * 50304 * 4  # ~256 MiB of fp32 logits, plus one tile of rows
        assert chunks * rows - tokens < 16 * chunks  # the padded tail: under 16 rows per chunk
    assert flce.chunk_rows(cuda, 50304, 12288) * 50304 * 4 > (1 << 27)  # not a CPU cache's size


def test_liger_needs_triton_and_a_release_with_the_per_token_backward(monkeypatch):
    import importlib.metadata
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.8.5")
    assert flce.liger_available()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.6.4")
    assert not flce.liger_available()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "triton" else object())
    assert not flce.liger_available()


def test_linear_cross_entropy_dispatches_on_the_selected_kernel(monkeypatch):
    """What ``linear_cross_entropy`` does with a CUDA tensor, on a CPU one: the GPU kernel is called with
    the flattened inputs, and the buffer path is not."""
    hidden, weight, target, _ = _inputs()
    calls = []

    def fake_gpu(kernel, h, w, t, ignore_index, compute_dtype, with_top1, group, vocab_start):
        calls.append((kernel, tuple(h.shape), tuple(t.shape), compute_dtype, group, vocab_start))
        return torch.zeros(t.shape), torch.zeros(t.shape, dtype=torch.bool)

    monkeypatch.setattr(loss_mod, "select_kernel", lambda device, vocab_parallel, **kw: "liger")
    monkeypatch.setattr(loss_mod, "gpu_linear_cross_entropy", fake_gpu)
    monkeypatch.setattr(loss_mod._LinearCrossEntropy, "apply", None)  # would fail if called
    loss = linear_cross_entropy(hidden.view(5, 9, H), weight, target.view(5, 9))
    assert loss.shape == (5, 9)
    assert calls == [("liger", (N, H), (N,), torch.float32, None, 0)]


def test_the_cpu_keeps_the_buffer_kernel(monkeypatch):
    hidden, weight, target, _ = _inputs()

    def no_gpu_kernel(*args):
        raise AssertionError("a CPU tensor reached the GPU kernel")

    monkeypatch.setattr(loss_mod, "gpu_linear_cross_entropy", no_gpu_kernel)
    loss = linear_cross_entropy(hidden.requires_grad_(), weight, target)
    assert loss.grad_fn.next_functions[0][0].name().endswith("_LinearCrossEntropyBackward")


def _vocab_parallel(rank, world, port, out):
    """One rank: the head split on the vocabulary, the chunked kernel (aot_eager) against the one-process loss."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    flce._compiled = lambda fn, backend: torch.compile(fn, backend="aot_eager")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    hidden, weight, target, grad = _inputs()
    results = {}
    for amp in (False, True):
        w = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
        h = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss, top1 = linear_cross_entropy(h, w, target, return_top1=True, kernel="chunked")
        loss.backward(grad)
        results[amp] = {"loss": loss.detach(), "top1": top1, "grad_hidden": h.grad, "grad_weight": w.grad.full_tensor()}
    if rank == 0:
        torch.save(results, os.path.join(out, "tp.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_vocab_parallel_chunked_kernel_matches_the_unfused_loss(tmp_path):
    """The chunked kernel with the vocabulary split over 2 ranks (each rank's logsumexp combined by
    all-reduce): the unfused one-process loss, top-1 and gradients, fp32 and bf16."""
    from tests.launch import spawn_ranks

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_ranks(_vocab_parallel, 2, (2, port, str(tmp_path)))
    got = torch.load(tmp_path / "tp.pt")
    hidden, weight, target, grad = _inputs()
    for amp, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        ref_loss, ref_top1, ref_gh, ref_gw = _unfused(hidden, weight, target, grad, dtype)
        res = got[amp]
        assert _top1_agrees(res["top1"], ref_top1, hidden, weight, target, dtype)
        torch.testing.assert_close(res["loss"], ref_loss, rtol=V * torch.finfo(torch.float32).eps, atol=1e-5)
        torch.testing.assert_close(res["grad_hidden"], ref_gh, **_tolerance(dtype, ref_gh))
        torch.testing.assert_close(res["grad_weight"], ref_gw, **_tolerance(dtype, ref_gw))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kernel", ["chunked", "liger"])
def test_gpu_kernels_match_the_unfused_loss_on_cuda(kernel):
    if kernel == "liger" and not flce.liger_available():
        pytest.skip("liger-kernel is not installed: pip install -e .[gpu]")
    hidden, weight, target, grad = _inputs(device="cuda")
    ref_loss, ref_top1, ref_gh, ref_gw = _unfused(hidden, weight, target, grad, torch.bfloat16)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, top1 = linear_cross_entropy(h, w, target, return_top1=True, kernel=kernel)
    loss.backward(grad)
    assert _top1_agrees(top1, ref_top1, hidden, weight, target, torch.bfloat16)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)  # Liger's logsumexp runs in bf16 blocks
    torch.testing.assert_close(h.grad, ref_gh, **_tolerance(torch.bfloat16, ref_gh))
    torch.testing.assert_close(w.grad, ref_gw, **_tolerance(torch.bfloat16, ref_gw))


@pytest.mark.gpu
@cuda
def test_the_chunked_kernel_never_holds_the_logits_on_cuda():
    """12k tokens x 50k vocabulary: the unfused bf16 logits alone are 1.2 GB (and it holds them with an fp32
    log-softmax); the chunked kernel's peak over its inputs (a chunk's logits and gradient, ~124 MB each,
    and the fp32 weight gradient, 155 MB) stays under one bf16 copy of the logits."""
    n, h, v = 12288, 768, 50304
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, v, (n,), device="cuda")
    linear_cross_entropy(hidden, weight, target, kernel="chunked").sum().backward()  # compile first
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    linear_cross_entropy(hidden, weight, target, kernel="chunked").sum().backward()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < n * v * 2, f"peak {peak / 2**20:.0f} MiB"
