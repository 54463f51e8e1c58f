"""A fairseq ``data-bin`` trained on as it is: its ``dict.txt`` as the tokenizer, its ids unchanged.

fairseq-train's ``language_modeling`` task trains on the dictionary's ids (``<s> <pad> </s> <unk>``, then
``dict.txt``'s symbols) and its model's vocabulary is that dictionary, whatever made the symbols (words,
BPE pieces, GPT-2 ids). Re-tokenising the text with another tokenizer would train another vocabulary on
another token stream, so the split's ``.bin`` is read with its ids as they are: :func:`prepare_split`
writes, under ``DATA/libai_lite/``, the Megatron index the loader reads (one document per fairseq item, each
ending in ``</s>``) beside a link to the same ``.bin``, and the tokenizer record that ties it to
:class:`FairseqDictionary`, so another run's tokenizer is refused on it.
"""
from __future__ import annotations

import os
import struct
from typing import Iterable, List, Optional, Tuple

import numpy as np

from libai_lite.data.tokenizer_record import make_record, record_bytes, record_path
from libai_lite.tokenizer.base import BaseTokenizer, to_id_list
from libai_lite.utils.errors import UsageError

__all__ = ["FairseqDictionary", "prepare_split", "converted_prefix"]

_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
_FAIRSEQ_MAGIC = b"MMIDIDX\x00\x00"
# fairseq's and Megatron's dtype codes are the same table, so the .bin is read in place.
_WIDTH = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}


class FairseqDictionary(BaseTokenizer):
    """fairseq's ``Dictionary`` from a ``dict.txt``: ids 0-3 are ``<s> <pad> </s> <unk>``, then one symbol a
    line (``symbol count``); text is split on whitespace, as fairseq-preprocess's default tokenizer does."""

    bos_token_id, pad_token_id, eos_token_id, unk_token_id = 0, 1, 2, 3
    eod_id = 2  # fairseq-preprocess ends every item with </s>

    def __init__(self, dict_file: str):
        self.dict_file = os.fspath(dict_file)
        try:
            with open(self.dict_file, encoding="utf-8") as f:
                lines = [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise UsageError(f"fairseq dictionary {self.dict_file} cannot be read ({e.strerror}); pass "
                             f"fairseq-preprocess's --destdir, which holds dict.txt") from None
        # "symbol count [#fairseq:overwrite]": the symbol is everything before the count.
        self.symbols = _SPECIALS + [line.replace(" #fairseq:overwrite", "").rsplit(" ", 1)[0] for line in lines]
        self.indices = {s: i for i, s in reversed(list(enumerate(self.symbols)))}
        self.vocab_size = len(self.symbols)

    # The record names the file as the other tokenizers' vocab_file.
    @property
    def vocab_file(self) -> str:
        return self.dict_file

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return [self.indices.get(w, self.unk_token_id) for w in text.split()]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        words = [self.symbols[i] for i in to_id_list(ids) if 0 <= i < self.vocab_size]
        if skip_special_tokens:
            words = [w for w in words if w not in _SPECIALS]
        return " ".join(words)

    def base_vocab(self) -> Iterable[Tuple[str, int]]:
        return ((s, i) for i, s in enumerate(self.symbols))


def converted_prefix(data_dir: str, split: str = "train") -> str:
    """Where :func:`prepare_split` puts ``split`` of ``data_dir`` as a ``.bin/.idx`` prefix."""
    return os.path.join(data_dir, "libai_lite", split)


def check_data_bin(data_dir: str, split: str = "train") -> Optional[str]:
    """Why ``data_dir`` is no fairseq data-bin with ``split``, as words that follow its name (None when it is one)."""
    if not os.path.isdir(data_dir):
        return "is not a directory: pass fairseq-preprocess's --destdir"
    if not os.path.isfile(os.path.join(data_dir, "dict.txt")):
        return "has no dict.txt: pass fairseq-preprocess's --destdir"
    for ext in (".bin", ".idx"):
        if not os.path.isfile(os.path.join(data_dir, split + ext)):
            return f"has no {split}{ext}: fairseq-preprocess --trainpref writes it (--dataset-impl mmap, its default)"
    with open(os.path.join(data_dir, split + ".idx"), "rb") as f:
        magic = f.read(9)
    if magic != _FAIRSEQ_MAGIC:
        return (f"has a {split}.idx that is not fairseq's mmap index (the legacy cached/lazy one?): re-binarize "
                f"with fairseq-preprocess --dataset-impl mmap")
    return None


def _megatron_index(idx_path: str, bin_bytes: int) -> bytes:
    """Megatron's index for fairseq's ``idx_path``: the same sizes and pointers, one document per item."""
    with open(idx_path, "rb") as f:
        head = f.read(9 + 17)
        version, code, count = struct.unpack("<QBQ", head[9:])
        sizes = np.frombuffer(f.read(4 * count), dtype=np.int32)
        pointers = np.frombuffer(f.read(8 * count), dtype=np.int64)
    if version != 1 or code not in _WIDTH or len(sizes) != count or len(pointers) != count:
        raise UsageError(f"{idx_path} is truncated or of an unknown version/dtype ({version}, {code}): re-binarize "
                         f"it with fairseq-preprocess")
    if int(sizes.sum(dtype=np.int64)) * _WIDTH[code] != bin_bytes:
        raise UsageError(f"{idx_path} does not describe its .bin ({bin_bytes} bytes): re-binarize it with "
                         f"fairseq-preprocess")
    header = struct.pack("<9sQBQQ", _FAIRSEQ_MAGIC, 1, code, count, count + 1)
    docs = np.arange(count + 1, dtype=np.int64)
    return header + sizes.tobytes() + pointers.tobytes() + docs.tobytes()


def _write_if_changed(path: str, data: bytes) -> None:
    """Write ``data`` atomically unless ``path`` holds it: every rank prepares the same files at once."""
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return
    except FileNotFoundError:
        pass
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def prepare_split(data_dir: str, split: str = "train") -> str:
    """``split`` of the data-bin ``data_dir`` as a ``.bin/.idx`` prefix this project's loader reads (written
    under ``data_dir/libai_lite`` once, the ``.bin`` linked, not copied); its prefix."""
    problem = check_data_bin(data_dir, split)
    if problem:
        raise UsageError(f"fairseq data-bin {data_dir} {problem}")
    source = os.path.join(data_dir, split)
    prefix = converted_prefix(data_dir, split)
    try:
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        index = _megatron_index(source + ".idx", os.path.getsize(source + ".bin"))
        if not os.path.exists(prefix + ".bin"):
            try:
                os.link(source + ".bin", f"{prefix}.bin.tmp{os.getpid()}")
            except OSError:  # another filesystem: a link by name
                os.symlink(os.path.abspath(source + ".bin"), f"{prefix}.bin.tmp{os.getpid()}")
            os.replace(f"{prefix}.bin.tmp{os.getpid()}", prefix + ".bin")
        _write_if_changed(prefix + ".idx", index)
        tokenizer = FairseqDictionary(os.path.join(data_dir, "dict.txt"))
        record = make_record(tokenizer, None, True, "compat.fairseq")
        _write_if_changed(record_path(prefix), record_bytes(record))
    except OSError as e:
        raise UsageError(f"cannot write the index of {source} under {os.path.dirname(prefix)} ({e.strerror}): make "
                         f"{data_dir} writable or copy the data-bin somewhere writable") from None
    return prefix
