"""What a split's index arrays will cost, computed before they are built, and progress while they are.

Without this, a run asking for far more samples than its corpus holds fails deep inside numpy or fills
memory and disk in silence. ``check_index_budget`` refuses, in one line, arrays the machine cannot hold
and warns once about a corpus repeated for very many epochs; ``Progress`` logs a long build's ETA.
"""
from __future__ import annotations

import logging
import os
import shutil
import time

import numpy as np

from ..utils.errors import UsageError
from ..utils.events import format_bytes

logger = logging.getLogger(__name__)

# Above this many epochs of one split the corpus is likely far too small for the run: one warning.
MANY_EPOCHS = 1000
# build_sample_idx's scratch per doc_idx entry: its sizes, cumulative ends and starts (int64 each).
_SCRATCH_PER_DOC_ENTRY = 3 * 8
_LOG_EVERY_S = 10.0

_FIX = {
    "train": "lower train.train_iter (or train.train_epoch), or train on a larger corpus",
    "valid": "lower train.evaluation.eval_iter or raise train.evaluation.eval_period",
    "test": "lower train.evaluation.eval_iter",
}


def _itemsize(count: int, limit) -> int:
    """Bytes per entry of an index array of ``count`` entries: 4 below ``limit`` (int32/uint32), else 8."""
    return 4 if count < limit else 8


def index_bytes(num_documents: int, num_epochs: int, tokens_per_epoch: int, seq_length: int) -> tuple[int, int]:
    """``(memory to build, bytes on disk)`` of a split's doc/sample/shuffle arrays (``gpt_dataset``'s)."""
    entries = int(num_documents) * int(num_epochs)
    samples = (int(num_epochs) * int(tokens_per_epoch) - 1) // int(seq_length)
    doc = entries * _itemsize(entries, np.iinfo(np.int32).max)
    sample = (samples + 1) * 2 * _itemsize(entries, np.iinfo(np.int32).max)
    shuffle = samples * _itemsize(samples, np.iinfo(np.uint32).max - 1)
    disk = doc + sample + shuffle
    # The sample index is located with per-entry scratch beside doc_idx; the shuffle comes after it.
    memory = max(doc + entries * _SCRATCH_PER_DOC_ENTRY + sample, doc + sample + shuffle)
    return memory, disk


def available_memory() -> int | None:
    """Bytes of memory this machine can give without swapping (``MemAvailable``), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def free_disk(path: str) -> int | None:
    """Free bytes on the file system that will hold ``path`` (its nearest existing parent), or None."""
    directory = os.path.abspath(os.path.dirname(path) or ".")
    while not os.path.exists(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _bytes(n: int) -> str:
    # format_bytes stops at T; a request of 1e18 iterations is counted in exabytes and beyond.
    return format_bytes(n) if n < 1024**5 else f"{n:.1e} bytes"


def check_index_budget(name: str, data_prefix: str, num_samples: int, seq_length: int, tokens_per_epoch: int,
                       num_documents: int, num_epochs: int, cache_path: str, warn: bool = True) -> None:
    """Refuse (one-line ``UsageError``) a split whose index arrays need more memory or disk than there is.

    ``cache_path`` is where the arrays will be written. The line says how many epochs of the corpus
    the split asks for and which key to change. Many epochs that still fit get one warning line
    (with ``warn``). The arrays of a cached index (``cache_path`` exists) are not counted again.
    """
    if os.path.exists(cache_path):
        return
    memory, disk = index_bytes(num_documents, num_epochs, tokens_per_epoch, seq_length)
    have_memory, have_disk = available_memory(), free_disk(cache_path)
    asks = (f"the {name} split of {data_prefix} asks for {num_samples:,} samples of {seq_length} tokens, "
            f"{num_epochs:,} epochs of its {tokens_per_epoch:,} tokens")
    fix = _FIX.get(name, "ask for fewer samples")
    if have_memory is not None and memory > have_memory:
        raise UsageError(f"{asks}: building its indices needs {_bytes(memory)} of memory, more than the "
                         f"{_bytes(have_memory)} available; {fix}")
    if have_disk is not None and disk > have_disk:
        raise UsageError(f"{asks}: its indices take {_bytes(disk)}, more than the {_bytes(have_disk)} "
                         f"free where they are cached ({os.path.dirname(os.path.abspath(cache_path))}); {fix} "
                         f"or set dataloader.train.cache_dir to a larger disk")
    if warn and num_epochs > MANY_EPOCHS:
        logger.warning(f"{asks} (indices of {_bytes(disk)}): the corpus is small for this run; {fix}")


class Progress:
    """Logs ``what: done/total (percent), ETA`` at most every 10 s; silent for builds that end sooner."""

    def __init__(self, what: str, total: int):
        self.what, self.total = what, max(int(total), 1)
        self.start = self.last = time.perf_counter()

    def __call__(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last < _LOG_EVERY_S or done <= 0:
            return
        self.last = now
        eta = (now - self.start) * (self.total - done) / done
        logger.info(f"{self.what}: {done:,}/{self.total:,} ({100 * done / self.total:.0f}%), "
                    f"ETA {eta:.0f}s")
