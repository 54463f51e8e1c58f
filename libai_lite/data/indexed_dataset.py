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
import secrets
import struct
from typing import Iterable, Sequence

import numpy as np

from ..utils.errors import UsageError

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")

# Megatron's dtype codes; the code is what lands in the file, so the table must not change.
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
_CODES = {np.dtype(t): code for code, t in DTYPES.items()}
_RERUN = "re-run tools/preprocess_data.py for this prefix"
# Sequences checked per numpy call at open: bounded scratch memory for corpora of any size.
_CHECK_CHUNK = 1 << 22


class IndexedDatasetError(UsageError):
    """A `.bin/.idx` pair is missing, truncated or not in Megatron's mmap format."""


def best_fitting_dtype(vocab_size: int | None = None):
    """uint16 when every id fits (Megatron's threshold), int32 otherwise."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


class MMapIndexedDataset:
    """Reads Megatron-LM's mmap `.bin/.idx` files without loading them into memory."""

    def __init__(self, path_prefix: str):
        self.path_prefix = str(path_prefix)
        idx_path, bin_path = self.path_prefix + ".idx", self.path_prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"data file {path} not found: check the data prefix (paths are relative "
                                          f"to the current directory) or create it with tools/preprocess_data.py")
        self._read_index(idx_path)
        actual = os.path.getsize(bin_path)
        self._check_index(idx_path, bin_path, actual)
        # A plain ndarray view of the map: slicing a np.memmap builds a memmap subclass object per
        # sample, which halves the loader's samples/s (bench/data_loader.py). An empty file cannot be mapped.
        self._bin = np.asarray(np.memmap(bin_path, dtype=self.dtype, mode="r")) if actual else np.zeros(0, self.dtype)

    def _read_index(self, idx_path: str) -> None:
        size = os.path.getsize(idx_path)
        if size < _HEADER.size:
            raise IndexedDatasetError(f"{idx_path} is truncated ({size} bytes, shorter than the header): {_RERUN}")
        with open(idx_path, "rb") as f:
            magic, version, code, n_seq, n_doc = _HEADER.unpack(f.read(_HEADER.size))
        if magic != _MAGIC:
            raise IndexedDatasetError(f"{idx_path} is not a Megatron mmap index (magic {magic!r}, expected "
                                      f"{_MAGIC!r}): preprocess with tools/preprocess_data.py (Megatron's "
                                      f"--dataset-impl mmap)")
        if version != _VERSION:
            raise IndexedDatasetError(f"{idx_path} has index version {version}; only version {_VERSION} is "
                                      f"supported: re-run tools/preprocess_data.py")
        if code not in DTYPES:
            raise IndexedDatasetError(f"{idx_path} has unknown dtype code {code}: the file is corrupt")
        self.dtype = np.dtype(DTYPES[code])
        need = _HEADER.size + n_seq * 12 + n_doc * 8
        folder = os.path.dirname(idx_path) or "."
        if size == _HEADER.size - 8 + n_seq * 12 and os.path.isfile(os.path.join(folder, "dict.txt")):
            # fairseq-preprocess's mmap index: Megatron's header without the document count and index.
            raise IndexedDatasetError(
                f"{idx_path} is a fairseq data-bin index (dict.txt beside it, no document index); convert it: "
                f"python tools/preprocess_data.py --input {folder} --output-prefix PREFIX --tokenizer-type ... "
                f"--append-eod (docs/migrating.md)")
        if size < need:
            raise IndexedDatasetError(f"{idx_path} is truncated ({size} bytes, {need} expected for {n_seq} "
                                      f"sequences): {_RERUN}")
        buf = np.memmap(idx_path, dtype=np.uint8, mode="r")
        self.sizes = np.frombuffer(buf, dtype=np.int32, count=n_seq, offset=_HEADER.size)
        self.pointers = np.frombuffer(buf, dtype=np.int64, count=n_seq, offset=_HEADER.size + n_seq * 4)
        self.doc_idx = np.frombuffer(buf, dtype=np.int64, count=n_doc, offset=_HEADER.size + n_seq * 12)

    def _check_index(self, idx_path: str, bin_path: str, bin_bytes: int) -> None:
        """Refuse an index that does not describe its ``.bin``, at start and in O(sequences).

        Found here, a corrupt index costs one line; found by the loader, it fails hours into a
        run at whichever sample first reads past the data.
        """
        n, item = len(self.sizes), self.dtype.itemsize
        expected = int(self.pointers[-1]) + int(self.sizes[-1]) * item if n else 0
        if bin_bytes < expected:
            raise IndexedDatasetError(f"{bin_path} is truncated ({bin_bytes} bytes, its index needs {expected}): "
                                      f"{_RERUN}")
        for lo in range(0, n, _CHECK_CHUNK):
            sizes = self.sizes[lo:lo + _CHECK_CHUNK].astype(np.int64)
            pointers = self.pointers[lo:lo + _CHECK_CHUNK]
            bad = np.flatnonzero((sizes < 0) | (pointers < 0) | (pointers % item != 0)
                                 | (pointers + sizes * item > bin_bytes))
            if bad.size:
                i = lo + int(bad[0])
                raise IndexedDatasetError(
                    f"{idx_path} is corrupt: sequence {i} (size {int(self.sizes[i])}, byte offset "
                    f"{int(self.pointers[i])}) lies outside {bin_path} ({bin_bytes} bytes): {_RERUN}")
        doc = self.doc_idx
        if len(doc) and (doc[0] != 0 or doc[-1] != n or (len(doc) > 1 and (np.diff(doc) < 0).any())):
            raise IndexedDatasetError(f"{idx_path} is corrupt: its document index is not an increasing list of "
                                      f"sequence numbers from 0 to {n}: {_RERUN}")

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return max(len(self.doc_idx) - 1, 0)

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self.get(int(idx))
        if not isinstance(idx, slice):
            raise TypeError(f"indexed dataset indices must be int or slice, not {type(idx).__name__}")
        start, stop, step = idx.indices(len(self))
        if step != 1:
            raise ValueError("slices into an indexed dataset must be contiguous")
        if start >= stop:
            return []
        flat = self._tokens(self.pointers[start], int(self.sizes[start:stop].sum()))
        return np.split(flat, np.cumsum(self.sizes[start:stop])[:-1])

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence `idx` (the whole sequence by default)."""
        idx = idx + len(self) if idx < 0 else idx
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences")
        return self._tokens(self.pointers[idx], int(self.sizes[idx]) - offset if length is None else length, offset)

    def _tokens(self, pointer, count: int, offset: int = 0) -> np.ndarray:
        start = int(pointer) // self.dtype.itemsize + offset
        return self._bin[start:start + count]

    def document_sizes(self) -> np.ndarray:
        """Tokens per document: the sequence sizes themselves when each document is one sequence."""
        if len(self.doc_idx) == len(self.sizes) + 1 and np.array_equal(self.doc_idx, np.arange(len(self.doc_idx))):
            return self.sizes
        ends = np.concatenate(([0], np.cumsum(self.sizes, dtype=np.int64)))
        return ends[self.doc_idx[1:]] - ends[self.doc_idx[:-1]]

    def get_document(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of document `doc`, whatever sequences it is made of.

        Megatron writes a document's sequences back to back, so they are one run of the `.bin`.
        """
        first, end = int(self.doc_idx[doc]), int(self.doc_idx[doc + 1])
        if length is None:
            length = int(self.sizes[first:end].sum()) - offset
        return self._tokens(self.pointers[first], length, offset) if first < end else self._bin[:0]

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(path_prefix + ".idx") and os.path.isfile(path_prefix + ".bin")


