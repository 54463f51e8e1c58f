"""A fairseq ``data-bin`` trained on as it is: its ``dict.txt`` as the tokenizer, its ids unchanged.

fairseq-train's ``language_modeling`` task trains on the dictionary's ids (``<s> <pad> </s> <unk>``, then
``dict.txt``'s symbols) and its model's vocabulary is that dictionary, whatever made the symbols (words,
BPE pieces, GPT-2 ids). Re-tokenising the text with another tokenizer would train another vocabulary on
another token stream, so the split's ``.bin/.idx`` are read in place with their ids as they are (one document
per fairseq item, each ending in ``</s>``), and nothing is written beside them.
"""
from __future__ import annotations

import os
from typing import Iterable, List, Optional, Tuple

from libai_lite.tokenizer.base import BaseTokenizer, to_id_list
from libai_lite.utils.errors import UsageError

__all__ = ["FairseqDictionary", "prepare_split"]

_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
_FAIRSEQ_MAGIC = b"MMIDIDX\x00\x00"


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


def prepare_split(data_dir: str, split: str = "train") -> str:
    """``split`` of the data-bin ``data_dir`` as the ``.bin/.idx`` prefix this project's loader reads in place
    (``MMapIndexedDataset`` reads fairseq's index: one document per item); nothing is written."""
    problem = check_data_bin(data_dir, split)
    if problem:
        raise UsageError(f"fairseq data-bin {data_dir} {problem}")
    return os.path.join(data_dir, split)
