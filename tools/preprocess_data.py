#!/usr/bin/env python
"""Tokenise a JSON-lines corpus into Megatron-LM mmap ``.bin/.idx`` files.

Takes Megatron-LM's ``tools/preprocess_data.py`` flags and writes the same bytes
(checked against files made by Megatron-LM itself). For every key in
``--json-keys`` it writes ``{output_prefix}_{key}_document.bin/.idx``: one
document per input line, one sequence per document (or one per sentence when the
value is a list of strings), ``--append-eod`` adding the end-of-document id to
non-empty documents. A line whose text yields no tokens becomes an empty
document (a repeated entry in the document index), as in Megatron.
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` reads DIR's
``tokenizer.json`` (Llama 3, Mistral, Qwen2): as in Megatron, every sequence
gets what the tokenizer's template adds (a BOS for Llama and Mistral, nothing
for Qwen2) and ``--append-eod`` appends its eos.

Example (from the repository root)::

    python tools/preprocess_data.py --input data_test/corpus.jsonl \\
        --output-prefix /tmp/demo_gpt2 --tokenizer-type GPT2BPETokenizer \\
        --vocab-file data_test/gpt2/vocab.json --merge-file data_test/gpt2/merges.txt \\
        --append-eod --workers 2
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np
from tqdm import tqdm

from libai_lite.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from libai_lite.tokenizer import TOKENIZER_TYPES, build_tokenizer, check_file

# Lines handed to a worker at once: large enough for the batched encoders to
# pay off, small enough to keep every worker busy on modest corpora.
CHUNK_LINES = 256
CHUNK_BYTES = 1 << 20


class InputError(Exception):
    """Bad input the user can fix; the message is one line naming it and the fix."""


def get_args(argv=None) -> argparse.Namespace:
    """Parse Megatron-LM's preprocessing flags."""
    parser = argparse.ArgumentParser(
        description="Tokenise a JSON-lines corpus into Megatron mmap .bin/.idx files."
    )
    group = parser.add_argument_group("input data")
    group.add_argument("--input", type=str, required=True, help="JSON-lines file, one document per line")
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys whose text is tokenised; each gets its own output files (default: text)",
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", type=str, required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--vocab-file", type=str, default=None, help="GPT-2 vocab.json or BERT vocab.txt")
    group.add_argument("--merge-file", type=str, default=None, help="GPT-2 merges.txt")
    group.add_argument(
        "--tokenizer-model",
        type=str,
        default=None,
        help="SentencePiece .model, or for HuggingFaceTokenizer the directory holding tokenizer.json",
    )
    group.add_argument(
        "--vocab-extra-ids", type=int, default=0, help="number of <extra_id_*> sentinels (T5)"
    )
    group.add_argument("--append-eod", action="store_true", help="append the end-of-document id")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", type=str, required=True, help="prefix of the output files")
    group.add_argument(
        "--dataset-impl",
        type=str,
        default="mmap",
        choices=["mmap"],
        help="accepted for Megatron compatibility; only mmap is written",
    )
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenising worker processes")
    group.add_argument(
        "--log-interval",
        type=int,
        default=100,
        help="documents between progress lines (on stdout) when stderr is not a terminal",
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.log_interval < 1:
        parser.error("--log-interval must be >= 1")
    if args.vocab_extra_ids < 0:
        parser.error("--vocab-extra-ids must be >= 0")
    return args


# ---------------------------------------------------------------- worker side

_WORKER = {}


def _init_worker(tokenizer_kwargs: dict, keys, append_eod: bool, dtype, input_name: str, threads: bool):
    """Build this process's tokenizer once; workers run single-threaded backends."""
    if not threads:
        # Ctrl-C reaches the whole process group; the parent alone cleans up and
        # terminates the pool, so workers stay quiet instead of each printing a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tokenizer = build_tokenizer(**tokenizer_kwargs)
    if not threads and hasattr(tokenizer, "num_threads"):
        tokenizer.num_threads = 1
    _WORKER.update(
        tokenizer=tokenizer, keys=keys, append_eod=append_eod, dtype=np.dtype(dtype), input=input_name
    )


def _parse_line(line: bytes, lineno: int):
    """The per-key list of sentences in one JSON line (None for a blank line)."""
    if not line.strip():
        return None
    name = _WORKER["input"]
    try:
        data = json.loads(line)
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
            f"{name} line {lineno} holds a JSON {type(data).__name__}, not an object; "
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
            out.append([value])
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            out.append(value)
        else:
            raise InputError(
                f"{name} line {lineno}: key {key!r} holds a JSON {type(value).__name__}; "
                "it must be a string or a list of strings"
            )
    return out


def _encode_chunk(task):
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


# ---------------------------------------------------------------- main side


def _chunks(f):
    """Yield ``(first_line_number, [raw lines])`` from a binary file."""
    lines, size, first = [], 0, 1
    for lineno, line in enumerate(f, start=1):
        if not lines:
            first = lineno
        lines.append(line)
        size += len(line)
        if len(lines) >= CHUNK_LINES or size >= CHUNK_BYTES:
            yield first, lines
            lines, size = [], 0
    if lines:
        yield first, lines


def _ordered_results(tasks, workers: int, initargs):
    """Encode ``tasks`` in ``workers`` processes, yielding results in input order.

    At most a few chunks per worker are in flight, so memory stays bounded
    however large the input is (``Pool.imap`` would read the whole file ahead).
    A process pool executor is used rather than ``multiprocessing.Pool``
    because it reports a worker killed by the OS (say, out of memory) instead
    of waiting for its result forever.
    """
    if workers == 1:
        _init_worker(*initargs)
        for task in tasks:
            yield _encode_chunk(task)
        return
    # Fork keeps startup cheap and needs no importable module path for this script.
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    # Each worker is one core's worth of tokenising; the HF backend's own thread
    # pool would oversubscribe (and warns after fork when already used here).
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        executor = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=initargs)
        # Start the workers now, while the environment says so.
        warm = [executor.submit(int, 0) for _ in range(workers)]
        for w in warm:
            w.result()
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    try:
        pending = collections.deque()
        for task in tasks:
            pending.append(executor.submit(_encode_chunk, task))
            if len(pending) >= 4 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise InputError(
            "a tokenising worker process died (killed for memory?); rerun with fewer --workers"
        ) from None
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def _missing_dirs(path: str) -> list:
    """Directories on ``path`` that do not exist yet, deepest first."""
    missing = []
    while path and not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def main(argv=None) -> int:
    """Run the preprocessing; returns the process exit code (0 ok, 1 bad input)."""
    args = get_args(argv)
    tokenizer_kwargs = dict(
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_extra_ids=args.vocab_extra_ids,
    )
    try:
        check_file(args.input, "input file", "pass --input pointing at a JSON-lines file")
        tokenizer = build_tokenizer(**tokenizer_kwargs)
    except (InputError, ValueError, OSError) as e:
        return _fail(str(e))
    if args.append_eod and tokenizer.eod_id is None:
        return _fail(f"{args.tokenizer_type} has no end-of-document token; drop --append-eod")
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}

    created_dirs = _missing_dirs(os.path.dirname(os.path.abspath(args.output_prefix)))
    builders = {}

    def discard_outputs():
        for b in builders.values():
            b.abort()
        # A failed run should not even leave the output folder it made.
        for d in created_dirs:
            try:
                os.rmdir(d)
            except OSError:
                break

    try:
        for key, prefix in prefixes.items():
            builders[key] = MMapIndexedDatasetBuilder(prefix, dtype=dtype)
    except OSError as e:
        discard_outputs()
        return _fail(
            f"cannot write {e.filename or args.output_prefix}: {e.strerror}; pick a writable --output-prefix"
        )

    total_bytes = os.path.getsize(args.input)
    initargs = (tokenizer_kwargs, list(args.json_keys), args.append_eod, dtype, args.input, args.workers == 1)
    n_docs = n_tokens = n_bytes = 0
    start = time.time()
    next_log = args.log_interval
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenising", disable=None, file=sys.stderr)
    results = None
    try:
        with open(args.input, "rb") as f:
            results = _ordered_results(_chunks(f), args.workers, initargs)
            for per_key, docs, nbytes, ntoks in results:
                for key, (flat, doc_lens) in zip(args.json_keys, per_key):
                    builder, pos = builders[key], 0
                    for lens in doc_lens:
                        end = pos + sum(lens)
                        builder.add_doc(flat[pos:end], lens)
                        pos = end
                n_docs += docs
                n_tokens += ntoks
                n_bytes += nbytes
                bar.update(nbytes)
                if bar.disable and n_docs >= next_log:
                    elapsed = max(time.time() - start, 1e-9)
                    # stdout, so that stderr carries nothing but a failure's one line.
                    print(
                        f"processed {n_docs} documents ({n_docs / elapsed:.1f} docs/s, "
                        f"{n_bytes / elapsed / 1e6:.2f} MB/s)",
                        flush=True,
                    )
                    next_log = (n_docs // args.log_interval + 1) * args.log_interval
        if n_docs == 0:
            raise InputError(f"{args.input} has no documents; pass a JSON-lines file with one object per line")
        for builder in builders.values():
            builder.finalize()
    except BaseException as e:
        # Interrupted or failed: stop the workers and leave no output behind.
        if results is not None:
            results.close()
        bar.close()
        discard_outputs()
        if isinstance(e, InputError):
            return _fail(str(e))
        if isinstance(e, KeyboardInterrupt):
            print("interrupted: no output written", file=sys.stderr)
            return 130
        raise
    bar.close()

    elapsed = max(time.time() - start, 1e-9)
    print(
        f"done: {n_docs} documents, {n_tokens} tokens, {n_bytes / 1e6:.2f} MB in {elapsed:.2f} s "
        f"({n_docs / elapsed:.1f} docs/s, {n_bytes / elapsed / 1e6:.2f} MB/s, "
        f"{n_tokens / elapsed:.0f} tokens/s) with {args.workers} worker(s)"
    )
    for prefix in prefixes.values():
        print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
