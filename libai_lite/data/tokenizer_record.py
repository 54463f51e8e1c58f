"""The tokenizer record beside a preprocessed corpus (``PREFIX.tokenizer.json``), and the check that a run's
tokenizer is the one the corpus was made with.

Token ids carry no mark of their tokenizer: a corpus made with BERT's WordPiece trains under a GPT-2 tokenizer
of the same size without an error, on ids that mean other tokens. tools/preprocess_data.py writes the record
with the ``.bin/.idx`` pair (``MMapIndexedDatasetBuilder(record=...)``); the trainer compares it with its own
tokenizer before any index is built. A corpus made by another tool (Megatron-LM) has none and is not checked.
"""
from __future__ import annotations

import importlib.metadata
import json
import os

from ..utils.errors import UsageError

RECORD_SUFFIX = ".tokenizer.json"
RECORD_FORMAT = 1
# Attributes of libai_lite's tokenizers that name the files they were read from, in the order shown.
_FILE_ATTRS = ("vocab_file", "merges_file", "model_file", "tokenizer_file")


def record_path(prefix) -> str:
    """Where the tokenizer record of the ``.bin/.idx`` pair at ``prefix`` lives."""
    return os.fspath(prefix) + RECORD_SUFFIX


def tokenizer_files(tokenizer) -> dict:
    """The files ``tokenizer`` was read from, by attribute name."""
    return {a: os.fspath(getattr(tokenizer, a)) for a in _FILE_ATTRS if getattr(tokenizer, a, None)}


def _version() -> str | None:
    try:
        return importlib.metadata.version("libai_lite")
    except importlib.metadata.PackageNotFoundError:
        return None


def make_record(tokenizer, tokenizer_type: str | None, append_eod: bool, tool: str) -> dict:
    """The record of a corpus tokenised by ``tokenizer`` (its ``vocab_fingerprint`` identifies it)."""
    return {
        "format": RECORD_FORMAT,
        "tokenizer_type": tokenizer_type,
        "class": type(tokenizer).__name__,
        "files": tokenizer_files(tokenizer),
        "vocab_fingerprint": tokenizer.vocab_fingerprint(),
        "vocab_size": int(tokenizer.vocab_size),
        "eod_id": None if tokenizer.eod_id is None else int(tokenizer.eod_id),
        "append_eod": bool(append_eod),
        "tool": tool,
        "version": _version(),
    }


def record_bytes(record: dict) -> bytes:
    """The record as its file holds it."""
    return (json.dumps(record, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def read_record(prefix) -> dict | None:
    """The tokenizer record of ``prefix``, or None when it has none; UsageError for an unreadable one."""
    path = record_path(prefix)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} is not a readable tokenizer record ({type(e).__name__}: {e}); re-run "
                         f"tools/preprocess_data.py for {prefix}, or delete the file to train unchecked") from None
    if not isinstance(record, dict) or "vocab_fingerprint" not in record:
        raise UsageError(f"{path} is not a tokenizer record (no vocab_fingerprint); re-run tools/preprocess_data.py "
                         f"for {prefix}, or delete the file to train unchecked")
    return record


def _describe_record(record: dict) -> str:
    files = ", ".join(str(v) for v in (record.get("files") or {}).values())
    name = record.get("tokenizer_type") or record.get("class") or "an unnamed tokenizer"
    return (f"{name} ({files + '; ' if files else ''}{record.get('vocab_size')} ids, vocabulary "
            f"{str(record.get('vocab_fingerprint'))[:19]})")


def _describe_tokenizer(tokenizer) -> str:
    files = ", ".join(tokenizer_files(tokenizer).values())
    return (f"{type(tokenizer).__name__} ({files + '; ' if files else ''}{tokenizer.vocab_size} ids, vocabulary "
            f"{tokenizer.vocab_fingerprint()[:19]})")


def check_record(prefix, tokenizer, eod_token_id=None) -> bool:
    """Refuse (UsageError, one line) a corpus at ``prefix`` whose record names another tokenizer than
    ``tokenizer``: another base vocabulary, or (when documents end with one) another end-of-document id than
    ``eod_token_id`` (default: the tokenizer's). Returns False when the corpus has no record."""
    record = read_record(prefix)
    if record is None:
        return False
    fix = ("preprocess the corpus with this tokenizer (tools/preprocess_data.py) or set tokenization.tokenizer to "
           "the one it was made with")
    if record["vocab_fingerprint"] != tokenizer.vocab_fingerprint():
        raise UsageError(f"{prefix} was tokenized with {_describe_record(record)} but this run's tokenizer is "
                         f"{_describe_tokenizer(tokenizer)}: its ids would be read as other tokens; {fix}")
    eod = tokenizer.eod_id if eod_token_id is None else eod_token_id
    if record.get("append_eod") and record.get("eod_id") != eod:
        raise UsageError(f"{prefix} ends its documents with id {record.get('eod_id')}, the end-of-document id of "
                         f"{_describe_record(record)}, but this run's is {eod} ({_describe_tokenizer(tokenizer)}): "
                         f"{fix}, or set dataloader.train.eod_token_id={record.get('eod_id')}")
    return True
