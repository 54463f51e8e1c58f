#!/usr/bin/env python
"""Regenerate ``data_test/``: a demo corpus, its tokenizers and preprocessed datasets.

Everything comes from the running Python's standard library, so a machine with no network can rebuild
it; the same Python version gives the same corpus.

Usage (from the repository root)::

    python tools/make_demo_data.py
    python tools/make_demo_data.py --datasets-only   # only re-run the preprocessing (same bytes, same records)

The files it writes: docs/tools.md#make_demo_data and data_test/README.md.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import os
import sys
import warnings

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Standard-library modules whose docstrings make the corpus. Left out on
# purpose: modules with side effects on import (antigravity opens a browser,
# this prints), GUI and platform-specific packages, and the test suite.
MODULES = sorted(
    """
    abc aifc argparse array ast asynchat asyncio asyncio.base_events asyncio.events
    asyncio.futures asyncio.locks asyncio.queues asyncio.streams asyncio.subprocess
    asyncio.tasks asyncio.transports asyncore atexit base64 bdb binascii bisect builtins
    bz2 cProfile calendar cgi cgitb chunk cmath cmd code codecs codeop collections
    collections.abc colorsys compileall concurrent.futures concurrent.futures.process
    concurrent.futures.thread configparser contextlib contextvars copy copyreg crypt csv
    ctypes curses dataclasses datetime dbm dbm.dumb decimal difflib dis doctest email
    email.charset email.contentmanager email.encoders email.errors email.feedparser
    email.generator email.header email.headerregistry email.message email.mime.base
    email.mime.multipart email.mime.text email.parser email.policy email.utils
    encodings enum errno faulthandler fcntl filecmp fileinput fnmatch fractions ftplib
    functools gc genericpath getopt getpass gettext glob graphlib grp gzip hashlib heapq
    hmac html html.entities html.parser http http.client http.cookiejar http.cookies
    http.server imaplib imghdr importlib importlib.abc importlib.machinery
    importlib.metadata importlib.resources importlib.util inspect io ipaddress itertools
    json json.decoder json.encoder keyword linecache locale logging logging.config
    logging.handlers lzma mailbox mailcap marshal math mimetypes mmap modulefinder
    multiprocessing multiprocessing.connection multiprocessing.context
    multiprocessing.managers multiprocessing.pool multiprocessing.process
    multiprocessing.queues multiprocessing.shared_memory multiprocessing.synchronize
    netrc nntplib ntpath numbers opcode operator optparse os pathlib pdb pickle
    pickletools pipes pkgutil platform plistlib poplib posixpath pprint profile pstats
    pty pwd py_compile pyclbr pydoc queue quopri random re readline reprlib resource
    rlcompleter runpy sched secrets select selectors shelve shlex shutil signal site
    smtpd smtplib sndhdr socket socketserver sqlite3 ssl stat statistics string
    stringprep struct subprocess sunau symtable sys sysconfig syslog tabnanny tarfile
    telnetlib tempfile termios textwrap threading time timeit token tokenize tomllib
    trace traceback tracemalloc tty types typing unicodedata unittest unittest.case
    unittest.loader unittest.mock unittest.result unittest.runner unittest.suite urllib
    urllib.error urllib.parse urllib.request urllib.response urllib.robotparser uu uuid
    warnings wave weakref webbrowser wsgiref wsgiref.handlers wsgiref.headers
    wsgiref.simple_server wsgiref.util wsgiref.validate xdrlib xml xml.dom
    xml.dom.minidom xml.dom.pulldom xml.etree.ElementTree xml.sax xml.sax.handler
    xml.sax.saxutils xml.sax.xmlreader xmlrpc.client xmlrpc.server zipapp zipfile
    zipimport zlib zoneinfo
    """.split()
)

# Short docstrings ("Return self==value.") repeat across classes and teach little.
MIN_CHARS = 80

GPT2_VOCAB = 8000
BERT_VOCAB = 8000
SPM_VOCAB = 4000


def _import_quietly(name: str):
    """Import ``name`` with its deprecation warnings and import-time output silenced; None if it fails."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(
        io.StringIO()
    ):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except Exception:  # missing on this platform/version, or broken: just skip it
            return None


