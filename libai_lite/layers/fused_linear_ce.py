"""The LM head fused with the cross entropy for GPUs, so the ``[tokens, vocab]`` logits are never held.

Tokens are cut into chunks. Forward keeps each token's log-sum-exp; backward recomputes the chunk's logits
and turns them into both gradients, trading one GEMM for the logits' memory. On CUDA a head whole on a
rank runs ``plain`` while its fp32 logits fit ``PLAIN_LOGITS_SHARE`` of the device. Otherwise it runs
``chunked``, compiled torch ops with no host reads, or Liger-Kernel when ``LIBAI_LITE_CE_KERNEL=liger``.
A vocabulary-parallel head combines ranks with two all-reduces of ``2 x tokens`` values. Both fast paths
fall back with one warning if they fail at first use.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..utils.errors import UsageError
from ..utils.fallback import FastPath

KERNELS = ("buffer", "plain", "chunked", "liger")
# Largest share of device memory the plain head's fp32 logits may take on CUDA.
PLAIN_LOGITS_SHARE = 1 / 32
KERNEL_ENV = "LIBAI_LITE_CE_KERNEL"
# Earlier releases scale a reduction="none" gradient by one number, which would train wrongly.
LIGER_MIN_VERSION = (0, 8, 5)


def liger_available() -> bool:
    """Whether Liger-Kernel (with Triton) is installed, at a release whose per-token backward is exact."""
    if importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("triton") is None:
        return False
    from importlib.metadata import version

    try:
        release = tuple(int(x) for x in version("liger-kernel").split(".")[:3])
    except (ValueError, ImportError):
        return False
    return release >= LIGER_MIN_VERSION


def _device_memory(index: int) -> int:
    # Not lru_cached: dynamo folds get_device_properties to a constant but warns on a cache wrapper.
    return torch.cuda.get_device_properties(index).total_memory


def plain_fits(tokens: int, vocab: int, device_memory: int) -> bool:
    """Whether ``tokens x vocab`` fp32 logits take at most ``PLAIN_LOGITS_SHARE`` of ``device_memory`` bytes."""
    return 4 * tokens * vocab <= device_memory * PLAIN_LOGITS_SHARE


def select_kernel(device: torch.device, vocab_parallel: bool, tokens: int | None = None,
                  vocab: int | None = None) -> str:
    """The kernel ``linear_cross_entropy`` uses on ``device``: ``buffer`` on a CPU. On CUDA ``plain`` for a
    head whole on this rank whose logits pass ``plain_fits``, else ``chunked``. ``LIBAI_LITE_CE_KERNEL``
    overrides the choice for a head whole on this rank; ``liger`` is replaced by ``chunked`` under
    ``torch.compile``."""
    if device.type != "cuda":
        return "buffer"
    asked = os.environ.get(KERNEL_ENV, "")
    if asked not in ("", "plain", "chunked", "liger"):
        raise UsageError(f"{KERNEL_ENV}={asked!r} is not a GPU cross-entropy kernel; use plain, chunked or "
                         f"liger, or leave it unset to choose by the logits' size")
    if vocab_parallel:
        return "chunked"  # only the chunked kernel combines the ranks' vocabulary slices
    if asked == "liger":
        # Inside a compiled model the chunked kernel's plain ops become part of its graph; Liger's would not.
        return "chunked" if torch.compiler.is_compiling() else "liger"
    if asked:
        return asked
    if tokens is None or vocab is None:
        return "chunked"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return "plain" if plain_fits(tokens, vocab, _device_memory(index)) else "chunked"


def chunk_rows(device: torch.device, vocab: int, tokens: int) -> int:
    """Tokens per chunk, for at most 256 MiB of fp32 logits on a GPU and 8 MiB elsewhere. Tokens split
    evenly over the chunks, rounded up to 16 rows for tensor-core tiles."""
    budget = 1 << 28 if device.type == "cuda" else 1 << 23
    most = max(16, budget // (4 * max(1, vocab)))
    chunks = -(-tokens // most)
    return max(1, min(tokens, -(-tokens // chunks // 16) * 16 if tokens >= 16 else tokens))


def _owned(target, vocab_start: int, vocab: int, ignore_index: int):
    local = target - vocab_start
    owned = (target != ignore_index) & (local >= 0) & (local < vocab)
    return owned, torch.where(owned, local, 0)


def _forward_chunk(h, w, target, vocab_start: int, ignore_index: int):
    """(logsumexp, target logit, max) of one chunk's logits over this rank's vocabulary, fp32."""
    logits = (h @ w.t()).float()
    owned, safe = _owned(target, vocab_start, w.shape[0], ignore_index)
    target_logit = logits.gather(1, safe[:, None])[:, 0] * owned
    return torch.logsumexp(logits, -1), target_logit, logits.amax(-1)


def _backward_chunk(h, w, target, lse, scale, grad_w, vocab_start: int, ignore_index: int):
    """d hidden of one chunk; its d weight is added to the fp32 ``grad_w`` in place. The one-hot is a
    comparison against a column index, so the compiled kernel needs no scatter."""
    logits = (h @ w.t()).float()
    owned, safe = _owned(target, vocab_start, w.shape[0], ignore_index)
    cols = torch.arange(w.shape[0], device=h.device)
    onehot = (cols[None, :] == safe[:, None]) & owned[:, None]
    p = (logits - lse[:, None]).exp()
    d = (torch.where(onehot, p - 1.0, p) * scale[:, None]).to(h.dtype)
    grad_w.add_((d.t() @ h).float())
    return d @ w


@functools.cache
def _compile(fn, backend: str):
    return torch.compile(fn, backend=backend)


def _backward_probe(fn, args, kwargs) -> None:
    # The first use writes into a copy, so a kernel failing half-way leaves the real accumulator intact.
    args = list(args)
    args[5] = args[5].clone()
    fn(*args, **kwargs)


@functools.cache
def chunk_kernel(fn, backend: str) -> FastPath:
    """``fn`` compiled with ``backend``, falling back to eager ``fn`` if it fails at its first use."""
    kind = "forward" if fn is _forward_chunk else "backward"
    return FastPath(f"the compiled chunked cross entropy ({kind}, torch.compile backend {backend})",
                    _compile(fn, backend), fn, probe=_backward_probe if fn is _backward_chunk else None,
                    plain_name="the same chunk kernel, eager,")


def _compiled(fn, backend: str):
    """``fn`` compiled with ``backend`` behind its fallback (``chunk_kernel``), or ``fn`` itself inside a model
    being compiled (it joins that graph)."""
    return fn if torch.compiler.is_compiling() else chunk_kernel(fn, backend)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Per-token ``cross_entropy(hidden @ weight.T, target)`` over token chunks, saving ``h``, ``w`` and
    one fp32 log-sum-exp per token (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, compute_dtype, with_top1, group, vocab_start,
                rows, backend):
        fwd = _compiled(_forward_chunk, backend)
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
            n = h.shape[0]
            rows = rows or chunk_rows(h.device, w.shape[0], n)
            # The tail padded to a whole chunk (ignored tokens): one compiled shape for every chunk.
            pad = -n % rows
            hp = torch.nn.functional.pad(h, (0, 0, 0, pad))
            tp = torch.nn.functional.pad(target, (0, pad), value=ignore_index)
            parts = [fwd(hp[s:s + rows], w, tp[s:s + rows], vocab_start, ignore_index)
                     for s in range(0, n + pad, rows)]
            lse, target_logit, row_max = (torch.cat(x)[:n] for x in zip(*parts))
            if group is not None:  # logsumexp over the ranks' vocabulary slices
                maxes = torch.stack([lse, row_max])
                dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
                sums = torch.stack([(lse - maxes[0]).exp(), target_logit])
                dist.all_reduce(sums, group=group)
                lse, row_max, target_logit = maxes[0] + sums[0].log(), maxes[1], sums[1]
            valid = target != ignore_index
            # Out of place: under torch 2.11's dynamo an output mutated in place gets all-zero gradients.
            loss = (lse - target_logit).masked_fill(~valid, 0.0)
            is_top1 = (target_logit >= row_max) & valid if with_top1 else valid.new_zeros(())
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            ctx.save_for_backward(h, w, target, lse)
            ctx.config = (hidden.dtype, weight.dtype, ignore_index, vocab_start, rows, backend)
        ctx.mark_non_differentiable(is_top1)
        return loss, is_top1

    @staticmethod
    def backward(ctx, grad_loss, _grad_top1):
        h, w, target, lse = ctx.saved_tensors
        hidden_dtype, weight_dtype, ignore_index, vocab_start, rows, backend = ctx.config
        bwd = _compiled(_backward_chunk, backend)
        n = h.shape[0]
        pad = -n % rows
        with torch.autocast(h.device.type, enabled=False):
            scale = torch.nn.functional.pad(grad_loss.float() * (target != ignore_index), (0, pad))
            hp = torch.nn.functional.pad(h, (0, 0, 0, pad))
            tp = torch.nn.functional.pad(target, (0, pad), value=ignore_index)
            lp = torch.nn.functional.pad(lse, (0, pad))
            grad_h = torch.empty_like(hp)
            grad_w = torch.zeros(w.shape, dtype=torch.promote_types(w.dtype, torch.float32), device=w.device)
            for s in range(0, n + pad, rows):
                grad_h[s:s + rows] = bwd(hp[s:s + rows], w, tp[s:s + rows], lp[s:s + rows], scale[s:s + rows],
                                         grad_w, vocab_start, ignore_index)
        grad_hidden = grad_h[:n].to(hidden_dtype) if ctx.needs_input_grad[0] else None
        grad_weight = grad_w.to(weight_dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def plain_linear_cross_entropy(hidden, weight, target, ignore_index, compute_dtype, with_top1):
    """The unfused head: ``[N, V]`` logits in ``compute_dtype``, then cross entropy in at least fp32 (0 where
    ignored)."""
    logits = F.linear(hidden.to(compute_dtype), weight.to(compute_dtype))
    with torch.autocast(hidden.device.type, enabled=False):
        upcast = logits.to(torch.promote_types(logits.dtype, torch.float32))
        loss = F.cross_entropy(upcast, target, ignore_index=ignore_index, reduction="none")
    valid = target != ignore_index
    is_top1 = (logits.argmax(-1) == target) & valid if with_top1 else valid.new_zeros(())
    return loss, is_top1


def _liger(hidden, weight, target, ignore_index, compute_dtype, with_top1):
    if not liger_available():
        raise ImportError(f"liger-kernel>={'.'.join(map(str, LIGER_MIN_VERSION))} with triton is not installed "
                          f"(pip install -e .[gpu])")
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    with torch.autocast(hidden.device.type, enabled=False):
        # Positional, as liger-kernel 0.8.5 declares them: bias, ce_weight, ignore_index, lse_square_scale,
        # label_smoothing, reduction, softcap, return_z_loss, accum_dtype (fp32 weight gradient),
        # use_token_scaling, return_token_accuracy.
        loss, _, accuracy, _ = LigerFusedLinearCrossEntropyFunction.apply(
            hidden.to(compute_dtype), weight.to(compute_dtype), target, None, None, ignore_index, 0.0, 0.0, "none",
            None, False, torch.float32, False, with_top1)
    valid = target != ignore_index
    loss = loss.float().masked_fill(~valid, 0.0)
    is_top1 = (accuracy > 0.5) & valid if with_top1 else valid.new_zeros(())
    return loss, is_top1


def gpu_linear_cross_entropy(kernel: str, hidden, weight, target, ignore_index: int, compute_dtype: torch.dtype,
                             with_top1: bool, group=None, vocab_start: int = 0, rows: int | None = None,
                             backend: str = "inductor"):
    """(per-token fp32 loss, is-top-1) of ``hidden [N, H] @ weight[V, H].T`` against ``target [N]`` with
    ``kernel`` ``chunked`` or ``liger``, the contract of ``loss._LinearCrossEntropy``; ``rows``: tokens
    per chunk (None: ``chunk_rows``); ``backend``: torch.compile's for ``chunked``."""
    if kernel in ("liger", "plain") and group is not None:
        raise ValueError(f"the {kernel} kernel does not split the vocabulary over ranks; use kernel='chunked'")
    if kernel == "liger":
        return LIGER(hidden, weight, target, ignore_index, compute_dtype, with_top1, rows, backend)
    if kernel == "plain":
        return plain_linear_cross_entropy(hidden, weight, target, ignore_index, compute_dtype, with_top1)
    if kernel != "chunked":
        raise ValueError(f"kernel={kernel!r} is not a GPU cross-entropy kernel; use one of plain, chunked, liger")
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, target, ignore_index, compute_dtype, with_top1, group,
                                            vocab_start, rows, backend)


def _liger_fast(hidden, weight, target, ignore_index, compute_dtype, with_top1, rows, backend):
    return _liger(hidden, weight, target, ignore_index, compute_dtype, with_top1)


def _liger_plain(hidden, weight, target, ignore_index, compute_dtype, with_top1, rows, backend):
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, target, ignore_index, compute_dtype, with_top1, None, 0,
                                            rows, backend)


# Probed forward and backward at first use: an import error, a Triton compile error or a kernel this GPU cannot
# launch turns into one warning and the chunked kernel.
LIGER = FastPath("Liger-Kernel's fused linear cross entropy", _liger_fast, _liger_plain,
                 plain_name="the compiled chunked cross entropy")
