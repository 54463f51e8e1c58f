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
from array import array
import struct
from typing import Iterable, Sequence

import numpy as np

from ..utils.errors import UsageError
from .tokenizer_record import record_bytes, record_path

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")

# Megatron's dtype codes; the code is what lands in the file, so the table must not change.
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
_CODES = {np.dtype(t): code for code, t in DTYPES.items()}
_RERUN = "re-run tools/preprocess_data.py for this prefix"
# Sequences checked per numpy call at open: bounded scratch memory for corpora of any size.
_CHECK_CHUNK = 1 << 22
# Bytes of the .bin whose token ids are read at start-up (all of a smaller .bin), in this many runs.
SAMPLE_BYTES = 16 << 20
SAMPLE_RUNS = 64


class IndexedDatasetError(UsageError):
    """A `.bin/.idx` pair is missing, truncated or not in Megatron's mmap format."""


_WIDTHS = {np.dtype(t).itemsize for t in DTYPES.values()}


def _bytes(n: int) -> str:
    return f"{n} byte" + ("s" if n != 1 else "")


def _arrays(idx_path: str, n_seq: int, n_doc: int) -> tuple:
    """``(sizes, pointers, doc_idx)`` of an index whose header counts are ``n_seq`` and ``n_doc`` (memory-mapped)."""
    buf = np.memmap(idx_path, dtype=np.uint8, mode="r")
    sizes = np.frombuffer(buf, dtype=np.int32, count=n_seq, offset=_HEADER.size)
    pointers = np.frombuffer(buf, dtype=np.int64, count=n_seq, offset=_HEADER.size + n_seq * 4)
    doc_idx = np.frombuffer(buf, dtype=np.int64, count=n_doc, offset=_HEADER.size + n_seq * 12)
    return sizes, pointers, doc_idx


def _consistent(idx_path: str, n_seq: int, n_doc: int, item: int) -> bool:
    """Whether the file read with these counts looks like Megatron's arrays (their first and last entries)."""
    sizes, pointers, doc_idx = _arrays(idx_path, n_seq, n_doc)
    if not n_doc or doc_idx[0] != 0 or doc_idx[-1] != n_seq or (n_seq and pointers[0] != 0):
        return False
    return n_seq < 2 or int(pointers[1]) == int(sizes[0]) * item


