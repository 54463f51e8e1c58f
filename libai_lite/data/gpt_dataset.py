"""Megatron-LM's GPT pretraining dataset: fixed-length samples cut from a shuffled document stream.

Three index arrays turn an indexed dataset plus a split's documents into samples:

* ``doc_idx``     the split's documents, repeated for as many epochs as ``num_samples`` needs,
                  each epoch shuffled on its own (so every epoch sees every document once);
* ``sample_idx``  ``(num_samples_total + 1, 2)`` rows of ``(position in doc_idx, token offset)``:
                  sample ``i`` is the ``seq_length + 1`` tokens from row ``i`` to row ``i + 1``
                  inclusive, so consecutive samples share one token (Megatron's build_sample_idx);
* ``shuffle_idx`` a permutation of the samples; when the last epoch is needed for less than 80%
                  of its samples (Megatron's ``separate_last_epoch``) it is shuffled on its own so
                  its partial coverage is not smeared over the earlier, complete epochs.

The arrays are built once by global rank 0, saved atomically as ``.npy`` with Megatron's names and
memory-mapped by every rank and DataLoader worker.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Callable

import numpy as np
import torch

from .indexed_dataset import MMapIndexedDataset
from ..utils.errors import UsageError

logger = logging.getLogger(__name__)

# PyTorch's cross-entropy default; GPTLoss skips these positions (used for eval padding).
IGNORE_INDEX = -100

# Bump when the meaning of the cached arrays changes, so stale caches are rebuilt, not trusted.
_INDEX_FORMAT = "libai_lite-gpt-indexmap-v1"
_SAMPLE_IDX_CHUNK = 1 << 22
_TOKEN_SCAN_CHUNK = 1 << 26


# ----------------------------------------------------------------------------------------------
# Index construction (pure functions of their arguments; vectorised numpy)
# ----------------------------------------------------------------------------------------------
def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose token stream yields ``num_samples`` samples of ``seq_length + 1`` tokens.

    A stream of ``t`` tokens gives ``(t - 1) // seq_length`` samples: each sample needs one extra
    token, which it shares with the next sample (Megatron's ``_num_epochs`` in closed form).
    """
    if tokens_per_epoch <= 0:
        raise UsageError("an epoch with no tokens cannot produce samples")
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def separate_last_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int, num_epochs: int) -> bool:
    """Megatron's rule: shuffle the last epoch on its own when < 80% of its samples are used."""
    if num_epochs == 1:
        return False
    from_full_epochs = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    last_epoch_samples = num_samples - from_full_epochs
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    return last_epoch_samples < int(0.80 * samples_per_epoch)


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState) -> np.ndarray:
    """``documents`` once per epoch, each epoch an independent permutation drawn from ``rng``."""
    documents = np.asarray(documents)
    dtype = np.int32 if documents.size == 0 or documents.max() < np.iinfo(np.int32).max else np.int64
    out = np.empty(num_epochs * documents.size, dtype=dtype)
    for epoch in range(num_epochs):
        out[epoch * documents.size:(epoch + 1) * documents.size] = rng.permutation(documents)
    return out