class MMapIndexedDatasetBuilder:
    """Writes Megatron's format under temporary names; `finalize` makes it visible.

    The `.bin` is renamed first and the `.idx` last, so a reader (which needs both) never
    sees a dataset whose writer was interrupted. The temporary names carry the process id and
    a random part: two writers of one prefix never share (and steal) each other's files.
    """

    def __init__(self, out_prefix: str, dtype=np.uint16):
        self.out_prefix = str(out_prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODES:
            raise ValueError(f"dtype {self.dtype} has no code in Megatron's indexed-dataset format")
        tag = f".tmp.{os.getpid()}.{secrets.token_hex(4)}"
        self._bin_tmp, self._idx_tmp = self.out_prefix + ".bin" + tag, self.out_prefix + ".idx" + tag
        os.makedirs(os.path.dirname(os.path.abspath(self.out_prefix)), exist_ok=True)
        # "x": a name that somehow exists is never overwritten.
        self._bin = open(self._bin_tmp, "xb")
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence."""
        self.add_doc(tokens, None)

    def end_document(self) -> None:
        """Close the current document (its sequences are those added since the last call)."""
        self._doc_idx.append(len(self._sizes))

    def add_doc(self, tokens: Sequence[int] | np.ndarray, lengths: Iterable[int] | None) -> None:
        """Append one document made of consecutive sequences of the given lengths (None: one open sequence)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        if lengths is None:
            self._sizes.append(arr.size)
        else:
            self._sizes.extend(int(n) for n in lengths)
            self.end_document()

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.asarray(self._doc_idx, dtype=np.int64)
        with open(self._idx_tmp, "xb") as f:
            f.write(_HEADER.pack(_MAGIC, _VERSION, _CODES[self.dtype], len(sizes), len(doc_idx)))
            for array in (sizes, pointers, doc_idx):
                f.write(array.tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())
        # An older dataset at this prefix loses its .idx first, so a crash between the two
        # renames can never pair the new .bin with the old index.
        try:
            os.remove(self.out_prefix + ".idx")
        except FileNotFoundError:  # none yet, or a concurrent writer of this prefix removed it first
            pass
        os.replace(self._bin_tmp, self.out_prefix + ".bin")
        os.replace(self._idx_tmp, self.out_prefix + ".idx")

    def abort(self) -> None:
        """Drop everything written so far (safe after a failed write or finalize, even on a full disk)."""
        try:
            self._bin.close()
        except OSError:  # the buffered tail cannot be flushed (disk full): the file goes anyway
            pass
        for path in (self._bin_tmp, self._idx_tmp):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