def _count_error(idx_path: str, size: int, n_seq: int, n_doc: int, item: int) -> IndexedDatasetError:
    """The error for an index whose size disagrees with its header: a corrupt count when the file reads
    consistently with another value of it, else a truncated file or bytes after the arrays."""
    body = size - _HEADER.size
    for what, other, per, rest in (("sequence count", n_seq, 12, body - 8 * n_doc),
                                   ("document count", n_doc, 8, body - 12 * n_seq)):
        fits = rest // per if rest >= 0 and rest % per == 0 else None
        if fits is not None and fits != other and _consistent(
                idx_path, *((fits, n_doc) if per == 12 else (n_seq, fits)), item):
            return IndexedDatasetError(f"{idx_path} is corrupt: the {what} in its header is {other}, but the file "
                                       f"holds {fits} (its size and arrays agree on that): {_RERUN}")
    need = _HEADER.size + n_seq * 12 + n_doc * 8
    if size < need:
        return IndexedDatasetError(f"{idx_path} is truncated ({size} bytes, {need} expected for {n_seq} "
                                   f"sequences): {_RERUN}")
    return IndexedDatasetError(f"{idx_path} has {size - need} bytes after the arrays its header describes ({need} "
                               f"expected for {n_seq} sequences and {n_doc} document index entries): it is corrupt "
                               f"or not a plain Megatron index; {_RERUN}")


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
        # A plain ndarray view: slicing a np.memmap builds a costly subclass object per sample.
        # An empty file cannot be mapped.
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
            # fairseq-preprocess's mmap index: Megatron's header without the document count and index. Each item
            # (a line, ending in </s>) is a document, as fairseq's language_modeling task reads the stream.
            buf = np.memmap(idx_path, dtype=np.uint8, mode="r")
            self.sizes = np.frombuffer(buf, dtype=np.int32, count=n_seq, offset=_HEADER.size - 8)
            self.pointers = np.frombuffer(buf, dtype=np.int64, count=n_seq, offset=_HEADER.size - 8 + n_seq * 4)
            self.doc_idx = np.arange(n_seq + 1, dtype=np.int64)
            return
        if size != need:
            raise _count_error(idx_path, size, n_seq, n_doc, self.dtype.itemsize)
        self.sizes, self.pointers, self.doc_idx = _arrays(idx_path, n_seq, n_doc)

    def _check_index(self, idx_path: str, bin_path: str, bin_bytes: int) -> None:
        """Refuse, at open and in O(sequences), an index that does not describe its ``.bin`` exactly.

        The pointers must step by each size times the dtype's width and the ``.bin`` hold exactly the counted
        tokens; otherwise the loader would train on wrong tokens or fail hours into a run.
        """
        n, item = len(self.sizes), self.dtype.itemsize
        tokens = 0
        for lo in range(0, n, _CHECK_CHUNK):
            sizes = self.sizes[lo:lo + _CHECK_CHUNK]
            bad = np.flatnonzero(sizes < 0)
            if bad.size:
                i = lo + int(bad[0])
                raise IndexedDatasetError(f"{idx_path} is corrupt: sequence {i} has size {int(self.sizes[i])}: "
                                          f"{_RERUN}")
            tokens += int(sizes.sum(dtype=np.int64))
        before_last = tokens - int(self.sizes[-1]) if n else 0
        if before_last > 0 and int(self.pointers[0]) == 0:
            # Pointers stepping by another width than the dtype byte says, with a .bin of that width:
            # the dtype byte is what is wrong (a uint16 corpus read as uint8 would train on bytes).
            stride, rest = divmod(int(self.pointers[-1]), before_last)
            if not rest and stride != item and stride in _WIDTHS and bin_bytes == tokens * stride:
                raise self._dtype_error(idx_path, bin_path, stride, tokens)
        end = 0
        for lo in range(0, n, _CHECK_CHUNK):
            steps = self.sizes[lo:lo + _CHECK_CHUNK].astype(np.int64) * item
            pointers = self.pointers[lo:lo + _CHECK_CHUNK]
            starts = np.cumsum(steps) - steps + end
            bad = np.flatnonzero(pointers != starts)
            if bad.size:
                i, at = lo + int(bad[0]), int(starts[bad[0]])
                size, pointer = int(self.sizes[i]), int(self.pointers[i])
                if pointer < 0 or pointer + size * item > bin_bytes:
                    raise IndexedDatasetError(
                        f"{idx_path} is corrupt: sequence {i} (size {size}, byte offset {pointer}) lies outside "
                        f"{bin_path} ({bin_bytes} bytes): {_RERUN}")
                after = (f"sequence {i - 1} (size {int(self.sizes[i - 1])}) ends at byte {at}" if i
                         else "the first sequence starts at byte 0")
                raise IndexedDatasetError(
                    f"{idx_path} is corrupt: sequence {i} starts at byte {pointer} of {bin_path}, but {after} "
                    f"(Megatron writes the sequences back to back, so a size or an offset was changed): {_RERUN}")
            end = int(starts[-1] + steps[-1]) if steps.size else end
        expected = tokens * item
        if bin_bytes < expected:
            raise IndexedDatasetError(f"{bin_path} is truncated ({bin_bytes} bytes, its index needs {expected}): "
                                      f"{_RERUN}")
        if bin_bytes > expected:
            if tokens and bin_bytes % tokens == 0 and bin_bytes // tokens in _WIDTHS:
                raise self._dtype_error(idx_path, bin_path, bin_bytes // tokens, tokens)
            raise IndexedDatasetError(
                f"{bin_path} has {bin_bytes - expected} bytes more than {idx_path} describes ({bin_bytes} bytes, "
                f"{expected} for its {tokens} {self.dtype.name} tokens): the two files are not from the same "
                f"preprocessing run, or bytes were appended; {_RERUN}")
        doc = self.doc_idx
        unordered = any((np.diff(doc[lo:lo + _CHECK_CHUNK + 1]) < 0).any() for lo in range(0, len(doc), _CHECK_CHUNK))
        if (n and not len(doc)) or (len(doc) and (doc[0] != 0 or doc[-1] != n or unordered)):
            raise IndexedDatasetError(f"{idx_path} is corrupt: its document index is not an increasing list of "
                                      f"sequence numbers from 0 to {n}: {_RERUN}")

    def _dtype_error(self, idx_path: str, bin_path: str, width: int, tokens: int) -> IndexedDatasetError:
        return IndexedDatasetError(
            f"{idx_path} says its tokens are {self.dtype.name} ({_bytes(self.dtype.itemsize)} each), but {bin_path} "
            f"holds {_bytes(width)} for each of its {tokens} tokens: the dtype byte of the index is wrong (or the "
            f"files are from different runs); {_RERUN}")

    def token_range(self, max_bytes: int | None = None, runs: int | None = None) -> tuple:
        """``(min, max, exact)`` token id over at most ``max_bytes`` of the ``.bin``, or ``(None, None, True)``
        without tokens.

        A larger ``.bin`` is read as ``runs`` evenly spaced runs, first and last tokens included, so the cost is
        bounded and every region is represented; ``exact`` says whether every token was read.
        """
        max_bytes = int(SAMPLE_BYTES if max_bytes is None else max_bytes)
        runs = max(int(SAMPLE_RUNS if runs is None else runs), 1)
        key = (max_bytes, runs)
        if getattr(self, "_token_range", (None,))[0] != key:
            flat = self._bin
            per_run = max(max_bytes // self.dtype.itemsize // runs, 1)
            if flat.size <= per_run * runs:
                parts, exact = [flat], True
            else:
                starts = np.linspace(0, flat.size - per_run, runs).astype(np.int64)
                parts, exact = [flat[a:a + per_run] for a in starts], False
            bounds = [f(part) for part in parts if part.size for f in (np.min, np.max)]
            lo, hi = (int(min(bounds)), int(max(bounds))) if bounds else (None, None)
            self._token_range = (key, (lo, hi, exact))
        return self._token_range[1]

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
        if getattr(self, "_document_sizes", None) is None:  # asked by each split and check: computed once
            if len(self.doc_idx) == len(self.sizes) + 1 and np.array_equal(self.doc_idx, np.arange(len(self.doc_idx))):
                self._document_sizes = self.sizes
            else:
                ends = np.concatenate(([0], np.cumsum(self.sizes, dtype=np.int64)))
                self._document_sizes = ends[self.doc_idx[1:]] - ends[self.doc_idx[:-1]]
                self._document_sizes.flags.writeable = False
        return self._document_sizes

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

    The `.bin` is renamed first and the `.idx` last, so a reader never sees an interrupted write. Temporary
    names carry the pid and a random part, so two writers of one prefix never take each other's files.
    A `record` (tokenizer_record.make_record) is written beside them as `PREFIX.tokenizer.json`, renamed
    after the `.idx`; an older one at the prefix goes before the new `.bin` comes, so no crash leaves a record
    beside data it does not describe.
    """

    def __init__(self, out_prefix: str, dtype=np.uint16, record: dict | None = None):
        self.out_prefix = str(out_prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODES:
            raise ValueError(f"dtype {self.dtype} has no code in Megatron's indexed-dataset format")
        tag = f".tmp.{os.getpid()}.{secrets.token_hex(4)}"
        self._bin_tmp, self._idx_tmp = self.out_prefix + ".bin" + tag, self.out_prefix + ".idx" + tag
        self._record, self._record_tmp = record, record_path(self.out_prefix) + tag
        os.makedirs(os.path.dirname(os.path.abspath(self.out_prefix)), exist_ok=True)
        # "x": a name that somehow exists is never overwritten.
        self._bin = open(self._bin_tmp, "xb")
        # Typed arrays, not lists: 4 and 8 bytes per entry keep a huge corpus's index in memory small.
        self._sizes = array("i")
        self._doc_idx = array("q", [0])

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

    def add_docs(self, data: bytes, sizes: np.ndarray, seqs_per_doc: np.ndarray) -> None:
        """Append many documents at once: ``data`` is their tokens' bytes in this builder's dtype, ``sizes`` the
        length of each sequence, ``seqs_per_doc`` how many of those sequences each document has (0: empty)."""
        sizes = np.asarray(sizes, dtype=np.int32)
        seqs = np.asarray(seqs_per_doc, dtype=np.int64)
        if int(sizes.sum(dtype=np.int64)) * self.dtype.itemsize != len(data) or int(seqs.sum()) != sizes.size:
            raise ValueError("add_docs: the sizes do not add up to the data and the documents' sequence counts")
        self._bin.write(data)
        base = len(self._sizes)
        self._sizes.frombytes(sizes.astype(self._sizes.typecode, copy=False).tobytes())
        self._doc_idx.frombytes((base + np.cumsum(seqs)).astype(np.int64).tobytes())

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
        if self._record is not None:
            with open(self._record_tmp, "xb") as f:
                f.write(record_bytes(self._record))
                f.flush()
                os.fsync(f.fileno())
        try:
            os.remove(record_path(self.out_prefix))
        except FileNotFoundError:
            pass
        # An older dataset at this prefix loses its .idx first, so a crash between the two
        # renames can never pair the new .bin with the old index.
        try:
            os.remove(self.out_prefix + ".idx")
        except FileNotFoundError:  # none yet, or a concurrent writer of this prefix removed it first
            pass
        os.replace(self._bin_tmp, self.out_prefix + ".bin")
        os.replace(self._idx_tmp, self.out_prefix + ".idx")
        if self._record is not None:
            os.replace(self._record_tmp, record_path(self.out_prefix))

    def abort(self) -> None:
        """Drop everything written so far (safe after a failed write or finalize, even on a full disk)."""
        try:
            self._bin.close()
        except OSError:  # the buffered tail cannot be flushed (disk full): the file goes anyway
            pass
        for path in (self._bin_tmp, self._idx_tmp, self._record_tmp):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
