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


def _json_kind(value) -> str:
    """What a JSON value is, in JSON's words (a list says what it holds that is not a string)."""
    names = {bool: "a boolean", int: "a number", float: "a number", dict: "an object", type(None): "null",
             str: "a string", list: "a list"}
    if isinstance(value, list):
        other = [v for v in value if not isinstance(v, str)]
        return f"a list with {names.get(type(other[0]), 'a value')} in it" if other else "a list of strings"
    return names.get(type(value), type(value).__name__)


def _parse_line(line: bytes, lineno: int):
    """The per-key list of sentences in one JSON line (None for a blank line)."""
    if not line.strip():
        return None
    name = _WORKER["input"]
    try:
        data = _loads(line)
    except UnicodeDecodeError:
        raise InputError(f"{name} line {lineno} is not UTF-8 text; re-encode the file as UTF-8") from None
    except ValueError as e:
        reason = getattr(e, "msg", None) or str(e).splitlines()[0]
        col = getattr(e, "colno", None)
        # json's messages such as "Invalid control character at" expect a position after them.
        reason = reason[: -len(" at")] if reason.endswith(" at") else reason
        where = f" at column {col}" if col else ""
        raise InputError(
            f"{name} line {lineno} is not valid JSON ({reason}{where}); fix or remove that line"
        ) from None
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
        # A list's strings are split one by one (Megatron splits only plain strings).
        out.append([s for v in value for s in _split_sentences(v)] if _WORKER["splitter"] else value)
    return out


def encode_chunk(task):
    """Tokenise a chunk of lines.

    Returns ``(per_key, n_docs, n_bytes, n_tokens)``; ``per_key[k]`` is a flat
    token array plus, per document, the list of its sequence lengths.
    """
    first_lineno, lines = task
    tokenizer = _WORKER["tokenizer"]
    parsed = [_parse_line(line, first_lineno + i) for i, line in enumerate(lines)]
    docs = [p for p in parsed if p is not None]
    n_bytes = sum(len(line) for line in lines)
    per_key, n_tokens = [], 0
    for k in range(len(_WORKER["keys"])):
        sentences = [s for doc in docs for s in doc[k]]
        # Megatron's tokenize: a Hugging Face template's BOS, nothing for the other tokenizers.
        encoded = tokenizer.encode_batch(sentences, add_special_tokens=True) if sentences else []
        flat, doc_lens, pos = [], [], 0
        for doc in docs:
            lens = []
            for ids in encoded[pos : pos + len(doc[k])]:
                # Megatron drops sentences that tokenise to nothing.
                if ids:
                    flat.extend(ids)
                    lens.append(len(ids))
            pos += len(doc[k])
            if lens and _WORKER["append_eod"]:
                flat.append(tokenizer.eod_id)
                lens[-1] += 1
            doc_lens.append(lens)
        n_tokens += len(flat)
        per_key.append((np.asarray(flat, dtype=_WORKER["dtype"]), doc_lens))
    return per_key, len(docs), n_bytes, n_tokens
