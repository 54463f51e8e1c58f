#!/usr/bin/env python
"""Tokenise a corpus into Megatron-LM mmap ``.bin/.idx`` files, with Megatron-LM's flags and the same bytes.

Example (from the repository root)::

    python tools/preprocess_data.py --input data_test/corpus.jsonl \\
        --output-prefix /tmp/demo_gpt2 --tokenizer-type GPT2BPETokenizer \\
        --vocab-file data_test/gpt2/vocab.json --merge-file data_test/gpt2/merges.txt \\
        --append-eod --workers 2

The output files, the input formats, sentence splitting and the tokenizers: docs/tools.md#preprocess_data.
"""
from __future__ import annotations

import argparse
import collections
import errno
import gc
import multiprocessing
import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from tqdm import tqdm

from libai_lite.data.corpus_encoding import InputError, build_sentence_splitter, encode_chunk, init_worker
from libai_lite.data.corpus_readers import CHUNK_LINES, TEXT_DOCS, CorpusError, open_corpus  # noqa: F401
from libai_lite.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype
from libai_lite.data.tokenizer_record import make_record, record_path
from libai_lite.tokenizer import TOKENIZER_TYPES, build_tokenizer
from libai_lite.utils.errors import UsageError
from libai_lite.utils.paths import check_outputs


