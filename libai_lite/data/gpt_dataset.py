"""Megatron-LM's GPT pretraining dataset: fixed-length samples cut from a shuffled document stream.

* ``doc_idx``: the split's documents repeated for as many epochs as ``num_samples`` needs, shuffled;
* ``sample_idx``: ``(position in doc_idx, token offset)`` rows; sample ``i`` is the ``seq_length + 1``
  tokens from row ``i`` to row ``i + 1``, so consecutive samples share one token;
* ``shuffle_idx``: a permutation of the samples; a last epoch used for under 80% of its samples is
  shuffled apart so its partial coverage is not spread over the complete epochs.

Every array equals Megatron-LM's for the same inputs, so a run moved from Megatron-LM or LiBai reads the
same samples in the same order. Global rank 0 builds them under a file lock and saves them atomically as
``.npy`` with Megatron's names; every rank and worker memory-maps them.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Callable

import numpy as np
import torch

from .index_budget import Progress, check_index_budget
from .index_cache import (_atomic_write, _build_on_rank0, _load_json, _load_npy, array_checksum, cache_write_error,
                          files_state, index_stem)
from .indexed_dataset import MMapIndexedDataset
from ..utils.errors import UsageError

logger = logging.getLogger(__name__)

# PyTorch's cross-entropy default; CausalLMLoss (libai_lite.lm.decoder) skips these positions (used for eval padding).
IGNORE_INDEX = -100

# Bump when the meaning of the cached arrays changes, so stale caches are rebuilt, not trusted.
_INDEX_FORMAT = "libai_lite-gpt-indexmap-v2"
_SAMPLE_IDX_CHUNK = 1 << 22
_INDEX_KINDS = ("doc", "sample", "shuffle")


# ----------------------------------------------------------------------------------------------
# Index construction (pure functions of their arguments; vectorised numpy)
# ----------------------------------------------------------------------------------------------
def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose token stream yields ``num_samples`` samples of ``seq_length + 1`` tokens.

    ``t`` tokens give ``(t - 1) // seq_length`` samples, consecutive samples sharing one token
    (Megatron's ``_num_epochs`` in closed form).
    """
    if tokens_per_epoch <= 0:
        raise UsageError("an epoch with no tokens cannot produce samples")
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def separate_last_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int, num_epochs: int) -> bool:
    """Megatron's rule: shuffle the last epoch on its own when < 80% of its samples are used."""
    if num_epochs == 1:
        return False
    from_full_epochs = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    return num_samples - from_full_epochs < int(0.80 * samples_per_epoch)


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                  separate_last_epoch: bool = False) -> np.ndarray:
    """Megatron's ``_build_doc_idx``: ``documents`` repeated ``num_epochs`` times and shuffled as one array.

    With ``separate_last_epoch`` the last epoch is shuffled on its own, after the others, from the same
    ``rng``. Shuffling the whole repeated list spends the random stream as Megatron does, so later draws agree.
    """
    documents = np.asarray(documents)
    if separate_last_epoch and num_epochs > 1:
        first = build_doc_idx(documents, num_epochs - 1, rng, False)
        return np.concatenate((first, build_doc_idx(documents, 1, rng, False)))
    # Megatron's int32 (its C++ sample-index helper requires it); wider only beyond its range.
    dtype = np.int32 if documents.size == 0 or documents.max() < np.iinfo(np.int32).max else np.int64
    doc_idx = np.tile(documents.astype(dtype, copy=False), num_epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def build_sample_idx(doc_sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int, progress: Callable[[int], None] | None = None) -> np.ndarray:
    """Megatron's build_sample_idx, vectorised: where each sample starts in the document stream.

    Row ``i`` (for ``i >= 1``) locates stream position ``i * seq_length``: the entry of ``doc_idx``
    holding that token and the token's offset inside the document. Documents of length zero never
    hold a position, exactly as in Megatron's C++ loop. ``progress(samples done)`` is called per chunk.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    stream_sizes = np.asarray(doc_sizes, dtype=np.int64)[doc_idx]
    ends = np.cumsum(stream_sizes)
    starts = ends - stream_sizes
    out = np.zeros((num_samples + 1, 2), dtype=np.int32 if len(doc_idx) < np.iinfo(np.int32).max else np.int64)
    # Chunked so scratch memory stays small whatever the sample count.
    for lo in range(1, num_samples + 1, _SAMPLE_IDX_CHUNK):
        pos = np.arange(lo, min(lo + _SAMPLE_IDX_CHUNK, num_samples + 1), dtype=np.int64) * seq_length
        which = np.searchsorted(ends, pos, side="right")
        out[lo:lo + pos.size, 0] = which
        out[lo:lo + pos.size, 1] = pos - starts[which]
        if progress is not None:
            progress(lo + pos.size - 1)
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
# The token ids of a corpus, checked at start-up at a bounded cost
# ----------------------------------------------------------------------------------------------
def token_id_range(indexed_dataset, data_prefix: str, cache_dir: str | None = None,
                   vocab_size: int | None = None) -> tuple:
    """``(min_token_id, max_token_id)`` of the tokens checked at start-up, at a cost bounded whatever the corpus
    size (``MMapIndexedDataset.token_range``).

    Non-integer values are refused; with ``vocab_size``, ids outside ``[0, vocab_size)`` raise a UsageError.
    Nothing is written; ``cache_dir`` is accepted and unused.
    """
    if isinstance(indexed_dataset, MMapIndexedDataset):
        if indexed_dataset.dtype.kind not in "iu":
            raise UsageError(f"{data_prefix}.idx says its tokens are {indexed_dataset.dtype.name}: token ids are "
                             f"integers, so its dtype byte is wrong or it is not a token corpus; re-run "
                             f"tools/preprocess_data.py for this prefix")
        lo, hi, _ = indexed_dataset.token_range()
    else:
        lo, hi = _scan_token_range(indexed_dataset)
    if vocab_size is not None:
        check_id_range(data_prefix, lo, hi, vocab_size)
    return lo, hi


def check_id_range(data_prefix: str, lo, hi, vocab_size: int) -> None:
    """Refuse token ids ``lo..hi`` of ``data_prefix`` outside ``[0, vocab_size)`` in one line."""
    if hi is not None and (hi >= vocab_size or lo < 0):
        raise UsageError(
            f"{data_prefix} holds token id {hi if hi >= vocab_size else lo}, outside the model's vocabulary of "
            f"{vocab_size}: preprocess it with this model's tokenizer (tools/preprocess_data.py) or fix vocab_size")


def _scan_token_range(ds) -> tuple:
    """``(min, max)`` token id of any indexed dataset (``sizes`` and contiguous slices), reading every token;
    ``(None, None)`` when it holds no tokens."""
    sizes, step = np.asarray(ds.sizes, dtype=np.int64), 1 << 14
    chunks = (np.concatenate(ds[a:a + step]) for a in range(0, len(sizes), step))
    bounds = [f(chunk) for chunk in chunks if chunk.size for f in (np.min, np.max)]
    return (int(min(bounds)), int(max(bounds))) if bounds else (None, None)


# ----------------------------------------------------------------------------------------------
# The dataset
# ----------------------------------------------------------------------------------------------
class GPTDataset(torch.utils.data.Dataset):
    """Megatron's GPT dataset over the ``documents`` of one split of an ``MMapIndexedDataset``.

    ``dataset[i]`` is ``{"input_ids", "labels"}``, two ``LongTensor[seq_length]``: the ``seq_length + 1``
    tokens of sample ``shuffle_idx[i]`` as ``tokens[:-1]`` and ``tokens[1:]``. ``len(dataset)`` covers whole
    epochs, so it is at least ``num_samples``. ``min_token_id`` / ``max_token_id`` come from
    ``token_id_range``, for ``check_token_ids``. A document of several sequences reads as their concatenation.
    """

    def __init__(self, name: str, indexed_dataset, documents, num_samples: int, seq_length: int,
                 seed: int, data_prefix: str, cache_dir: str | None = None):
        if int(seq_length) < 1:
            raise UsageError(f"seq_length must be >= 1, got {seq_length}")
        if int(num_samples) < 0:
            raise UsageError(f"num_samples must be >= 0, got {num_samples}")
        self.name, self.indexed_dataset, self.data_prefix = str(name), indexed_dataset, str(data_prefix)
        self.num_samples, self.seq_length, self.seed = int(num_samples), int(seq_length), int(seed)
        self.cache_dir = cache_dir
        num_documents = indexed_dataset.num_documents
        documents = np.ascontiguousarray(documents, dtype=np.int64)
        if documents.ndim != 1 or documents.size == 0:
            raise UsageError(f"{self.data_prefix}: the {self.name} split has no documents")
        if documents.min() < 0 or documents.max() >= num_documents:
            raise UsageError(f"{self.data_prefix}: {self.name} documents must lie in "
                             f"[0, {num_documents}), got [{documents.min()}, {documents.max()}]")
        self.documents = documents
        self.tokens_per_epoch = int(indexed_dataset.document_sizes()[documents].sum(dtype=np.int64))
        if self.tokens_per_epoch == 0:
            raise UsageError(f"{self.data_prefix}: the {self.name} split's {documents.size} documents "
                             f"hold no tokens; check the corpus or the splits string")
        self.num_epochs = num_epochs_needed(self.tokens_per_epoch, self.seq_length, self.num_samples)
        self.separate_last_epoch = separate_last_epoch(self.tokens_per_epoch, self.seq_length,
                                                       self.num_samples, self.num_epochs)
        stem = index_stem(self.data_prefix, cache_dir, self.name, self.num_samples, self.seq_length, self.seed)
        self.index_paths = {kind: f"{stem}_{kind}_idx.npy" for kind in _INDEX_KINDS} | {"desc": f"{stem}_desc.json"}
        self._checked = None  # (files_state, problem) of the last cache check
        if not self._cache_valid():
            # Every rank, before rank 0 builds: arrays the machine cannot hold are one line, not numpy's error.
            check_index_budget(self.name, self.data_prefix, self.num_samples, self.seq_length, self.tokens_per_epoch,
                               int(documents.size), self.num_epochs, self.index_paths["sample"])
        _build_on_rank0(self._cache_valid, self._build_indices, self.index_paths["sample"], self._open_indices)
        self.min_token_id, self.max_token_id = token_id_range(indexed_dataset, self.data_prefix)

    # -- index files -------------------------------------------------------------------------
    def _description(self) -> dict:
        # Everything the arrays depend on beyond the file name: a changed split or corpus under
        # the same name must not reuse old indices.
        return {
            "format": _INDEX_FORMAT, "num_samples": self.num_samples, "seq_length": self.seq_length,
            "seed": self.seed, "num_documents_in_dataset": self.indexed_dataset.num_documents,
            "documents_count": int(self.documents.size),
            "documents_md5": hashlib.md5(self.documents.tobytes()).hexdigest(),
            "tokens_per_epoch": self.tokens_per_epoch, "num_epochs": self.num_epochs,
            "separate_last_epoch": self.separate_last_epoch,
        }

    def _cache_valid(self) -> bool:
        return self._cache_problem() is None

    def _cache_problem(self) -> str | None:
        """Why the cached arrays cannot be used (None when they can); checked again only when the files change."""
        state = files_state(self.index_paths.values())
        if self._checked is None or self._checked[0] != state:
            self._checked = (state, self._find_cache_problem())
        return self._checked[1]

    def _find_cache_problem(self) -> str | None:
        """Checks the cache against this split: its description, then each array's shape, dtype and range
        of values, then the checksums written with the arrays.

        Without a description the files came from elsewhere (e.g. Megatron-LM itself, which uses the
        same names): they are accepted when their shapes and ranges fit this split.
        """
        paths = self.index_paths
        desc = _load_json(paths["desc"])
        checksums = desc.pop("checksums", None) if isinstance(desc, dict) else None
        if desc is not None and desc != self._description():
            return f"{paths['desc']} describes other data or parameters"
        if desc is None and os.path.exists(paths["desc"]):
            return f"{paths['desc']} is unreadable"
        total = (self.num_epochs * self.tokens_per_epoch - 1) // self.seq_length
        shapes = {"doc": (self.num_epochs * self.documents.size,), "sample": (total + 1, 2), "shuffle": (total,)}
        arrays = {}
        for kind, shape in shapes.items():
            if not os.path.exists(paths[kind]):
                return f"{paths[kind]} is missing"
            try:
                arrays[kind] = _load_npy(paths[kind])
            except (OSError, ValueError) as e:
                return f"{paths[kind]} is unreadable ({e})"
            if arrays[kind].shape != shape:
                return f"{paths[kind]} has shape {arrays[kind].shape}, expected {shape}"
            if arrays[kind].dtype.kind not in "iu":
                return f"{paths[kind]} holds {arrays[kind].dtype} values, not indices"
        longest = int(self.indexed_dataset.document_sizes()[self.documents].max())
        # (array, what, lowest, highest allowed): the values Megatron's construction can give for this split.
        ranges = ((arrays["doc"], "document", int(self.documents.min()), int(self.documents.max())),
                  (arrays["sample"][:, 0], "position in the document index", 0, shapes["doc"][0] - 1),
                  (arrays["sample"][:, 1], "token offset", 0, longest - 1),
                  (arrays["shuffle"], "sample", 0, total - 1))
        for (array, what, lo, hi), kind in zip(ranges, ("doc", "sample", "sample", "shuffle")):
            low, high = int(array.min()), int(array.max())
            if low < lo or high > hi:
                return (f"{paths[kind]} holds {what} {high if high > hi else low}, outside [{lo}, {hi}] for this "
                        f"split")
        if arrays["sample"][0].tolist() != [0, 0]:
            return f"{paths['sample']} does not start at the first token of the split's stream"
        if checksums is None:
            # Files from elsewhere: a doc_idx of another seed beside this sample_idx keeps every range and
            # would fail only inside a DataLoader worker, at the first sample that straddles documents.
            sizes = np.asarray(self.indexed_dataset.document_sizes(), dtype=np.int64)[arrays["doc"]]
            starts = np.concatenate(([0], np.cumsum(sizes[:-1])))
            steps = np.diff(starts[arrays["sample"][:, 0]] + arrays["sample"][:, 1])
            wrong = np.flatnonzero(steps != self.seq_length)
            if wrong.size:
                return (f"{paths['sample']} does not fit {paths['doc']}: sample {int(wrong[0])} spans "
                        f"{int(steps[wrong[0]])} tokens of its documents, not {self.seq_length} (files of "
                        f"another seed or split)")
        if checksums is not None:
            for kind, array in arrays.items():
                if not isinstance(checksums, dict) or checksums.get(kind) != array_checksum(array):
                    return f"{paths[kind]} does not match the checksum written with it (changed since it was built)"
        return None

    def _build_indices(self) -> None:
        try:
            self._write_indices()
        except OSError as e:  # a read-only or full cache directory; the atomic writes left no part behind
            raise cache_write_error(os.path.dirname(self.index_paths["sample"]) or ".", e) from e

    def _write_indices(self) -> None:
        paths = self.index_paths
        problem = self._cache_problem()
        if any(os.path.exists(path) for path in paths.values()):
            # A truncated or stale cache is rebuilt, not loaded; say so, since it costs time.
            logger.warning(f"rebuilding the {self.name} indices of {self.data_prefix}: {problem}")
        # Old files go first: a build interrupted half-way must leave files missing (and so be
        # rebuilt), never a mix of old and new arrays that happen to have the right shapes.
        for path in paths.values():
            if os.path.exists(path):
                os.remove(path)
        start = time.perf_counter()
        rng = np.random.RandomState(seed=self.seed)
        doc_idx = build_doc_idx(self.documents, self.num_epochs, rng, self.separate_last_epoch)
        total = (self.num_epochs * self.tokens_per_epoch - 1) // self.seq_length
        sample_idx = build_sample_idx(self.indexed_dataset.document_sizes(), doc_idx, self.seq_length,
                                      self.num_epochs, self.tokens_per_epoch,
                                      Progress(f"building the {self.name} sample index of {self.data_prefix}", total))
        total = sample_idx.shape[0] - 1
        first = ((self.num_epochs - 1) * self.tokens_per_epoch - 1) // self.seq_length
        shuffle_idx = build_shuffle_idx(first if self.separate_last_epoch else total, total, rng)
        arrays = dict(zip(_INDEX_KINDS, (doc_idx, sample_idx, shuffle_idx)))
        for kind, array in arrays.items():
            _atomic_write(paths[kind], array)
        checksums = {kind: array_checksum(array) for kind, array in arrays.items()}
        _atomic_write(paths["desc"], {**self._description(), "checksums": checksums})
        logger.info(f"built {self.name} indices for {self.data_prefix}: {total} samples of "
                    f"{self.seq_length} tokens over {self.num_epochs} epoch(s) "
                    f"(separate last epoch: {self.separate_last_epoch}) in {time.perf_counter() - start:.2f}s")

    def _open_indices(self) -> None:
        self.doc_idx, self.sample_idx, self.shuffle_idx = (_load_npy(self.index_paths[k]) for k in _INDEX_KINDS)

    # -- pickling for DataLoader workers started with "spawn" ----------------------------------
    def __getstate__(self):
        # Memory maps would be pickled as full in-memory copies; reopen them by path instead.
        state = {k: v for k, v in self.__dict__.items() if k not in ("doc_idx", "sample_idx", "shuffle_idx")}
        state["indexed_dataset"] = self.indexed_dataset.path_prefix
        docs = self.documents
        if docs[-1] - docs[0] + 1 == docs.size and (np.diff(docs) == 1).all():
            state["documents"] = (int(docs[0]), int(docs[-1]) + 1)  # a split is a range
        return state

    def __setstate__(self, state):
        if isinstance(state["documents"], tuple):
            state["documents"] = np.arange(*state["documents"], dtype=np.int64)
        self.__dict__.update(state, indexed_dataset=MMapIndexedDataset(state["indexed_dataset"]))
        self._open_indices()

    # -- samples -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.shuffle_idx.shape[0])

    def get_tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` token ids of sample ``idx`` as int64."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        i = int(self.shuffle_idx[idx])
        (doc_f, off_f), (doc_l, off_l) = self.sample_idx[i].tolist(), self.sample_idx[i + 1].tolist()
        read = self.indexed_dataset.get_document
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
    """Raise a UsageError (a ValueError) when ``dataset`` (a GPTDataset or a blend) holds ids outside the vocabulary.

    Ids beyond the embedding table would otherwise fail deep inside the model.
    """
    for ds in getattr(dataset, "datasets", None) or [dataset]:
        hi, lo = getattr(ds, "max_token_id", None), getattr(ds, "min_token_id", None)
        if hi is not None:
            check_id_range(ds.data_prefix, lo if lo is not None else 0, hi, vocab_size)