def _doc(obj):
    try:
        doc = inspect.getdoc(obj)
    except Exception:
        return None
    return doc.strip() if isinstance(doc, str) else None


def _public(name: str) -> bool:
    # Single-underscore helpers are documented as carefully as public names and
    # add useful text; dunders other than __init__ mostly repeat object's docs.
    return not name.startswith("__") or name == "__init__"


def _members(namespace: dict, owner_module: str):
    """Classes and callables of a module namespace, in name order, defined in ``owner_module``."""
    for name in sorted(namespace):
        if name.startswith("__"):
            continue
        obj = namespace[name]
        if not (inspect.isclass(obj) or callable(obj)):
            continue
        if getattr(obj, "__module__", owner_module) != owner_module:
            continue  # re-exported from elsewhere; its own module contributes it
        yield name, obj


def gather_docstrings(modules=MODULES, min_chars: int = MIN_CHARS):
    """Return ``[{"id", "src", "text"}]`` for ``modules`` and the help topics, deduplicated, in a fixed order.

    Per module: its docstring, then its classes and functions by name, each
    class followed by its methods by name. Then the texts ``help("TOPIC")``
    shows (``pydoc_data.topics``), by topic name.
    """
    docs, seen = [], set()

    def add(src: str, text):
        if text and len(text) >= min_chars and text not in seen:
            seen.add(text)
            docs.append({"id": str(len(docs)), "src": src, "text": text})

    with warnings.catch_warnings():
        # Touching deprecated attributes (typing.io, ...) warns; the text is still wanted.
        warnings.simplefilter("ignore")
        for name in modules:
            module = _import_quietly(name)
            if module is None:
                continue
            add(name, _doc(module))
            # C modules such as builtins report their classes under the module's own name.
            for _, obj in _members(vars(module), module.__name__):
                add(name, _doc(obj))
                if inspect.isclass(obj):
                    for attr in sorted(vars(obj)):
                        if _public(attr):
                            add(name, _doc(getattr(obj, attr, None)))
        topics = _import_quietly("pydoc_data.topics")
        for key in sorted(getattr(topics, "topics", {})):
            add(f"pydoc_data.topics:{key}", topics.topics[key].strip())
    return docs


def write_corpus(docs, path: str) -> None:
    """One JSON object per line, UTF-8."""
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")


def train_gpt2(texts, out_dir: str) -> None:
    """Byte-level BPE in GPT-2's file format (vocab.json + merges.txt)."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(
        texts, vocab_size=GPT2_VOCAB, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False
    )
    tok.save_model(out_dir)


def train_bert(texts, out_dir: str) -> None:
    """Lower-cased WordPiece ``vocab.txt`` (BERT's five special tokens first), reproducibly.

    ``tokenizers.BertWordPieceTokenizer.train`` numbers its ``##x`` symbols in
    hash-map order and breaks frequency ties by those numbers, so two runs give
    different vocabularies. It is a BPE trainer with a ``##`` prefix on
    non-initial characters; here the same BPE trainer runs with each
    non-initial character replaced by its own private-use code point instead
    (all ids then come from sorted alphabets), and the prefix is put back after.
    The normaliser and pre-tokeniser are BertWordPieceTokenizer's.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=True, lowercase=True
    )
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    words = [
        [w for w, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(t))] for t in texts
    ]
    used = {c for doc in words for w in doc for c in w}
    free = (chr(cp) for cp in range(0xF0000, 0x10FFFE) if chr(cp) not in used)
    later = sorted({c for doc in words for w in doc for c in w[1:]})
    to_mark = {c: next(free) for c in later}
    from_mark = {m: c for c, m in to_mark.items()}

    def mark(word: str) -> str:
        return word[0] + "".join(to_mark[c] for c in word[1:])

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(
        vocab_size=BERT_VOCAB, min_frequency=2, special_tokens=specials, show_progress=False
    )
    tok.train_from_iterator((" ".join(mark(w) for w in doc) for doc in words), trainer=trainer)

    def unmark(token: str) -> str:
        if token in specials:
            return token
        plain = "".join(from_mark.get(c, c) for c in token)
        return "##" + plain if token[0] in from_mark else plain

    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    with open(os.path.join(out_dir, "vocab.txt"), "w", encoding="utf-8") as f:
        for token, _ in vocab:
            f.write(unmark(token) + "\n")


