"""Tokenising a corpus's JSON lines, a chunk at a time, in ``tools/preprocess_data.py``'s worker processes.

Each worker builds its tokenizer (and sentence splitter) once in ``init_worker``; ``encode_chunk`` turns a
chunk of lines into token arrays with Megatron-LM's rules (its tokenize, sentence splitting and end-of-document
id), so the ``.bin/.idx`` written from them are byte-identical to Megatron's.
"""
from __future__ import annotations

import json
import os
import signal

import numpy as np

try:  # optional: parses a line several times faster than json; json explains a bad line
    import orjson
except ImportError:
    orjson = None

from ..tokenizer import build_tokenizer

__all__ = ["InputError", "build_sentence_splitter", "encode_chunk", "init_worker"]


class InputError(Exception):
    """Bad input the user can fix; the message is one line naming it and the fix."""


# Megatron splits texts in slices of this many characters, punkt being slow on huge strings.
SPLIT_SLICE_CHARS = 1_000_000


def build_sentence_splitter(lang: str = "english", keep_newlines: bool = False):
    """nltk's punkt sentence splitter for ``lang``, as Megatron-LM's ``--split-sentences`` uses it.

    Raises ``InputError`` (one line naming the install) when nltk or the punkt model is absent:
    the model is never downloaded here, since preprocessing machines often have no network.
    """
    try:
        from nltk.tokenize import punkt
    except ImportError:
        raise InputError(
            "--split-sentences needs nltk, which is not installed; pip install 'libai_lite[sentences]'"
        ) from None
    # nltk >= 3.8.2 reads the plain-text punkt_tab model; older releases the punkt pickle.
    if hasattr(punkt, "PunktTokenizer"):
        model, load = "punkt_tab", lambda: punkt.PunktTokenizer(lang)
    else:
        import nltk

        model, load = "punkt", lambda: nltk.data.load(f"tokenizers/punkt/{lang}.pickle")
    try:
        splitter = load()
    except (LookupError, ValueError, OSError):
        raise InputError(
            f"nltk's {model} model for --lang {lang} is not installed; "
            f"run: python -m nltk.downloader {model} (or pass another --lang)"
        ) from None
    if keep_newlines:

        class KeepNewlines(punkt.PunktLanguageVars):
            # A sentence end swallows the whitespace after it (newlines too) and the next
            # token follows directly: each sentence keeps its trailing whitespace, as in
            # Megatron's CustomLanguageVars.
            _period_context_fmt = r"""
                %(SentEndChars)s
                \s*
                (?=(?P<after_tok>
                    %(NonWord)s
                    |
                    (?P<next_tok>\S+)
                ))"""

        splitter = punkt.PunktSentenceTokenizer(train_text=splitter._params, lang_vars=KeepNewlines())
    return splitter


_WORKER = {}


def init_worker(tokenizer_kwargs: dict, keys, append_eod: bool, dtype, input_name: str, threads: bool,
                 splitter_args=None):
    """Build this process's tokenizer (and sentence splitter) once; workers run single-threaded backends."""
    if not threads:
        # Ctrl-C reaches the whole process group; the parent alone cleans up and
        # terminates the pool, so workers stay quiet instead of each printing a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = build_tokenizer(**tokenizer_kwargs)
    if not threads and hasattr(tokenizer, "num_threads"):
        tokenizer.num_threads = 1
    # One pass over a corpus repeats the same words endlessly: an exact per-word id cache
    # (GPT-2 BPE, WordPiece) beats re-running the tokenizer's model on every occurrence.
    if hasattr(tokenizer, "enable_word_cache"):
        tokenizer.enable_word_cache()
    splitter = build_sentence_splitter(*splitter_args) if splitter_args is not None else None
    _WORKER.update(
        tokenizer=tokenizer, keys=keys, append_eod=append_eod, dtype=np.dtype(dtype), input=input_name,
        splitter=splitter,
    )


def _split_sentences(text: str) -> list:
    splitter = _WORKER["splitter"]
    return [s for i in range(0, len(text), SPLIT_SLICE_CHARS)
            for s in splitter.tokenize(text[i:i + SPLIT_SLICE_CHARS])]


def _loads(line: bytes):
    if orjson is not None:
        try:
            return orjson.loads(line)
        except orjson.JSONDecodeError:
            # json accepts a little more (NaN, lone surrogates, huge integers) and words its errors well.
            pass
    return json.loads(line)


_SCAN = json.decoder.JSONDecoder().scan_once
_MISS = object()


def _scan_block(block: bytes) -> list:
    """The value of each line of a block of JSON lines, scanned by json's C scanner in one pass over the
    decoded block (no per-line json.loads); ``_MISS`` for a line it does not take whole (blank, bad, a BOM),
    which ``_load_line`` then reads on its own, to parse it or to word its error."""
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError:
        return [_MISS] * (block.count(b"\n") + (not block.endswith(b"\n")))
    out, pos, n, scan = [], 0, len(text), _SCAN
    while pos < n:
        nl = text.find("\n", pos)
        if nl < 0:
            nl = n
        try:
            value, end = scan(text, pos)
        except (StopIteration, ValueError, RecursionError):
            value, end = _MISS, nl
        # The value must end its line (JSON whitespace may follow): one value per line, as json.loads reads it.
        if end != nl and (end > nl or text[end:nl].strip(" \t\r")):
            value = _MISS
        out.append(value)
        pos = nl + 1
    return out