def build_sample_idx(doc_sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int) -> np.ndarray:
    """Megatron's build_sample_idx, vectorised: where each sample starts in the document stream.

    Row ``i`` (for ``i >= 1``) locates stream position ``i * seq_length``: the entry of ``doc_idx``
    holding that token and the token's offset inside the document. Documents of length zero never
    hold a position, exactly as in Megatron's C++ loop.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    stream_sizes = np.asarray(doc_sizes, dtype=np.int64)[doc_idx]
    ends = np.cumsum(stream_sizes)
    starts = ends - stream_sizes
    del stream_sizes
    dtype = np.int32 if len(doc_idx) < np.iinfo(np.int32).max else np.int64
    out = np.empty((num_samples + 1, 2), dtype=dtype)
    out[0] = 0
    # Chunked so a few hundred million samples need tens of MB of scratch, not tens of GB.
    for lo in range(1, num_samples + 1, _SAMPLE_IDX_CHUNK):
        hi = min(lo + _SAMPLE_IDX_CHUNK, num_samples + 1)
        pos = np.arange(lo, hi, dtype=np.int64) * seq_length
        which = np.searchsorted(ends, pos, side="right")
        out[lo:hi, 0] = which
        out[lo:hi, 1] = pos - starts[which]
    return out


def build_shuffle_idx(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Megatron's _build_shuffle_idx: shuffle ``[0, num_samples)`` and ``[num_samples, total_size)`` apart."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


# ----------------------------------------------------------------------------------------------
# Documents made of several sequences
# ----------------------------------------------------------------------------------------------
class _DocumentReader:
    """Reads documents (not sequences) from an indexed dataset.

    Megatron's GPT dataset silently assumes one sequence per document; sentence-split corpora
    break that, so documents with several sequences are read as their concatenation.
    """

    def __init__(self, indexed_dataset):
        self.dataset = indexed_dataset
        sizes = np.asarray(indexed_dataset.sizes)
        doc_idx = np.asarray(indexed_dataset.doc_idx, dtype=np.int64)
        self.num_documents = max(len(doc_idx) - 1, 0)
        self.one_sequence_per_document = len(doc_idx) == len(sizes) + 1 and np.array_equal(
            doc_idx, np.arange(len(sizes) + 1))
        if self.one_sequence_per_document:
            self.doc_sizes = sizes
        else:
            self._doc_idx = doc_idx
            self._seq_starts = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
            self.doc_sizes = self._seq_starts[doc_idx[1:]] - self._seq_starts[doc_idx[:-1]]

    def read(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``doc`` (to its end by default)."""
        if self.one_sequence_per_document:
            return self.dataset.get(doc, offset=offset, length=length)
        first_seq, end_seq = int(self._doc_idx[doc]), int(self._doc_idx[doc + 1])
        base = int(self._seq_starts[first_seq])
        if length is None:
            length = int(self._seq_starts[end_seq]) - base - offset
        lo, hi = base + offset, base + offset + length
        parts = []
        for seq in range(first_seq, end_seq):
            seq_lo, seq_hi = int(self._seq_starts[seq]), int(self._seq_starts[seq + 1])
            a, b = max(lo, seq_lo), min(hi, seq_hi)
            if b > a:
                parts.append(self.dataset.get(seq, offset=a - seq_lo, length=b - a))
        if not parts:
            return np.zeros(0, dtype=self.dataset.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


# ----------------------------------------------------------------------------------------------
# Cache files: atomic writes, built by rank 0, memory-mapped by everyone
# ----------------------------------------------------------------------------------------------
def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _atomic_write(path: str, write: Callable) -> None:
    # The pid keeps two jobs sharing a cache from clobbering each other's half-written file.
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _save_npy(path: str, array: np.ndarray) -> None:
    _atomic_write(path, lambda f: np.save(f, array, allow_pickle=False))


def _save_json(path: str, obj: dict) -> None:
    _atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1, sort_keys=True).encode()))


def _load_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _load_npy(path: str) -> np.ndarray:
    try:
        # A plain ndarray view of the map (no copy): indexing a np.memmap builds a memmap object per
        # row and element read, a third of the loader's time (bench/data_loader.py).
        return np.asarray(np.load(path, mmap_mode="r", allow_pickle=False))
    except ValueError:
        # An empty array cannot be memory-mapped; it is also too small to matter.
        return np.load(path, allow_pickle=False)


def _npy_shape(path: str) -> tuple:
    with open(path, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, _, _ = read(f)
    return tuple(shape)


def _dir_writable(directory: str) -> bool:
    directory = directory or "."
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK | os.X_OK):
        return False
    # root passes os.access everywhere; a directory with no write bit at all is meant read-only
    # (shared fixtures, published corpora), so do not litter it even when we could.
    return bool(os.stat(directory).st_mode & 0o222)


_warned_read_only: set = set()