def train_spm(texts, out_dir: str) -> None:
    """SentencePiece unigram with T5's special ids (pad=0, eos=1, unk=2, no bos)."""
    import sentencepiece as spm

    # SentencePiece skips "sentences" over max_sentence_length bytes, so feed lines.
    lines = [line.strip() for text in texts for line in text.split("\n") if line.strip()]
    with contextlib.redirect_stderr(io.StringIO()):
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_prefix=os.path.join(out_dir, "spiece"),
            model_type="unigram",
            vocab_size=SPM_VOCAB,
            character_coverage=1.0,
            pad_id=0,
            eos_id=1,
            unk_id=2,
            bos_id=-1,
            num_threads=1,  # more threads can change the learnt pieces between runs
            minloglevel=2,
        )


def _load_preprocess_main():
    """``main`` of tools/preprocess_data.py (tools/ is a folder of scripts, not a package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preprocess_data.py")
    name = "libai_lite_tools_preprocess_data"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        # Registered so worker processes can unpickle references to its functions.
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].main


def main(argv=None) -> int:
    """Build the corpus, train the three tokenizers and preprocess the corpus with each."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", default=os.path.join(REPO_ROOT, "data_test"))
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--datasets-only", action="store_true",
                        help="keep the corpus and tokenizers; only preprocess the corpus again")
    args = parser.parse_args(argv)

    preprocess_main = _load_preprocess_main()
    # Relative to where it runs (the repository root): the tokenizer records name these paths.
    out = os.path.relpath(args.output_dir)
    for sub in ("gpt2", "bert", "spm"):
        os.makedirs(os.path.join(out, sub), exist_ok=True)

    corpus = os.path.join(out, "corpus.jsonl")
    if not args.datasets_only:
        docs = gather_docstrings()
        write_corpus(docs, corpus)
        n_chars = sum(len(d["text"]) for d in docs)
        print(f"corpus: {len(docs)} documents, {n_chars / 1e6:.2f} M characters -> {corpus}")

        folded = [d["text"].replace("\n", " ") for d in docs]
        train_gpt2(folded, os.path.join(out, "gpt2"))
        train_bert(folded, os.path.join(out, "bert"))
        train_spm([d["text"] for d in docs], os.path.join(out, "spm"))
        print("trained tokenizers: gpt2/vocab.json gpt2/merges.txt bert/vocab.txt spm/spiece.model")

    common = ["--input", corpus, "--json-keys", "text", "--workers", str(args.workers)]
    runs = [
        [
            "--output-prefix", os.path.join(out, "gpt2", "demo_gpt2"),
            "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", os.path.join(out, "gpt2", "vocab.json"),
            "--merge-file", os.path.join(out, "gpt2", "merges.txt"),
            "--append-eod",
        ],
        [
            "--output-prefix", os.path.join(out, "bert", "demo_bert"),
            "--tokenizer-type", "BertWordPieceLowerCase",
            "--vocab-file", os.path.join(out, "bert", "vocab.txt"),
        ],
        [
            "--output-prefix", os.path.join(out, "spm", "demo_spm"),
            "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", os.path.join(out, "spm", "spiece.model"),
            "--append-eod",
        ],
    ]
    for run in runs:
        rc = preprocess_main(common + run)
        if rc != 0:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
