"""Corpora in common formats, read as the JSON lines ``tools/preprocess_data.py`` tokenises.

Every reader yields chunks of JSON-line bytes, so any format gives the same ``.bin/.idx`` as its
JSON-lines equivalent. Formats: JSON lines (plain, ``.gz`` or ``.zst``); plain text, one document per
line or blank-line-separated (``--text-docs``); Parquet and a ``datasets`` ``save_to_disk`` folder
(the ``--json-keys`` columns); a fairseq ``data-bin``, mapped back to text through ``dict.txt``.
Formats are told apart by content (magic bytes); a reader whose package is absent is refused in one
line naming the install.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import struct
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["CorpusError", "Corpus", "open_corpus", "TEXT_DOCS", "read_fairseq_data_bin"]

TEXT_DOCS = ("line", "blank-line")
CHUNK_LINES = 256
CHUNK_BYTES = 1 << 20
_GZIP, _ZSTD, _PARQUET = b"\x1f\x8b", b"\x28\xb5\x2f\xfd", b"PAR1"
_TEXT_SUFFIXES = (".txt", ".text")
_MMAP_MAGIC, _LEGACY_MAGIC = b"MMIDIDX\x00\x00", b"TNTIDX\x00\x00"
# fairseq's and Megatron's index dtype codes.
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float64, 8: np.uint16}
# fairseq's Dictionary puts these four before dict.txt's symbols.
_FAIRSEQ_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]


class CorpusError(Exception):
    """An input the user can fix; the message is one line naming it and the fix."""


@dataclass
class Corpus:
    """A readable corpus: ``chunks()`` yields ``(first record number, [JSON-line bytes] or a block of whole JSON
    lines)``; ``size`` is the bytes
    the progress bar counts (None when unknown); ``kind`` names the format for messages."""

    kind: str
    chunks: Callable[[], Iterator[Tuple[int, List[bytes]]]]
    size: Optional[int] = None


def _need(module: str, package: str, what: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise CorpusError(f"{what} needs {package}, which is not installed; pip install {package} "
                          f"(or pip install 'libai_lite[corpora]')") from None


def _chunked(records: Iterator[bytes]) -> Iterator[Tuple[int, List[bytes]]]:
    lines, size, first = [], 0, 1
    for number, line in enumerate(records, start=1):
        if not lines:
            first = number
        lines.append(line)
        size += len(line)
        if len(lines) >= CHUNK_LINES or size >= CHUNK_BYTES:
            yield first, lines
            lines, size = [], 0
    if lines:
        yield first, lines


def _blocks(stream, path: str, magic: bytes) -> Iterator[Tuple[int, bytes]]:
    """``(first line number, block)``: about ``CHUNK_BYTES`` of whole lines at a time, read without a
    Python step per line; a truncated or damaged compressed file ends in one CorpusError."""
    first = 1
    while True:
        try:
            block = stream.read(CHUNK_BYTES)
            if block and not block.endswith(b"\n"):
                block += stream.readline()
        except Exception as e:  # noqa: BLE001 - gzip, zlib and zstandard each raise their own types
            if not magic.startswith((_GZIP, _ZSTD)):
                raise
            what = "gzip" if magic.startswith(_GZIP) else "zstd"
            reason = " ".join(str(e).split()) or type(e).__name__
            raise CorpusError(f"{path} is a damaged {what} file: decompressing stopped after line {first - 1} "
                              f"({reason}); download or compress it again") from None
        if not block:
            return
        yield first, block
        first += block.count(b"\n")


def _record(key: str, text) -> bytes:
    return json.dumps({key: text}, ensure_ascii=False).encode("utf-8") + b"\n"


def _binary_stream(path: str, magic: bytes):
    """The decompressed byte stream of ``path`` (gzip or zstd by magic, else the file)."""
    if magic.startswith(_GZIP):
        return gzip.open(path, "rb")
    if magic.startswith(_ZSTD):
        zstd = _need("zstandard", "zstandard", f"{path} (zstd-compressed)")
        return io.BufferedReader(zstd.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _lines(stream, path: str, magic: bytes) -> Iterator[bytes]:
    """The lines of ``_binary_stream``; a truncated or damaged compressed file ends in one CorpusError."""
    if not magic.startswith((_GZIP, _ZSTD)):
        yield from stream
        return
    lines, number = iter(stream), 0
    while True:
        try:
            line = next(lines)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - gzip, zlib and zstandard each raise their own types
            what = "gzip" if magic.startswith(_GZIP) else "zstd"
            reason = " ".join(str(e).split()) or type(e).__name__
            raise CorpusError(f"{path} is a damaged {what} file: decompressing stopped after line {number} "
                              f"({reason}); download or compress it again") from None
        number += 1
        yield line


def _text_documents(stream, name: str, mode: str) -> Iterator[str]:
    doc: List[str] = []
    for number, raw in enumerate(stream, start=1):
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError:
            raise CorpusError(f"{name} line {number} is not UTF-8 text; re-encode the file as UTF-8") from None
        if mode == "line":
            if line.strip():
                yield line
        elif line.strip():
            doc.append(line)
        elif doc:
            yield "\n".join(doc)
            doc = []
    if doc:
        yield "\n".join(doc)


def _looks_like_json_lines(path: str, magic: bytes) -> bool:
    with _binary_stream(path, magic) as f:
        for raw in _lines(f, path, magic):
            if raw.strip():
                return raw.lstrip().startswith(b"{")
    return True


def _inner_name(path: str) -> str:
    for suffix in (".gz", ".zst", ".zstd"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def _parquet(path: str, keys: Sequence[str]) -> Corpus:
    pq = _need("pyarrow.parquet", "pyarrow", f"{path} (Parquet)")
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors have many types; one line says which file
        raise CorpusError(f"{path} is not a readable Parquet file ({' '.join(str(e).split())}); check the file")
    missing = [k for k in keys if k not in pf.schema_arrow.names]
    if missing:
        raise CorpusError(f"{path} has no column {', '.join(map(repr, missing))}; pass --json-keys with the text "
                          f"columns (it has: {', '.join(pf.schema_arrow.names)})")

    def rows():
        for batch in pf.iter_batches(columns=list(keys), batch_size=1024):
            columns = [batch.column(k).to_pylist() for k in keys]
            for values in zip(*columns):
                yield json.dumps(dict(zip(keys, values)), ensure_ascii=False).encode("utf-8") + b"\n"

    return Corpus("Parquet", lambda: _chunked(rows()), None)


def _hf_dataset(path: str, keys: Sequence[str]) -> Corpus:
    datasets = _need("datasets", "datasets", f"{path} (a Hugging Face datasets folder)")
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001
        raise CorpusError(f"{path} is not a datasets folder written by save_to_disk ({' '.join(str(e).split())})")
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise CorpusError(f"{path} holds the splits {', '.join(ds)}; pass --input {path}/<split> for one of them")
        ds = next(iter(ds.values()))
    missing = [k for k in keys if k not in ds.column_names]
    if missing:
        raise CorpusError(f"{path} has no column {', '.join(map(repr, missing))}; pass --json-keys with the text "
                          f"columns (it has: {', '.join(ds.column_names)})")

    def rows():
        for batch in ds.select_columns(list(keys)).iter(batch_size=1024):
            for values in zip(*(batch[k] for k in keys)):
                yield json.dumps(dict(zip(keys, values)), ensure_ascii=False).encode("utf-8") + b"\n"

    return Corpus("Hugging Face datasets folder", lambda: _chunked(rows()), None)


def _fairseq_prefix(path: str) -> Optional[str]:
    """``DIR/train`` for a fairseq data-bin ``DIR`` (or the prefix ``DIR/valid`` itself), else None."""
    if os.path.isdir(path):
        return os.path.join(path, "train") if os.path.isfile(os.path.join(path, "dict.txt")) else None
    base = path[:-4] if path.endswith((".idx", ".bin")) else path
    folder = os.path.dirname(base) or "."
    if os.path.isfile(base + ".idx") and os.path.isfile(os.path.join(folder, "dict.txt")):
        return base
    return None


def read_fairseq_data_bin(prefix: str) -> Tuple[List[str], Iterator[np.ndarray]]:
    """(the dictionary's symbols by id, the items of ``prefix.bin``) of a fairseq ``fairseq-preprocess`` output."""
    folder = os.path.dirname(prefix) or "."
    if not os.path.isfile(prefix + ".idx"):
        raise CorpusError(f"{folder} is a fairseq data-bin without {os.path.basename(prefix)}.idx; pass --input "
                          f"{folder}/<split> for a split it has")
    with open(os.path.join(folder, "dict.txt"), encoding="utf-8") as f:
        symbols = _FAIRSEQ_SPECIALS + [line.rstrip("\n").rsplit(" ", 1)[0] for line in f if line.strip()]
    with open(prefix + ".idx", "rb") as f:
        header = f.read(9)
        if header.startswith(_LEGACY_MAGIC[:8]):
            raise CorpusError(f"{prefix}.idx is fairseq's legacy (cached/lazy) index; re-binarize with "
                              f"fairseq-preprocess --dataset-impl mmap, or pass the raw text with --text-docs")
        if header != _MMAP_MAGIC:
            raise CorpusError(f"{prefix}.idx is not a fairseq mmap index (magic {header!r})")
        version, code, count = struct.unpack("<QBQ", f.read(17))
        sizes = np.frombuffer(f.read(4 * count), dtype=np.int32)
        pointers = np.frombuffer(f.read(8 * count), dtype=np.int64)
    if code not in _DTYPES or len(sizes) != count or len(pointers) != count:
        raise CorpusError(f"{prefix}.idx is truncated or of an unknown dtype code {code}; re-binarize it")
    data = np.memmap(prefix + ".bin", dtype=_DTYPES[code], mode="r")
    itemsize = np.dtype(_DTYPES[code]).itemsize

    def items():
        for size, pointer in zip(sizes, pointers):
            start = int(pointer) // itemsize
            yield np.asarray(data[start:start + int(size)])

    return symbols, items()


def _fairseq(prefix: str, keys: Sequence[str], gpt2_decode: Optional[Callable[[List[int]], str]]) -> Corpus:
    symbols, _ = read_fairseq_data_bin(prefix)  # refuses a bad index now, not in the middle of the run
    specials = set(range(len(_FAIRSEQ_SPECIALS)))
    numeric = all(s.isdigit() for s in symbols[len(_FAIRSEQ_SPECIALS):len(_FAIRSEQ_SPECIALS) + 100])
    if numeric and gpt2_decode is None:
        raise CorpusError(f"{prefix}: its dict.txt holds GPT-2 BPE ids (fairseq's RoBERTa/GPT-2 data); pass "
                          f"--tokenizer-type GPT2BPETokenizer with the GPT-2 --vocab-file and --merge-file it used")

    def text(item) -> str:
        words = [symbols[i] for i in item.tolist() if i not in specials]
        if numeric:
            return gpt2_decode([int(w) for w in words])
        return " ".join(words).replace("@@ ", "").removesuffix("@@")

    def records():
        for item in read_fairseq_data_bin(prefix)[1]:
            yield _record(keys[0], text(item))

    return Corpus("fairseq data-bin", lambda: _chunked(records()), None)


def open_corpus(path: str, keys: Sequence[str], text_docs: Optional[str] = None,
                gpt2_decode: Optional[Callable[[List[int]], str]] = None) -> Corpus:
    """The corpus at ``path`` (a file, a ``datasets`` folder or a fairseq data-bin) as JSON-line chunks.

    ``text_docs`` (``line``/``blank-line``) reads a file as plain text whatever its name; ``gpt2_decode``
    turns GPT-2 BPE ids back into text (a fairseq data-bin of GPT-2 ids needs it).
    """
    if text_docs is not None and text_docs not in TEXT_DOCS:
        raise CorpusError(f"--text-docs {text_docs!r}: use one of {', '.join(TEXT_DOCS)}")
    prefix = _fairseq_prefix(path)
    if prefix is not None:
        return _fairseq(prefix, keys, gpt2_decode)
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if names & {"dataset_info.json", "state.json", "dataset_dict.json"}:
            return _hf_dataset(path, keys)
        raise CorpusError(f"input {path} is a directory but neither a Hugging Face datasets folder (save_to_disk: "
                          f"state.json, *.arrow) nor a fairseq data-bin (dict.txt); pass a corpus file")
    if not os.path.isfile(path):
        raise CorpusError(f"input file {path} does not exist; pass --input pointing at the corpus")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == _PARQUET:
        return _parquet(path, keys)
    size = os.path.getsize(path)
    inner = _inner_name(path)
    mode = text_docs or ("line" if inner.endswith(_TEXT_SUFFIXES) else None)
    if mode is None and not inner.endswith((".jsonl", ".json", ".ndjson")) and not _looks_like_json_lines(path, magic):
        raise CorpusError(f"{path} is neither JSON lines nor a known format; for plain text pass --text-docs line "
                          f"(a document per line) or --text-docs blank-line (documents between blank lines)")
    if mode is not None and len(keys) != 1:
        raise CorpusError(f"plain text has one field: pass one --json-keys (it names the output files), "
                          f"not {len(keys)}")
    compressed = magic.startswith((_GZIP, _ZSTD))
    kind = ("compressed " if compressed else "") + ("text" if mode else "JSON lines")

    def chunks():
        with _binary_stream(path, magic) as stream:
            if mode is None:
                yield from _blocks(stream, path, magic)
            else:
                lines = _lines(stream, path, magic)
                yield from _chunked(_record(keys[0], doc) for doc in _text_documents(lines, path, mode))

    _binary_stream(path, magic).close()  # a missing decompressor is refused before any output is opened
    return Corpus(kind, chunks, size if not compressed and mode is None else None)