def cache_stem(data_prefix: str, cache_dir: str | None) -> str:
    """Path stem for files cached about ``data_prefix``.

    Next to the data it is the prefix itself (Megatron's names). In ``cache_dir`` the basename
    gets a short hash of the prefix's absolute path, so ``en/text_document`` and
    ``zh/text_document`` sharing one cache do not evict each other. When the data directory is
    read-only and no ``cache_dir`` is given, ``$LIBAI_LITE_CACHE_DIR`` (default
    ``~/.cache/libai_lite``) is used instead.
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
    os.makedirs(cache_dir, exist_ok=True)
    digest = hashlib.md5(os.path.abspath(data_prefix).encode()).hexdigest()[:8]
    return os.path.join(cache_dir, f"{os.path.basename(data_prefix)}-{digest}")


def _build_on_rank0(is_valid: Callable[[], bool], build: Callable[[], None], what: str) -> None:
    """Rank 0 builds when the cache is not valid; every rank then waits and checks it."""
    error = None
    if _rank() == 0 and not is_valid():
        try:
            build()
        except Exception as e:  # reach the barrier anyway, or the other ranks hang until timeout
            error = e
    _barrier()
    if error is not None:
        raise error
    if not is_valid():
        raise RuntimeError(
            f"rank {_rank()}: {what} is missing or stale after rank 0 built it; rank 0 failed "
            f"(see its log) or the cache is not on storage every rank can read (set cache_dir)")


def token_id_range(indexed_dataset, data_prefix: str, cache_dir: str | None = None,
                   vocab_size: int | None = None) -> tuple:
    """``(min_token_id, max_token_id)`` over the whole indexed dataset, cached in a small JSON.

    Scanning every token is O(corpus), so it is done once by rank 0 and kept in
    ``{prefix}_token_range.json``; the cache is trusted only while the token and sequence
    counts still match the data. With ``vocab_size``, ids outside ``[0, vocab_size)`` raise a
    UsageError before anything is cached, so refused data leaves no file behind.
    """
    path = cache_stem(data_prefix, cache_dir) + "_token_range.json"
    sizes = np.asarray(indexed_dataset.sizes)
    expect = {"num_sequences": int(len(sizes)), "num_tokens": int(sizes.sum(dtype=np.int64))}

    def valid() -> bool:
        cached = _load_json(path)
        return cached is not None and all(cached.get(k) == v for k, v in expect.items())

    def build() -> None:
        start = time.perf_counter()
        lo, hi = _scan_token_range(indexed_dataset)
        if vocab_size is not None:
            _refuse_out_of_vocab(data_prefix, lo, hi, vocab_size)
        _save_json(path, {**expect, "min_token_id": lo, "max_token_id": hi})
        logger.info(f"scanned {expect['num_tokens']} tokens of {data_prefix} for their id range "
                    f"in {time.perf_counter() - start:.1f}s")

    _build_on_rank0(valid, build, path)
    cached = _load_json(path)
    if vocab_size is not None:
        _refuse_out_of_vocab(data_prefix, cached["min_token_id"], cached["max_token_id"], vocab_size)
    return cached["min_token_id"], cached["max_token_id"]


def _refuse_out_of_vocab(data_prefix: str, lo, hi, vocab_size: int) -> None:
    if hi is not None and (hi >= vocab_size or lo < 0):
        bad = hi if hi >= vocab_size else lo
        raise UsageError(
            f"{data_prefix} holds token id {bad}, outside the model's vocabulary of {vocab_size}: "
            f"preprocess it with this model's tokenizer (tools/preprocess_data.py) or fix vocab_size")


def _scan_token_range(ds) -> tuple:
    sizes = np.asarray(ds.sizes, dtype=np.int64)
    total = int(sizes.sum())
    if total == 0:
        return None, None
    lo, hi = None, None

    def update(chunk):
        nonlocal lo, hi
        if chunk.size:
            c_lo, c_hi = int(chunk.min()), int(chunk.max())
            lo = c_lo if lo is None else min(lo, c_lo)
            hi = c_hi if hi is None else max(hi, c_hi)

    flat = getattr(ds, "_bin", None)
    pointers = getattr(ds, "pointers", None)
    if isinstance(flat, np.ndarray) and pointers is not None and len(pointers):
        # Megatron writes sequences back to back, so the token array can be scanned in big
        # contiguous chunks instead of one numpy call per sequence.
        first = int(pointers[0]) // flat.dtype.itemsize
        last = int(pointers[-1]) // flat.dtype.itemsize + int(sizes[-1])
        if last - first == total and last <= flat.size:
            for a in range(first, last, _TOKEN_SCAN_CHUNK):
                update(np.asarray(flat[a:min(a + _TOKEN_SCAN_CHUNK, last)]))
            return lo, hi
    step = 1 << 14
    for a in range(0, len(sizes), step):
        for seq in ds[a:a + step]:
            update(seq)
    return lo, hi


# ----------------------------------------------------------------------------------------------
# The dataset
# ----------------------------------------------------------------------------------------------
class GPTDataset(torch.utils.data.Dataset):
    """Megatron's GPT dataset over the ``documents`` of one split.

    ``dataset[i]`` is ``{"input_ids": LongTensor[seq_length], "labels": LongTensor[seq_length]}``:
    the ``seq_length + 1`` tokens of sample ``shuffle_idx[i]`` split as ``tokens[:-1]`` and
    ``tokens[1:]``. ``len(dataset)`` covers whole epochs, so it is at least ``num_samples``.
    ``max_token_id`` / ``min_token_id`` describe the whole indexed dataset, so the caller can
    refuse ids beyond the vocabulary (see ``check_token_ids``).
    """

    def __init__(self, name: str, indexed_dataset, documents, num_samples: int, seq_length: int,
                 seed: int, data_prefix: str, cache_dir: str | None = None):
        if int(seq_length) < 1:
            raise UsageError(f"seq_length must be >= 1, got {seq_length}")
        if int(num_samples) < 0:
            raise UsageError(f"num_samples must be >= 0, got {num_samples}")
        self.name = str(name)
        self.indexed_dataset = indexed_dataset
        self.data_prefix = str(data_prefix)
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.cache_dir = cache_dir
        self._reader = _DocumentReader(indexed_dataset)

        documents = np.ascontiguousarray(documents, dtype=np.int64)
        if documents.ndim != 1 or documents.size == 0:
            raise UsageError(f"{self.data_prefix}: the {self.name} split has no documents")
        if documents.min() < 0 or documents.max() >= self._reader.num_documents:
            raise UsageError(f"{self.data_prefix}: {self.name} documents must lie in "
                             f"[0, {self._reader.num_documents}), got [{documents.min()}, {documents.max()}]")
        self.documents = documents
        self.tokens_per_epoch = int(np.asarray(self._reader.doc_sizes)[documents].sum(dtype=np.int64))
        if self.tokens_per_epoch == 0:
            raise UsageError(f"{self.data_prefix}: the {self.name} split's {documents.size} documents "
                             f"hold no tokens; check the corpus or the splits string")
        self.num_epochs = num_epochs_needed(self.tokens_per_epoch, self.seq_length, self.num_samples)
        self.separate_last_epoch = separate_last_epoch(self.tokens_per_epoch, self.seq_length,
                                                       self.num_samples, self.num_epochs)
        self.index_paths = self._index_paths()
        self._load_indices()
        self.min_token_id, self.max_token_id = token_id_range(indexed_dataset, self.data_prefix, cache_dir)

    # -- index files -------------------------------------------------------------------------
    def _index_paths(self) -> dict:
        stem = (f"{cache_stem(self.data_prefix, self.cache_dir)}_{self.name}_indexmap_"
                f"{self.num_samples}ns_{self.seq_length}sl_{self.seed}s")
        return {kind: f"{stem}_{kind}_idx.npy" for kind in ("doc", "sample", "shuffle")} | {
            "desc": f"{stem}_desc.json"}

    def _description(self) -> dict:
        # Everything the arrays depend on beyond the file name: a changed split or corpus under
        # the same name must not reuse old indices.
        return {
            "format": _INDEX_FORMAT,
            "num_samples": self.num_samples,
            "seq_length": self.seq_length,
            "seed": self.seed,
            "num_documents_in_dataset": self._reader.num_documents,
            "documents_count": int(self.documents.size),
            "documents_md5": hashlib.md5(self.documents.tobytes()).hexdigest(),
            "tokens_per_epoch": self.tokens_per_epoch,
            "num_epochs": self.num_epochs,
            "separate_last_epoch": self.separate_last_epoch,
        }

    def _expected_shapes(self) -> dict:
        total = (self.num_epochs * self.tokens_per_epoch - 1) // self.seq_length
        return {"doc": (self.num_epochs * self.documents.size,), "sample": (total + 1, 2), "shuffle": (total,)}

    def _cache_valid(self) -> bool:
        paths = self.index_paths
        if not all(os.path.isfile(paths[k]) for k in ("doc", "sample", "shuffle")):
            return False
        desc = _load_json(paths["desc"])
        # Without a description the files came from elsewhere (e.g. Megatron-LM itself, which uses
        # the same names): accept them when their shapes fit this split.
        if desc is not None and desc != self._description():
            return False
        try:
            return all(_npy_shape(paths[kind]) == shape for kind, shape in self._expected_shapes().items())
        except (OSError, ValueError):
            return False

    def _build_indices(self) -> None:
        paths = self.index_paths
        # Old files go first: a build interrupted half-way must leave files missing (and so be
        # rebuilt), never a mix of old and new arrays that happen to have the right shapes.
        for kind in ("desc", "doc", "sample", "shuffle"):
            if os.path.exists(paths[kind]):
                os.remove(paths[kind])
        start = time.perf_counter()
        rng = np.random.RandomState(seed=self.seed)
        doc_idx = build_doc_idx(self.documents, self.num_epochs, rng)
        sample_idx = build_sample_idx(self._reader.doc_sizes, doc_idx, self.seq_length,
                                      self.num_epochs, self.tokens_per_epoch)
        total = sample_idx.shape[0] - 1
        if self.separate_last_epoch:
            first = ((self.num_epochs - 1) * self.tokens_per_epoch - 1) // self.seq_length
        else:
            first = total
        shuffle_idx = build_shuffle_idx(first, total, rng)
        _save_npy(paths["doc"], doc_idx)
        _save_npy(paths["sample"], sample_idx)
        _save_npy(paths["shuffle"], shuffle_idx)
        _save_json(paths["desc"], self._description())
        logger.info(f"built {self.name} indices for {self.data_prefix}: {total} samples of "
                    f"{self.seq_length} tokens over {self.num_epochs} epoch(s) "
                    f"(separate last epoch: {self.separate_last_epoch}) in {time.perf_counter() - start:.2f}s")

    def _load_indices(self) -> None:
        _build_on_rank0(self._cache_valid, self._build_indices, self.index_paths["sample"])
        self.doc_idx = _load_npy(self.index_paths["doc"])
        self.sample_idx = _load_npy(self.index_paths["sample"])
        self.shuffle_idx = _load_npy(self.index_paths["shuffle"])

    # -- pickling for DataLoader workers started with "spawn" ----------------------------------
    def __getstate__(self):
        state = self.__dict__.copy()
        # Memory maps would be pickled as full in-memory copies; reopen them by path instead.
        for key in ("doc_idx", "sample_idx", "shuffle_idx", "_reader"):
            state.pop(key)
        if hasattr(self.indexed_dataset, "path_prefix"):
            state["indexed_dataset"] = None
            state["_indexed_prefix"] = self.indexed_dataset.path_prefix
        docs = self.documents
        if docs.size and docs[-1] - docs[0] + 1 == docs.size and (np.diff(docs) == 1).all():
            state["documents"] = ("range", int(docs[0]), int(docs[-1]) + 1)  # a split is a range
        return state

    def __setstate__(self, state):
        prefix = state.pop("_indexed_prefix", None)
        if isinstance(state["documents"], tuple):
            _, start, stop = state["documents"]
            state["documents"] = np.arange(start, stop, dtype=np.int64)
        self.__dict__.update(state)
        if prefix is not None:
            self.indexed_dataset = MMapIndexedDataset(prefix)
        self._reader = _DocumentReader(self.indexed_dataset)
        self.doc_idx = _load_npy(self.index_paths["doc"])
        self.sample_idx = _load_npy(self.index_paths["sample"])
        self.shuffle_idx = _load_npy(self.index_paths["shuffle"])

    # -- samples -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.shuffle_idx.shape[0])

    def get_tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` token ids of sample ``idx`` as int64."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        i = int(self.shuffle_idx[idx])
        doc_f, off_f = (int(v) for v in self.sample_idx[i])
        doc_l, off_l = (int(v) for v in self.sample_idx[i + 1])
        read = self._reader.read
        if doc_f == doc_l:
            tokens = read(int(self.doc_idx[doc_f]), off_f, off_l - off_f + 1)
        else:
            parts = [read(int(self.doc_idx[doc_f]), off_f)]
            parts += [read(int(d)) for d in self.doc_idx[doc_f + 1:doc_l]]
            parts.append(read(int(self.doc_idx[doc_l]), 0, off_l + 1))
            tokens = np.concatenate(parts)
        if tokens.size != self.seq_length + 1:
            raise RuntimeError(f"{self.index_paths['sample']} does not match {self.data_prefix} "
                               f"(sample {idx} has {tokens.size} tokens, expected {self.seq_length + 1}); "
                               f"delete the *_indexmap_* files so they are rebuilt")
        return tokens.astype(np.int64)

    def __getitem__(self, idx: int) -> dict:
        tokens = torch.from_numpy(self.get_tokens(int(idx)))
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


def check_token_ids(dataset, vocab_size: int) -> None:
    """Raise ValueError when ``dataset`` holds token ids outside ``[0, vocab_size)``.

    Works for GPTDataset and BlendableDataset (anything with ``max_token_id`` and, for blends,
    ``datasets``); ids beyond the embedding table would otherwise fail deep inside the model.
    """
    for ds in getattr(dataset, "datasets", None) or [dataset]:
        hi, lo = getattr(ds, "max_token_id", None), getattr(ds, "min_token_id", None)
        if hi is None:
            continue
        _refuse_out_of_vocab(ds.data_prefix, lo if lo is not None else 0, hi, vocab_size)
