"""One counter of host reads, for the tests and benchmarks that hold a training step to none.

A host read copies a device value back to the host: ``float(t)``/``.item()``/``bool(t)``
(``aten._local_scalar_dense``), ``torch.equal``, and every op whose output size depends on the data
(``nonzero``, boolean-mask indexing, ``masked_select``, ``bincount``, ``unique``, ``repeat_interleave``
without ``output_size``), plus ``Tensor.tolist``. On a GPU each one is a sync: the host waits for the
queue to drain and the step stalls. The same calls happen on the CPU, so counting them there, under a
``TorchDispatchMode``, predicts a GPU run's syncs without a GPU.

A dispatch mode sees the ops a Python call dispatches, not those a kernel calls inside itself (torch's
CPU fused AdamW reads each parameter's step counter in its kernel, its CUDA kernel does not): a profile
of ``PROFILER_READS`` events sees those. Imports only torch and the standard library.
"""
from __future__ import annotations

import collections
import os
import traceback
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

# A profile lists the ops a kernel runs inside it too, and these sit under most other reads there (a
# boolean index runs nonzero; masked_select and repeat_interleave read their size with
# _local_scalar_dense): counting those as well would count one read twice. The CPU's bincount and
# unique read their input's memory directly and show none of these; the dispatch mode counts them.
PROFILER_READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::equal")

_COPIES = {"_local_scalar_dense", "equal"}
_DATA_SIZED = {"nonzero", "masked_select", "bincount", "unique", "_unique2", "unique_consecutive", "unique_dim"}
_MASK_INDEXED = {"index", "index_put", "index_put_"}
_MASKS = (torch.bool, torch.uint8)
_HERE = os.path.abspath(__file__)


def _masked_fill(self, indices, value, accumulate=False) -> bool:
    # torch's index_put_ turns `t[mask] = scalar` into masked_fill_ (canDispatchToMaskedFill in
    # TensorAdvancedIndexing.cpp): one boolean mask on self's device, a one-element CPU value; no read.
    masks = [i for i in indices if i is not None]
    return (not accumulate and value.numel() == 1 and value.device.type == "cpu" and len(masks) == 1
            and masks[0].dtype in _MASKS and masks[0].device == self.device)


def is_host_read(func, args, kwargs=None) -> bool:
    """Whether the ATen call ``func(*args, **kwargs)`` reads a device value back to the host."""
    name = func.overloadpacket.__name__
    if name in _COPIES or name in _DATA_SIZED:
        return True
    if func is _aten.repeat_interleave.Tensor:
        # ``x.repeat_interleave(tensor)`` reaches the dispatcher as this overload (and an index_select).
        return (kwargs or {}).get("output_size") is None
    if name in _MASK_INDEXED and len(args) > 1:
        # A mask's selection has a data-dependent size: its count is read back.
        if not any(isinstance(i, torch.Tensor) and i.dtype in _MASKS for i in (args[1] or ())):
            return False
        return name == "index" or not _masked_fill(*args, **(kwargs or {}))
    return False


# The checkout's libai_lite/, projects/ and compat/ (an installed package's own files under site-packages never).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = tuple(os.path.join(_ROOT, name) + os.sep for name in ("libai_lite", "projects", "compat"))


def _is_ours(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_OURS) and "site-packages" not in path


def _where() -> str:
    """The innermost project frame, then the three innermost frames of all (often inside torch)."""
    stack = [f for f in traceback.StackSummary.extract(traceback.walk_stack(None), lookup_lines=False)
             if os.path.abspath(f.filename) != _HERE][::-1]
    ours = [f for f in stack if _is_ours(f.filename)]
    return " < ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in ours[-1:] + stack[-3:])


class HostReadCounter(TorchDispatchMode):
    """Counts host reads while active.

    ``counts``: reads per op name (``"tolist"`` for ``Tensor.tolist``, counted only with ``tolist=True``:
    it dispatches nothing on the CPU, so it is wrapped). ``reads``: one ``"<op> at <where>"`` per read, where
    the innermost frame of libai_lite or projects comes first. ``paused()`` leaves a region out (an
    optimizer's step). Entering again keeps counting; ``reset()`` starts over.
    """

    def __init__(self, *, tolist: bool = False):
        super().__init__()
        self.tolist = tolist
        self.counts: collections.Counter[str] = collections.Counter()
        self.reads: list[str] = []
        self._paused = 0
        self._saved_tolist = None

    @property
    def total(self) -> int:
        """All reads counted so far."""
        return sum(self.counts.values())

    def reset(self) -> None:
        """Forget the reads counted so far."""
        self.counts.clear()
        # A new list: callers keep the previous one as a record of what was read.
        self.reads = []

    def _record(self, op: str, name: str) -> None:
        self.counts[name] += 1
        self.reads.append(f"{op} at {_where()}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused and is_host_read(func, args, kwargs):
            self._record(str(func), func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    @contextmanager
    def paused(self):
        """Leave the reads made in this block uncounted."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def __enter__(self):
        if self.tolist:
            self._saved_tolist = tolist = torch.Tensor.tolist

            def counted(t, *a, **k):
                if not self._paused:
                    self._record("Tensor.tolist", "tolist")
                return tolist(t, *a, **k)

            torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        if self._saved_tolist is not None:
            torch.Tensor.tolist, self._saved_tolist = self._saved_tolist, None
        return super().__exit__(*exc)


@contextmanager
def count_host_reads(*, tolist: bool = True):
    """``with count_host_reads() as c: ...`` then ``c.total``, ``c.counts``, ``c.reads``."""
    with HostReadCounter(tolist=tolist) as counter:
        yield counter
