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

import numpy as np

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


def _space_pieces(text: str) -> list:
    """``text.split(" ")``, its first piece marked with U+FFFF: pre-tokenised as it stands, the others after a space."""
    pieces = text.split(" ")
    pieces[0] = "\uffff" + pieces[0]
    return pieces


class WordCache:
    """Encodes texts with a ``tokenizers.Tokenizer`` through a per-pre-token id cache.

    ``split`` is a ``re`` pattern (or a function returning one) that must split a normalised text
    as ``tok.pre_tokenizer`` does, ``ascii_split`` one for ASCII-only texts (both are checked). At most
    ``max_words`` pre-tokens are kept; past that the cache starts afresh, which bounds memory on
    corpora with unbounded vocabularies and keeps the frequent words hot. ``units`` (``"space"`` for GPT-2,
    ``"whitespace"`` for BERT; see ``_units_of``) lets ``encode_batch_bytes`` cache whole ``str.split`` pieces.
    """

    def __init__(self, tok, split, ascii_split: Optional[str] = None, units: Optional[str] = None,
                 max_words: int = 1 << 18):
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
        self._units = units if units is None or self._ascii_ok else None
        if units == "whitespace" and not self._whitespace_separates(ascii_chars):
            self._units = None
        self._bytes_dtype = None
        self._bytes: Dict[str, bytes] = {}
        self._word_bytes: Dict[str, bytes] = {}
        self._raw_bytes: Dict[str, bytes] = {}
        # Texts past the fast path's characters check agree with the library on every character's class,
        # so Python's Unicode \s is the library's whitespace there.
        self._unicode_ws_units = re.compile(r"\s*\S+|\s+").findall
        # A whitespace run with a space past its first character (before its last, or anywhere at the end).
        self._inner_space_runs = re.compile(rf"[{_WS}]+ (?:[{_WS}]+|\Z)").finditer
        self._unicode_inner_space_runs = re.compile(r"\s+ (?:\s+|\Z)").finditer

    def _whitespace_separates(self, ascii_chars) -> bool:
        """Whether ``str.split()`` cuts normalised ASCII text where the ASCII split drops a separator
        (BERT: whitespace separates words and is dropped), so a piece is split alone exactly as in its text."""
        norm = self._normalizer.normalize_str if self._normalizer is not None else (lambda t: t)
        for c in ascii_chars:
            n = norm(c)
            if not n:
                continue
            dropped = self._ascii_findall(f"a{n}a") == ["a", "a"] and not self._ascii_findall(n)
            if dropped != n.isspace():
                return False
        return True

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

    def _units_of(self, norm: str, ascii_text: bool):
        """``(pieces, cache, raw)``: ``norm`` cut into pieces each pre-tokenised alone exactly as in the text.

        GPT-2 (``space``): the pre-tokenizer starts a token at each space, except inside a whitespace run ``W``
        past its first character: ``\\s+(?!\\S)`` takes ``W[:-1]`` as one token (all of ``W`` at the text's
        end) and ``W[-1:]`` starts the next. So each piece of ``str.split(" ")`` after the first is pre-tokenised
        as ``" " + piece``, and a run with a space inside is a piece ``W[:-1]`` of its own, the text after it cut
        the same way from ``W[-1:]`` on (no regex state crosses a token boundary, and no pre-token spans from a
        word into the whitespace after it). A piece marked with U+FFFF is pre-tokenised as it stands; a text
        holding U+FFFF itself is cut before each whitespace run (``raw``). BERT (``whitespace``): whitespace
        only separates and is dropped. Both hold for any text whose characters passed the class check.
        """
        if self._units == "whitespace":
            return norm.split(), self._bytes, False
        if ascii_text:
            # Such a space touches other whitespace: the substring tests rule most texts out cheaply.
            runs = (self._inner_space_runs(norm)
                    if ("  " in norm or " \n" in norm or "\n " in norm or " \t" in norm or "\t " in norm
                        or " \r" in norm or "\r " in norm or " \x0b" in norm or "\x0b " in norm
                        or " \x0c" in norm or "\x0c " in norm) else ())
        elif "\uffff" in norm:
            return self._unicode_ws_units(norm), self._raw_bytes, True
        else:
            runs = self._unicode_inner_space_runs(norm)
        pieces, pos = [], 0
        for run in runs:
            start, end = run.span()
            if start > pos:
                pieces += _space_pieces(norm[pos:start])
            pos = end if end == len(norm) else end - 1
            pieces.append("\uffff" + norm[start:pos])
        if pos < len(norm) or not pieces:
            pieces += _space_pieces(norm[pos:])
        return pieces, self._bytes, False

    def _unit_bytes(self, unit: str, raw: bool) -> bytes:
        if self._units == "space" and not raw:
            unit = unit[1:] if unit[:1] == "\uffff" else " " + unit
        return self._ids_bytes(self._ascii_findall(unit) if unit.isascii() else self._findall(unit))

    def _ids_bytes(self, words) -> bytes:
        cache = self._word_bytes
        try:
            return b"".join(map(cache.__getitem__, words))
        except KeyError:
            if len(cache) >= self._max_words:
                cache.clear()
            for w in words:
                if w not in cache:
                    cache[w] = np.array(self._word_ids(w), dtype=self._bytes_dtype).tobytes()
            return b"".join(map(cache.__getitem__, words))

    def encode_batch_bytes(self, texts: Sequence[str], dtype) -> List[bytes]:
        """Ids of each text as the raw bytes of a ``dtype`` array (what a ``.bin`` file holds), equal to
        ``encode_batch``'s; distinct pieces are encoded once and joined as bytes, with no per-id Python work."""
        dtype = np.dtype(dtype)
        if dtype != self._bytes_dtype:
            self._bytes_dtype, self._bytes, self._raw_bytes, self._word_bytes = dtype, {}, {}, {}
        out, slow = [], []
        for text in texts:
            norm = self._normalized(text)
            ascii_text = norm.isascii()
            if not (self._ascii_ok if ascii_text else self._fast_path_ok(norm)):
                slow.append(len(out))
                out.append(text)
                continue
            if self._units is None or not (ascii_text or self._units == "space"):
                out.append(self._ids_bytes(self._ascii_findall(norm) if ascii_text else self._findall(norm)))
                continue
            units, cache, raw = self._units_of(norm, ascii_text)
            try:
                out.append(b"".join(map(cache.__getitem__, units)))
            except KeyError:
                if len(cache) >= self._max_words:
                    cache.clear()
                for u in units:
                    if u not in cache:
                        cache[u] = self._unit_bytes(u, raw)
                out.append(b"".join(map(cache.__getitem__, units)))
        if slow:
            encoded = self._tok.encode_batch_fast([out[i] for i in slow], add_special_tokens=False)
            for i, e in zip(slow, encoded):
                out[i] = np.array(e.ids, dtype=dtype).tobytes()
        return out

    def _normalized(self, text: str) -> str:
        """``text`` through the tokenizer's normalizer (an ASCII text through the cheaper equivalent one)."""
        if self._normalizer is None:
            return text
        if self._ascii_normalize is not None and text.isascii():
            return self._ascii_normalize(text)
        return self._normalizer.normalize_str(text)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Ids of each text, equal to ``tok.encode_batch(texts, add_special_tokens=False)``'s."""
        cache, out, slow = self._cache, [], []
        for text in texts:
            norm = self._normalized(text)
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