def _json_kind(value) -> str:
    """What a JSON value is, in JSON's words (a list says what it holds that is not a string)."""
    names = {bool: "a boolean", int: "a number", float: "a number", dict: "an object", type(None): "null",
             str: "a string", list: "a list"}
    if isinstance(value, list):
        other = [v for v in value if not isinstance(v, str)]
        return f"a list with {names.get(type(other[0]), 'a value')} in it" if other else "a list of strings"
    return names.get(type(value), type(value).__name__)


def _load_line(line: bytes, lineno: int):
    """The value of one JSON line (``_MISS`` for a blank line); a bad line is one ``InputError``."""
    if not line.strip():
        return _MISS
    try:
        return _loads(line)
    except UnicodeDecodeError:
        raise InputError(f"{_WORKER['input']} line {lineno} is not UTF-8 text; re-encode the file as UTF-8") from None
    except ValueError as e:
        reason = getattr(e, "msg", None) or str(e).splitlines()[0]
        col = getattr(e, "colno", None)
        # json's messages such as "Invalid control character at" expect a position after them.
        reason = reason[: -len(" at")] if reason.endswith(" at") else reason
        where = f" at column {col}" if col else ""
        raise InputError(
            f"{_WORKER['input']} line {lineno} is not valid JSON ({reason}{where}); fix or remove that line"
        ) from None


def _fields(data, lineno: int, surrogates: bool = False) -> list:
    """The per-key list of sentences in one parsed JSON line (``surrogates``: check for lone surrogates)."""
    name = _WORKER["input"]
    if not isinstance(data, dict):
        raise InputError(
            f"{name} line {lineno} holds {_json_kind(data)}, not an object; "
            'write one object per line, e.g. {"text": "..."}'
        )
    out = []
    for key in _WORKER["keys"]:
        if key not in data:
            raise InputError(
                f"{name} line {lineno} has no key {key!r}; pass --json-keys with the key that holds "
                f"the text (this line has: {', '.join(map(repr, data)) or 'no keys'})"
            )
        value = data[key]
        if isinstance(value, str):
            value = [value]
        elif not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise InputError(
                f"{name} line {lineno}: key {key!r} holds {_json_kind(value)}; it must be a string or a list of "
                "strings; fix or remove that line"
            )
        if surrogates:
            for v in value:
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise InputError(
                        f"{name} line {lineno}: key {key!r} holds a lone surrogate ({v[e.start]!r}, an escape "
                        "such as \\ud800 without its pair), which is not Unicode text; fix or remove that line"
                    ) from None
        # A list's strings are split one by one (Megatron splits only plain strings).
        out.append([s for v in value for s in _split_sentences(v)] if _WORKER["splitter"] else value)
    return out


def _encode_bytes(tokenizer, sentences: list, dtype) -> list:
    """Each sentence's ids as ``dtype`` bytes (Megatron's tokenize: a Hugging Face template's BOS, nothing for
    the other tokenizers)."""
    if not sentences:
        return []
    return tokenizer.encode_batch_bytes(sentences, dtype, add_special_tokens=True)


def encode_chunk(task):
    """Tokenise a chunk: ``(first line number, block of JSON-line bytes or a list of lines)``.

    Returns ``(per_key, n_docs, n_bytes, n_tokens)``; ``per_key[k]`` is ``(token bytes, sequence sizes,
    sequences per document)``, what ``MMapIndexedDatasetBuilder.add_docs`` takes.
    """
    first_lineno, block = task
    if not isinstance(block, bytes):
        block = b"".join(block)
    tokenizer, dtype = _WORKER["tokenizer"], _WORKER["dtype"]
    # Lone surrogates ("\ud800") can only come from escapes; only then are the texts checked.
    surrogates = b"\\ud" in block or b"\\uD" in block
    docs, lines = [], None
    for i, value in enumerate(_scan_block(block)):
        if value is _MISS:
            if lines is None:
                lines = block.split(b"\n")
            value = _load_line(lines[i], first_lineno + i)
            if value is _MISS:
                continue
        docs.append(_fields(value, first_lineno + i, surrogates))
    itemsize = dtype.itemsize
    eod = np.array([tokenizer.eod_id], dtype=dtype).tobytes() if _WORKER["append_eod"] else None
    per_key, n_tokens = [], 0
    for k in range(len(_WORKER["keys"])):
        encoded = _encode_bytes(tokenizer, [s for doc in docs for s in doc[k]], dtype)
        parts, sizes, seqs, pos = [], [], [], 0
        for doc in docs:
            count = 0
            for ids in encoded[pos:pos + len(doc[k])]:
                # Megatron drops sentences that tokenise to nothing.
                if ids:
                    parts.append(ids)
                    sizes.append(len(ids) // itemsize)
                    count += 1
            pos += len(doc[k])
            if count and eod is not None:
                parts.append(eod)
                sizes[-1] += 1
            seqs.append(count)
        data = b"".join(parts)
        n_tokens += len(data) // itemsize
        per_key.append((data, np.array(sizes, dtype=np.int32), np.array(seqs, dtype=np.int32)))
    return per_key, len(docs), len(block), n_tokens