def get_args(argv=None) -> argparse.Namespace:
    """Parse Megatron-LM's preprocessing flags."""
    parser = argparse.ArgumentParser(
        description="Tokenise a JSON-lines corpus into Megatron mmap .bin/.idx files."
    )
    group = parser.add_argument_group("input data")
    group.add_argument("--input", type=str, required=True,
                       help="JSON lines (one document per line), .gz/.zst, plain text, Parquet, a Hugging Face "
                            "datasets folder or a fairseq data-bin")
    group.add_argument("--text-docs", choices=TEXT_DOCS, default=None,
                       help="read --input as plain text: a document per line, or documents separated by blank "
                            "lines (fairseq); .txt files default to line")
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys whose text is tokenised; each gets its own output files (default: text)",
    )
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", type=str, required=True, choices=TOKENIZER_TYPES)
    # --vocab: OneFlow-GPT's README spelling, which argparse would otherwise read as an ambiguous prefix.
    group.add_argument("--vocab-file", "--vocab", dest="vocab_file", type=str, default=None,
                       help="GPT-2 vocab.json or BERT vocab.txt")
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
    group.add_argument(
        "--split-sentences",
        action="store_true",
        help="split texts into sentences with nltk's punkt (pip install 'libai_lite[sentences]'); "
        "writes {prefix}_{key}_sentence.bin/.idx",
    )
    group.add_argument(
        "--keep-newlines",
        action="store_true",
        help="with --split-sentences: keep the whitespace and newlines after a sentence in it",
    )
    group.add_argument("--lang", type=str, default="english", help="punkt model for --split-sentences")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", type=str, required=True, help="prefix of the output files")
    group.add_argument(
        "--dataset-impl",
        type=str,
        default="mmap",
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
    if args.dataset_impl != "mmap":
        parser.error(f"--dataset-impl {args.dataset_impl} is not written here: only mmap (Megatron's memory-mapped "
                     f".bin/.idx, the format the trainer reads); give --dataset-impl mmap or drop it")
    if args.keep_newlines and not args.split_sentences:
        parser.error("--keep-newlines only applies with --split-sentences; add --split-sentences or drop it")
    return args


# ---------------------------------------------------------------- main side


def _ordered_results(tasks, workers: int, initargs):
    """Encode ``tasks`` in ``workers`` processes, yielding results in input order.

    At most a few chunks per worker are in flight, so memory stays bounded
    however large the input is (``Pool.imap`` would read the whole file ahead).
    A process pool executor is used rather than ``multiprocessing.Pool``
    because it reports a worker killed by the OS (say, out of memory) instead
    of waiting for its result forever.
    """
    if workers == 1:
        init_worker(*initargs)
        for task in tasks:
            yield encode_chunk(task)
        return
    # Fork keeps startup cheap and needs no importable module path for this script.
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    # Each worker is one core's worth of tokenising; the HF backend's own thread
    # pool would oversubscribe (and warns after fork when already used here).
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # A forked worker must not run the destructors of garbage it inherits (a torch process group's waits on
    # threads the child does not have hang there): collect it here, and freeze what lives while forking.
    gc.collect()
    gc.freeze()
    try:
        executor = ProcessPoolExecutor(workers, mp_context=ctx, initializer=init_worker, initargs=initargs)
        # Start the workers now, while the environment says so.
        warm = [executor.submit(int, 0) for _ in range(workers)]
        for w in warm:
            w.result()
    finally:
        gc.unfreeze()
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    try:
        pending = collections.deque()
        for task in tasks:
            pending.append(executor.submit(encode_chunk, task))
            if len(pending) >= 4 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise InputError(
            "a tokenising worker process died (killed for memory?); rerun with fewer --workers"
        ) from None
    finally:
        # Wait for the workers to exit (a chunk at most): forked after the outputs were opened, each
        # holds their descriptors, so a failed run's deleted files would keep their disk space, and
        # its mount point stay busy, for as long as a worker lived on.
        executor.shutdown(wait=True, cancel_futures=True)


def _cpu_seconds() -> float:
    """CPU time of this process and its finished workers: unlike the clock, blind to other load."""
    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime


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
    level = "sentence" if args.split_sentences else "document"
    prefixes = {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}
    # A .bin/.idx input is read as a pair (a fairseq split): neither file may be written over.
    base = args.input[:-4] if args.input.endswith((".bin", ".idx")) else None
    # Tokenizer files, not a tokenizer's folder: outputs beside its tokenizer.json are fine.
    inputs = [args.input] + [p for p in (args.vocab_file, args.merge_file, args.tokenizer_model)
                             if p and os.path.isfile(p)]
    inputs += [base + ".bin", base + ".idx"] if base is not None else []
    try:
        check_outputs([p + ext for p in prefixes.values() for ext in (".bin", ".idx")]
                      + [record_path(p) for p in prefixes.values()], inputs, option="--output-prefix")
    except UsageError as e:
        return _fail(str(e))
    tokenizer_kwargs = dict(
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_extra_ids=args.vocab_extra_ids,
    )
    try:
        tokenizer = build_tokenizer(**tokenizer_kwargs)
        gpt2_decode = tokenizer.decode if args.tokenizer_type == "GPT2BPETokenizer" else None
        corpus = open_corpus(args.input, args.json_keys, args.text_docs, gpt2_decode)
        splitter_args = (args.lang, args.keep_newlines) if args.split_sentences else None
        if splitter_args is not None:
            build_sentence_splitter(*splitter_args)  # refuse now, not once per worker
    except (InputError, CorpusError, ValueError, OSError) as e:
        return _fail(str(e))
    if args.append_eod and tokenizer.eod_id is None:
        return _fail(f"{args.tokenizer_type} has no end-of-document token; drop --append-eod")
    dtype = best_fitting_dtype(tokenizer.vocab_size)
    # Beside the outputs, so training can tell a corpus made with another tokenizer (libai_lite.data.tokenizer_record).
    record = make_record(tokenizer, args.tokenizer_type, args.append_eod, "libai_lite tools/preprocess_data.py")

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
            builders[key] = MMapIndexedDatasetBuilder(prefix, dtype=dtype, record=record)
    except OSError as e:
        discard_outputs()
        return _fail(
            f"cannot write {e.filename or args.output_prefix}: {e.strerror}; pick a writable --output-prefix"
        )

    total_bytes = corpus.size
    initargs = (tokenizer_kwargs, list(args.json_keys), args.append_eod, dtype, args.input, args.workers == 1,
                splitter_args)
    n_docs = n_tokens = n_bytes = 0
    key_tokens = dict.fromkeys(args.json_keys, 0)
    start, cpu_start = time.time(), _cpu_seconds()
    next_log = args.log_interval
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenising", disable=None, file=sys.stderr)
    results = None
    try:
        results = _ordered_results(corpus.chunks(), args.workers, initargs)
        for per_key, docs, nbytes, ntoks in results:
            for key, (data, sizes, seqs) in zip(args.json_keys, per_key):
                key_tokens[key] += int(sizes.sum())
                builders[key].add_docs(data, sizes, seqs)
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
            raise InputError(f"{args.input} ({corpus.kind}) has no documents; pass a corpus with at least one")
        empty = [key for key, count in key_tokens.items() if count == 0]
        if empty:
            # Megatron writes a 0-token dataset here, which fails only when training starts.
            raise InputError(
                f"no documents with tokens in {args.input} under {' and '.join(map(repr, empty))} ({n_docs} "
                f"documents, every one empty there); check --json-keys names the key that holds the text"
            )
        for builder in builders.values():
            builder.finalize()
    except BaseException as e:
        # Interrupted or failed: stop the workers and leave no output behind.
        if results is not None:
            results.close()
        bar.close()
        discard_outputs()
        if isinstance(e, (InputError, CorpusError)):
            return _fail(str(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS):
            where = os.path.dirname(os.path.abspath(args.output_prefix))
            return _fail(
                f"cannot write the output in {where}: {e.strerror}; free space there or pick another "
                f"--output-prefix (nothing was kept)"
            )
        if isinstance(e, KeyboardInterrupt):
            print("interrupted: no output written", file=sys.stderr)
            return 130
        raise
    bar.close()

    elapsed = max(time.time() - start, 1e-9)
    cpu = _cpu_seconds() - cpu_start
    print(
        f"done: {n_docs} documents, {n_tokens} tokens, {n_bytes / 1e6:.2f} MB in {elapsed:.2f} s "
        f"({n_docs / elapsed:.1f} docs/s, {n_bytes / elapsed / 1e6:.2f} MB/s, "
        f"{n_tokens / elapsed:.0f} tokens/s) with {args.workers} worker(s), {cpu:.2f} CPU-seconds"
    )
    for prefix in prefixes.values():
        print(f"wrote {prefix}.bin, {prefix}.idx and {record_path(prefix)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
