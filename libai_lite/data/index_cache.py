"""Index caches of the GPT dataset: files written atomically by global rank 0 under a file lock and
memory-mapped by every rank and DataLoader worker (Megatron's names, next to the data or in
``cache_dir``)."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import zlib
from typing import Callable

import numpy as np

from ..utils.distributed import broadcast_object, get_rank
from ..utils.errors import UsageError
from ..utils.files import atomic_write

logger = logging.getLogger("libai_lite.data.gpt_dataset")


def _atomic_write(path: str, data) -> None:
    """Write an array as ``.npy`` or a dict as JSON so that readers see the whole file or none."""
    if isinstance(data, np.ndarray):
        atomic_write(path, lambda f: np.save(f, data, allow_pickle=False))
    else:
        atomic_write(path, lambda f: f.write(json.dumps(data, indent=1, sort_keys=True).encode()))


def _load_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _load_npy(path: str) -> np.ndarray:
    try:
        # A plain ndarray view (no copy): indexing a np.memmap builds a costly object per read.
        return np.asarray(np.load(path, mmap_mode="r", allow_pickle=False))
    except ValueError:
        # An empty array cannot be memory-mapped; it is also too small to matter.
        return np.load(path, allow_pickle=False)


def array_checksum(array: np.ndarray) -> str:
    """CRC-32 (``zlib.crc32``, the checkpoints' checksum) of an array's bytes, as 8 hex digits."""
    return f"{zlib.crc32(memoryview(np.ascontiguousarray(array)).cast('B')):08x}"


def files_state(paths) -> tuple:
    """What identifies the current version of each file (inode, size, modification time; None when missing),
    so a check of unchanged files need not be repeated."""
    state = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            state.append(None)
        else:
            state.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(state)


def _dir_writable(directory: str) -> bool:
    directory = directory or "."
    # root passes os.access everywhere; a directory with no write bit at all is meant read-only
    # (shared fixtures, published corpora), so do not litter it even when we could.
    return (os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)
            and bool(os.stat(directory).st_mode & 0o222))


_warned_read_only: set = set()


def cache_stem(data_prefix: str, cache_dir: str | None) -> str:
    """Path stem for files cached about ``data_prefix``.

    Next to the data it is the prefix itself (Megatron's names). In ``cache_dir`` the basename gets a short
    hash of the prefix's absolute path, so same-named prefixes sharing one cache do not evict each other.
    With a read-only data directory and no ``cache_dir``, ``$LIBAI_LITE_CACHE_DIR`` (default
    ``~/.cache/libai_lite``) is used.
    """
    data_prefix = str(data_prefix)
    if cache_dir is None:
        if _dir_writable(os.path.dirname(data_prefix)):
            return data_prefix
        cache_dir = os.environ.get("LIBAI_LITE_CACHE_DIR", os.path.join("~", ".cache", "libai_lite"))
        if data_prefix not in _warned_read_only:
            _warned_read_only.add(data_prefix)
            logger.warning(f"{os.path.dirname(data_prefix) or '.'} is not writable; caching dataset "
                           f"indices in {cache_dir} (set cache_dir to choose another place)")
    cache_dir = os.path.expanduser(str(cache_dir))
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        raise cache_write_error(cache_dir, e) from e
    digest = hashlib.md5(os.path.abspath(data_prefix).encode()).hexdigest()[:8]
    return os.path.join(cache_dir, f"{os.path.basename(data_prefix)}-{digest}")


def cache_write_error(path: str, exc: OSError) -> UsageError:
    """The one line for an index cache that cannot be created or written at ``path`` (a file in the way, a
    read-only or full disk), naming the key that moves it."""
    blocker = os.path.abspath(path)
    while not os.path.exists(blocker) and os.path.dirname(blocker) != blocker:
        blocker = os.path.dirname(blocker)
    if os.path.exists(blocker) and not os.path.isdir(blocker):
        reason = f"{blocker} is a file"
    else:
        reason = exc.strerror or str(exc)
    return UsageError(f"cannot write the dataset's index cache at {path} ({reason}); set dataloader.train.cache_dir "
                      f"to a writable directory (null caches beside the data)")


def index_stem(data_prefix: str, cache_dir: str | None, name: str, num_samples: int, seq_length: int,
               seed: int) -> str:
    """Where a split's index arrays are cached, without their ``_{kind}_idx.npy`` ending (Megatron's names)."""
    return f"{cache_stem(data_prefix, cache_dir)}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s"


@contextlib.contextmanager
def _cache_lock(path: str, exclusive: bool):
    """An advisory ``flock`` on ``{path}.lock``: builders take it exclusively, readers shared.

    So no job reads arrays another is still writing or removing. Where locks cannot be taken (a read-only
    cache, no ``flock``), the atomic writes alone still keep every file whole. The last holder removes the
    lock file, so none is left beside the data.
    """
    lock_path = f"{path}.lock"
    while True:
        try:
            f = open(lock_path, "a+b")
        except OSError:
            yield
            return
        try:
            fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        except OSError:
            with f:
                yield
            return
        # A holder that finished may have removed the file we opened: lock the one now at the path instead.
        try:
            current = os.fstat(f.fileno()).st_ino == os.stat(lock_path).st_ino
        except OSError:
            current = False
        if current:
            break
        f.close()
    with f:
        try:
            yield
        finally:
            _remove_if_last(f, lock_path)


def _remove_if_last(f, lock_path: str) -> None:
    """Remove the lock file when no other process holds it: its exclusive lock is free only then.

    Anyone who opened the file before the removal sees, once it gets the lock, that the path no longer names
    its file and starts over on a new one (``_cache_lock``'s loop).
    """
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another process holds it and removes it in turn
    try:
        os.unlink(lock_path)
    except OSError:
        pass


def _build_on_rank0(is_valid: Callable[[], bool], build: Callable[[], None], what: str,
                    open_cache: Callable[[], None] | None = None, lock: bool = True) -> None:
    """Rank 0 builds when the cache is not valid; every rank then waits, checks and opens it.

    With ``lock``, rank 0 checks and builds under an exclusive lock and every rank opens under a shared one,
    so another job rebuilding the same files is never caught half-way. A one-file atomic cache needs none.
    """
    guard = _cache_lock if lock else (lambda path, exclusive: contextlib.nullcontext())
    error = None
    if get_rank() == 0:
        try:
            with guard(what, exclusive=True):
                if not is_valid():
                    build()
        except Exception as e:  # reach the collective anyway, or the other ranks hang until timeout
            error = e
    # Rank 0 says why in its one line; the other ranks stop on a user error, which they do not print, rather
    # than each finding the cache missing and printing a traceback of their own.
    failed = broadcast_object(None if error is None else " ".join(str(error).split()) or type(error).__name__)
    if error is not None:
        raise error
    if failed is not None:
        raise UsageError(f"rank 0 could not build {what}: {failed}")
    with guard(what, exclusive=False):
        if not is_valid():
            raise RuntimeError(
                f"rank {get_rank()}: {what} is missing or stale after rank 0 built it; rank 0 failed "
                f"(see its log) or the cache is not on storage every rank can read (set cache_dir)")
        if open_cache is not None:
            open_cache()
