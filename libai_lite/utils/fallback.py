"""A fast path that falls back to a plain one when it fails at first use, instead of ending the run.

GPU-only code (compiled kernels, Triton, vendor fused ops) mostly fails where it is first used.
``FastPath(name, fast_fn, plain_fn)`` probes each new ``signature_of`` by running ``fast_fn`` forward and
backward on detached inputs; ``compare=True`` also checks it against ``plain_fn`` beyond rounding. A
failed probe warns once and the plain function runs from then on; a failure after a passed probe is
raised, as a bug. ``probe=None`` with ``first_call`` guards the first real call instead (``torch.compile``
builds its backward there), as does a probe that returns False (it cannot run on these arguments) or
``GUARD_CALL`` (it checked a variant of the call); ``first_uses`` guards more calls (CUDA graphs record later).
Under ``torch.compile``
tracing or on fake tensors nothing is probed: the fast function is traced unless an eager call already fell back.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Dict, Hashable, Optional

import torch

logger = logging.getLogger("libai_lite")

_DEFAULT = object()
# A probe's answer: it passed on a variant of the call (another mode), so the real first call is guarded as well.
GUARD_CALL = object()


def _meta(x: Any) -> Hashable:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), tuple(x.stride()), x.dtype, x.device.type, x.requires_grad)
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (tuple, list)):
        return tuple(_meta(v) for v in x)
    return type(x).__qualname__


def signature_of(*args, **kwargs) -> Hashable:
    """Shapes, strides, dtypes, devices and ``requires_grad`` of the tensor arguments, plain values as
    they are, other objects by type, and whether autograd records: what a compiled kernel is keyed by."""
    return (torch.is_grad_enabled(), tuple(_meta(a) for a in args),
            tuple(sorted((k, _meta(v)) for k, v in kwargs.items())))


def _detached_run(fn: Callable, args: tuple, kwargs: dict, cotangent: Callable) -> tuple:
    """``fn`` on detached copies (views, no data copied) of the top-level tensor arguments, then, if
    autograd records and any output needs a gradient, its backward (``cotangent(t)`` per output) into those
    copies only (no parameter's ``.grad`` is touched); returns (outputs, gradients)."""
    leaves = []

    def detach(x):
        if not isinstance(x, torch.Tensor):
            return x
        y = x.detach()
        if x.requires_grad and torch.is_grad_enabled():
            y.requires_grad_(True)
            leaves.append(y)
        return y

    out = fn(*[detach(a) for a in args], **{k: detach(v) for k, v in kwargs.items()})
    outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    wanted = [t for t in outs if t.requires_grad]
    grads = ()
    if leaves and wanted:
        grads = torch.autograd.grad(wanted, leaves, [cotangent(t) for t in wanted], allow_unused=True)
    return [t.detach() for t in outs], list(grads)


def forward_backward_probe(fn: Callable, args: tuple, kwargs: dict) -> None:
    """Run ``fn`` forward and, where gradients are wanted, backward on detached inputs (``_detached_run``)."""
    _detached_run(fn, args, kwargs, torch.ones_like)


class MismatchError(RuntimeError):
    """The fast path ran but its numbers are not the plain path's."""


def tolerance(dtype: torch.dtype) -> float:
    """The largest difference rounding explains, as a fraction of the reference's largest magnitude: 8 units
    of the dtype's precision; float32 kernels on a GPU may round products to TF32 (10 bits)."""
    low = dtype in (torch.float16, torch.bfloat16)
    return 8 * (torch.finfo(dtype).eps if low else 2.0 ** -10)


def seeded_like(t: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator(device=t.device).manual_seed(0)
    return torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32).to(t.dtype)


def comparing_probe(plain_fn: Callable, plain_name: str) -> Callable:
    """A probe that runs the fast function and ``plain_fn`` on the same detached inputs and output gradient.

    Raises ``MismatchError`` where an output or input gradient differs by more than ``tolerance`` of the
    plain one's magnitude, or is not finite where the plain one is. A plain path out of memory is not compared.
    """
    def probe(fn: Callable, args: tuple, kwargs: dict) -> None:
        fast = _detached_run(fn, args, kwargs, seeded_like)
        try:
            plain = _detached_run(plain_fn, args, kwargs, seeded_like)
        except torch.OutOfMemoryError:
            return
        for kind, got, want in (("output", fast[0], plain[0]), ("gradient", fast[1], plain[1])):
            for i, (a, b) in enumerate(zip(got, want)):
                check_close(a, b, f"its {kind} {i}", plain_name)
    return probe


def check_close(got: Optional[torch.Tensor], want: Optional[torch.Tensor], what: str, plain_name: str,
                dtype: Optional[torch.dtype] = None) -> None:
    """Raise ``MismatchError`` where ``got`` differs from ``want`` by more than ``tolerance`` (of ``dtype``, default
    ``want``'s) of ``want``'s largest magnitude, or is not finite where ``want`` is; None or a shape change passes."""
    if got is None or want is None or got.shape != want.shape:
        return
    b32 = want.float()
    if not bool(torch.isfinite(b32).all()):
        return
    scale = float(b32.abs().max()) if b32.numel() else 0.0
    diff = float((got.to(b32.device).float() - b32).abs().nan_to_num(float("inf")).max()) if b32.numel() else 0.0
    tol = tolerance(dtype or want.dtype) * max(scale, torch.finfo(torch.float32).tiny)
    if not diff <= tol:
        raise MismatchError(f"{what} differs from {plain_name}'s by {diff:.3g} (largest value {scale:.3g}, "
                            f"rounding explains {tol:.3g})")


def one_line(exc: BaseException, limit: int = 400) -> str:
    """``Type: first line of the message``, at most ``limit`` characters; a first line ending in ``:``
    (dynamo's ``backend='...' raised:``) is joined with the next, which holds the reason."""
    text = [t.strip() for t in str(exc).strip().splitlines() if t.strip()]
    while len(text) > 1 and text[0].endswith(":"):
        text[:2] = [f"{text[0]} {text[1]}"]
    line = f"{type(exc).__name__}: {text[0] if text else ''}".strip().rstrip(":")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _is_memory_error(exc: BaseException) -> bool:
    # The device allocator running out is not the fast path's fault; Triton's "out of resource"
    # (shared memory, registers) is, and torch raises it with the same type in places.
    return isinstance(exc, torch.OutOfMemoryError) and "out of resource" not in str(exc)


def _tracing(args, kwargs) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    if torch.compiler.is_compiling():
        return True
    return any(isinstance(t, torch.Tensor) and is_fake(t) for t in (*args, *kwargs.values()))


@contextlib.contextmanager
def _outside_callers_hooks():
    """The probe's own graph is not part of the caller's step: hide it from the caller's dispatch modes
    (selective activation checkpointing, op counters) and saved-tensor hooks (activation checkpointing)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        yield


class FastPath:
    """``fast_fn`` where it works, ``plain_fn`` (same arguments, same result up to rounding) where it
    failed at first use; see the module docstring. ``fallback_reason`` holds the one-line error of the
    first failure (None while none)."""

    def __init__(self, name: str, fast_fn: Callable, plain_fn: Callable, *,
                 signature: Optional[Callable[..., Hashable]] = None,
                 probe: Optional[Callable] = _DEFAULT, plain_name: str = "the plain path",
                 first_call: Optional[Callable[[], contextlib.AbstractContextManager]] = None, first_uses: int = 1,
                 describe: Optional[Callable[..., str]] = None, compare: bool = False):
        self.name, self.fast_fn, self.plain_fn, self.plain_name = name, fast_fn, plain_fn, plain_name
        self.describe = describe
        self.signature = signature or signature_of
        default = comparing_probe(plain_fn, plain_name) if compare else forward_backward_probe
        self.probe = default if probe is _DEFAULT else probe
        self.first_call, self.first_uses = first_call or contextlib.nullcontext, first_uses
        self.fallback_reason: Optional[str] = None
        self._proven: Dict[Hashable, int] = {}  # successful guarded calls per signature

    def __call__(self, *args, **kwargs):
        if _tracing(args, kwargs):
            # Nothing can be probed on traced tensors: a graph keeps the path the eager calls chose.
            return (self.fast_fn if self.fallback_reason is None else self.plain_fn)(*args, **kwargs)
        key = self.signature(*args, **kwargs)
        if self._proven.get(key, 0) >= self.first_uses:
            return self.fast_fn(*args, **kwargs)
        if self.fallback_reason is not None:
            return self.plain_fn(*args, **kwargs)
        try:
            out, probed = None, False
            if self.probe is not None:
                with _outside_callers_hooks():
                    # A probe returning False could not run here, or ran on another variant of the call
                    # (GUARD_CALL): the real call is guarded too.
                    result = self.probe(self.fast_fn, args, kwargs)
                    probed = result is not False and result is not GUARD_CALL
            if not probed:
                with self.first_call():
                    out = self.fast_fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - whatever the fast path raises at first use, the plain path runs
            if _is_memory_error(exc):
                raise
            self.fallback_reason = one_line(exc)
            what = self.name if self.describe is None else f"{self.name} ({self.describe(*args, **kwargs)})"
            logger.warning(f"{what} failed at its first use ({self.fallback_reason}); {self.plain_name} runs "
                           f"from here on")
            return self.plain_fn(*args, **kwargs)
        self._proven[key] = self._proven.get(key, 0) + 1
        return self.fast_fn(*args, **kwargs) if out is None else out

    @property
    def fell_back(self) -> bool:
        """Whether the fast path failed at a first use (new signatures then run the plain path)."""
        return self.fallback_reason is not None

    def reset(self) -> None:
        """Forget every probe and failure (tests; a new run in the same process)."""
        self.fallback_reason = None
        self._proven.clear()
