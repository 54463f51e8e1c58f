"""Exact word-level caching for tokenizers that apply their model to each pre-token on its own.

GPT-2 byte-level BPE and BERT WordPiece encode every pre-token independently, so encoding each distinct
pre-token once and concatenating the cached ids gives the same ids as the full pipeline, far cheaper.
This holds only if our regex splits a text exactly as the tokenizer's pre-tokenizer does. Two Unicode
tables can disagree on a character's class, so each character is checked once against the real
pre-tokenizer; a text holding a character whose split differs is encoded by the tokenizer itself.
"""
from __future__ import annotations

import functools
import re
import unicodedata
from itertools import chain
from typing import Dict, List, Optional, Sequence

# GPT-2's ByteLevel split in the stdlib re: a letter is a word character that is not a digit or "_".
# Where Python's Unicode classes differ from the library's, the per-character check catches it.
GPT2_SPLIT = r"'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"


@functools.lru_cache(maxsize=None)
def bert_split() -> str:
    """tokenizers' BertPreTokenizer in the stdlib re: drop whitespace, isolate each punctuation
    character (ASCII or a Unicode P* category, read from this Python's tables)."""
    ranges, start = [], None
    # No punctuation is assigned above U+1FFFF; a character there is checked like any other.
    for code in range(0x20000):
        punct = unicodedata.category(chr(code)).startswith("P")
        if punct and start is None:
            start = code
        elif not punct and start is not None:
            ranges.append((start, code - 1))
            start = None
    punct = _ASCII_PUNCT + "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)
    return rf"[^\s{punct}]+|[{punct}]"


# The same splits for ASCII-only texts, spelt out (ASCII whitespace is these six characters).
_WS = r"\t\n\x0b\x0c\r "
GPT2_SPLIT_ASCII = (
    rf"'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"
)
_ASCII_PUNCT = r"!-/:-@\[-`{-~"
BERT_SPLIT_ASCII = rf"[^{_WS}{_ASCII_PUNCT}]+|[{_ASCII_PUNCT}]"

# Contexts that tell a character's class apart: it joins a letter run, a number run, a
# punctuation run or a whitespace run, or stands alone, depending on the class.
_PROBES = ("a{}a", "1{}1", "!{}!", " {} ", "{}", "a {}", "{}  a", "'{}")


class WordCache:
    """Encodes texts with a ``tokenizers.Tokenizer`` through a per-pre-token id cache.

    ``split`` is a ``re`` pattern (or a function returning one) that must split a normalised text
    as ``tok.pre_tokenizer`` does, ``ascii_split`` one for ASCII-only texts (both are checked). At most
    ``max_words`` pre-tokens are kept; past that the cache starts afresh, which bounds memory on
    corpora with unbounded vocabularies and keeps the frequent words hot.
    """

    def __init__(self, tok, split, ascii_split: Optional[str] = None, max_words: int = 1 << 18):
        self._tok = tok
        self._normalizer = tok.normalizer
        self._pre = tok.pre_tokenizer
        self._model = tok.model
        self._split = re.compile(split() if callable(split) else split)
        self._findall = self._split.findall
        self._max_words = max_words
        self._cache: Dict[str, List[int]] = {}
        self._good: set = set()
        self._bad: set = set()
        ascii_chars = [chr(i) for i in range(128)]
        self._check_chars(ascii_chars)
        # ASCII-only texts (most of a typical corpus) skip the per-character check, split by
        # ascii_split when it agrees with the library on every ASCII character.
        self._ascii_ok = not self._bad
        self._ascii_findall = self._findall
        if ascii_split is not None:
            fast = re.compile(ascii_split)
            if all(self._splits_agree(p.format(c), fast) for c in ascii_chars for p in _PROBES):
                self._ascii_findall, self._ascii_ok = fast.findall, True
        self._ascii_normalize = self._ascii_normalizer(ascii_chars)

    def _ascii_normalizer(self, ascii_chars):
        """A str-method equivalent of the normaliser on ASCII texts, or None.

        BERT's normaliser dominates the cached path's cost; on ASCII it only lowercases and drops or maps a few
        control characters, which ``str.lower`` and ``str.translate`` do far faster. The table is read off the
        real normaliser per character, then checked on whole strings.
        """
        if self._normalizer is None:
            return None
        norm = self._normalizer.normalize_str
        upper = "".join(chr(c) for c in range(ord("A"), ord("Z") + 1))
        lower = norm(upper) == upper.lower()
        table = {}
        for c in ascii_chars:
            base = c.lower() if lower else c
            out = norm(c)
            if out != base:
                table[ord(c)] = out or None

        def fast(text: str) -> str:
            return (text.lower() if lower else text).translate(table)

        everything = "".join(ascii_chars)
        checks = (everything, everything[::-1], "Hello,\tWorld!\r\n\x00[SEP] x\x0bY\x7f  Z.")
        return fast if all(fast(t) == norm(t) for t in checks) else None

    def _splits_agree(self, text: str, pattern=None) -> bool:
        ours = [m.span() for m in (pattern or self._split).finditer(text)]
        try:
            theirs = [offsets for _, offsets in self._pre.pre_tokenize_str(text)]
        except Exception:  # a character the library cannot take (lone surrogate): not ours to decide
            return False
        return ours == theirs

    def _check_chars(self, chars) -> None:
        for c in chars:
            ok = all(self._splits_agree(p.format(c)) for p in _PROBES)
            (self._good if ok else self._bad).add(c)

    def _fast_path_ok(self, text: str) -> bool:
        new = set(text) - self._good
        if not new:
            return True
        self._check_chars(new - self._bad)
        return not (new & self._bad)

    def _word_ids(self, word: str) -> List[int]:
        # The pipeline minus the normaliser (already applied to the whole text): the
        # pre-tokenizer finds the word itself as its one pre-token (byte-level mapped for GPT-2).
        return [t.id for piece, _ in self._pre.pre_tokenize_str(word) for t in self._model.tokenize(piece)]

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Ids of each text, equal to ``tok.encode_batch(texts, add_special_tokens=False)``'s."""
        cache, out, slow = self._cache, [], []
        normalize = self._normalizer.normalize_str if self._normalizer is not None else None
        for text in texts:
            if normalize is None:
                norm = text
            elif self._ascii_normalize is not None and text.isascii():
                norm = self._ascii_normalize(text)
            else:
                norm = normalize(text)
            ascii_text = norm.isascii()
            if not (self._ascii_ok if ascii_text else self._fast_path_ok(norm)):
                slow.append(len(out))
                out.append(text)
                continue
            words = self._ascii_findall(norm) if ascii_text else self._findall(norm)
            try:
                out.append(list(chain.from_iterable(map(cache.__getitem__, words))))
            except KeyError:
                if len(cache) >= self._max_words:
                    cache.clear()
                for w in words:
                    if w not in cache:
                        cache[w] = self._word_ids(w)
                out.append(list(chain.from_iterable(map(cache.__getitem__, words))))
        if slow:
            encoded = self._tok.encode_batch_fast([out[i] for i in slow], add_special_tokens=False)
            for i, e in zip(slow, encoded):
                out[i] = e.ids
        return out
