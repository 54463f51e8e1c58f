"""Megatron-LM's mmap indexed dataset (`.bin` + `.idx`), read and written byte for byte.

Layout of `<prefix>.idx` (version 1, little endian):
    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code of the token ids in `.bin`
    uint64    sequence count
    uint64    document count (length of the document index, i.e. documents + 1)
    int32[]   sequence lengths (tokens)
    int64[]   sequence byte offsets into `.bin`
    int64[]   document index: sequence number where each document starts, plus the end
`<prefix>.bin` is the concatenation of all sequences' token ids.
"""
from __future__ import annotations

import os
import struct
from typing import Iterable, Sequence

import numpy as np

from ..utils.errors import UsageError

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")

# Megatron's dtype codes; the code is what lands in the file, so the table must not change.
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


class IndexedDatasetError(UsageError):
    """A `.bin/.idx` pair is missing, truncated or not in Megatron's mmap format."""


def _code(dtype) -> int:
    dtype = np.dtype(dtype)
    for code, candidate in DTYPES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise ValueError(f"dtype {dtype} has no code in Megatron's indexed-dataset format")


def best_fitting_dtype(vocab_size: int | None = None):
    """uint16 when every id fits (Megatron's threshold), int32 otherwise."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


class MMapIndexedDataset:
    """Reads Megatron-LM's mmap `.bin/.idx` files without loading them into memory."""

    def __init__(self, path_prefix: str, skip_warmup: bool = True):
        self.path_prefix = str(path_prefix)
        idx_path, bin_path = index_file_path(self.path_prefix), data_file_path(self.path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(
                    f"data file {path} not found: check the data prefix (paths are relative to the "
                    f"current directory) or create it with tools/preprocess_data.py"
                )
        self._read_index(idx_path)
        expected = 0
        if len(self.sizes):
            expected = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize
        actual = os.path.getsize(bin_path)
        if actual < expected:
            raise IndexedDatasetError(
                f"{bin_path} is truncated ({actual} bytes, its index needs {expected}): "
                f"re-run tools/preprocess_data.py for this prefix"
            )
        if actual == 0:
            self._bin = np.zeros(0, dtype=self.dtype)
        else:
            # A plain ndarray view of the map: slicing a np.memmap builds a memmap subclass object per
            # sample, which halves the loader's samples/s (bench/data_loader.py).
            self._bin = np.asarray(np.memmap(bin_path, dtype=self.dtype, mode="r"))
        if not skip_warmup:
            # Touch every page once so the first epoch is not dominated by page faults.
            np.sum(self._bin[:: max(1, 4096 // self.dtype.itemsize)])

    def _read_index(self, idx_path: str) -> None:
        size = os.path.getsize(idx_path)
        if size < _HEADER.size:
            raise IndexedDatasetError(
                f"{idx_path} is truncated ({size} bytes, shorter than the header): "
                f"re-run tools/preprocess_data.py for this prefix"
            )
        with open(idx_path, "rb") as f:
            magic, version, code, n_seq, n_doc = _HEADER.unpack(f.read(_HEADER.size))
        if magic != _MAGIC:
            raise IndexedDatasetError(
                f"{idx_path} is not a Megatron mmap index (magic {magic!r}, expected {_MAGIC!r}): "
                f"preprocess with tools/preprocess_data.py (Megatron's --dataset-impl mmap)"
            )
        if version != _VERSION:
            raise IndexedDatasetError(
                f"{idx_path} has index version {version}; only version {_VERSION} is supported: "
                f"re-run tools/preprocess_data.py"
            )
        if code not in DTYPES:
            raise IndexedDatasetError(f"{idx_path} has unknown dtype code {code}: the file is corrupt")
        self.dtype = np.dtype(DTYPES[code])
        need = _HEADER.size + n_seq * 4 + n_seq * 8 + n_doc * 8
        if size < need:
            raise IndexedDatasetError(
                f"{idx_path} is truncated ({size} bytes, {need} expected for {n_seq} sequences): "
                f"re-run tools/preprocess_data.py for this prefix"
            )
        buf = np.memmap(idx_path, dtype=np.uint8, mode="r")
        off = _HEADER.size
        self.sizes = np.frombuffer(buf, dtype=np.int32, count=n_seq, offset=off)
        off += n_seq * 4
        self.pointers = np.frombuffer(buf, dtype=np.int64, count=n_seq, offset=off)
        off += n_seq * 8
        self.doc_idx = np.frombuffer(buf, dtype=np.int64, count=n_doc, offset=off)
        self._idx_buf = buf

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return max(len(self.doc_idx) - 1, 0)

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self.get(int(idx))
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices into an indexed dataset must be contiguous")
            if start >= stop:
                return []
            total = int(self.sizes[start:stop].sum())
            flat = self._tokens(int(self.pointers[start]) // self.dtype.itemsize, total)
            return np.split(flat, np.cumsum(self.sizes[start:stop])[:-1])
        raise TypeError(f"indexed dataset indices must be int or slice, not {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `idx` (the whole sequence by default)."""
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences")
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        start = int(self.pointers[idx]) // self.dtype.itemsize + offset
        return self._tokens(start, length)

    def _tokens(self, start: int, count: int) -> np.ndarray:
        return np.asarray(self._bin[start : start + count])

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(index_file_path(path_prefix)) and os.path.isfile(data_file_path(path_prefix))


class MMapIndexedDatasetBuilder:
    """Writes Megatron's format under temporary names; `finalize` makes it visible.

    The `.bin` is renamed first and the `.idx` last, so a reader (which needs both) never
    sees a dataset whose writer was interrupted.
    """

    def __init__(self, out_prefix: str, dtype=np.uint16):
        self.out_prefix = str(out_prefix)
        self.dtype = np.dtype(dtype)
        _code(self.dtype)
        self._bin_tmp = data_file_path(self.out_prefix) + ".tmp"
        self._idx_tmp = index_file_path(self.out_prefix) + ".tmp"
        os.makedirs(os.path.dirname(os.path.abspath(self.out_prefix)), exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._sizes.append(arr.size)

    def end_document(self) -> None:
        """Close the current document (its sequences are those added since the last call)."""
        self._doc_idx.append(len(self._sizes))

    def add_doc(self, tokens: Sequence[int] | np.ndarray, lengths: Iterable[int]) -> None:
        """Append one document made of consecutive sequences of the given lengths."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._sizes.extend(int(n) for n in lengths)
        self._doc_idx.append(len(self._sizes))

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.asarray(self._doc_idx, dtype=np.int64)
        with open(self._idx_tmp, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, _VERSION, _code(self.dtype), len(sizes), len(doc_idx)))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())
        # An older dataset at this prefix loses its .idx first, so a crash between the two
        # renames can never pair the new .bin with the old index.
        if os.path.exists(index_file_path(self.out_prefix)):
            os.remove(index_file_path(self.out_prefix))
        os.replace(self._bin_tmp, data_file_path(self.out_prefix))
        os.replace(self._idx_tmp, index_file_path(self.out_prefix))

    def abort(self) -> None:
        """Drop everything written so far."""
        if not self._bin.closed:
            self._bin.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.remove(path)
