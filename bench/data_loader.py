#!/usr/bin/env python
"""Samples per second from the GPT dataset and loader, or T5's span corruption, against raw reads of the same
token spans.

    python bench/data_loader.py
    python bench/data_loader.py --data-prefix data_test/gpt2/demo_gpt2_text_document --seq-length 128
    python bench/data_loader.py --span-corruption --micro-batch 16     # the MT5 recipe's loader, encoder 512

The last line of the output is one JSON object with the numbers.
What it times: bench/README.md, section "data_loader.py: how it measures".
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import time

import numpy as np
import torch


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options; see ``--help``."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-prefix", default=None, help="an existing .bin/.idx prefix instead of synthetic data")
    p.add_argument("--tokens", type=float, default=100e6, help="synthetic corpus size in tokens (default 100M)")
    p.add_argument("--seq-length", type=int, default=None, help="tokens per sample; with --span-corruption the "
                   "encoder's (default 1024, 512 with --span-corruption)")
    p.add_argument("--span-corruption", action="store_true",
                   help="T5's loader (projects/MT5) with data_test's BERT vocabulary and 100 sentinels")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2,
                   help="train samples asked for, in epochs of the train split (raised to cover --samples)")
    p.add_argument("--samples", type=int, default=100000, help="samples read per measurement")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="DataLoader worker counts")
    p.add_argument("--tmpdir", default=None, help="where synthetic data and index caches go (default: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="200k tokens, seq 128, a few hundred samples")
    args = p.parse_args(argv)
    if args.seq_length is None:
        args.seq_length = 512 if args.span_corruption else 1024
    if args.smoke:
        args.tokens, args.seq_length, args.samples, args.workers = 2e5, 128, 256, [0, 1]
    if args.tokens < 1 or args.seq_length < 1 or args.micro_batch < 1 or args.samples < 1 or args.epochs < 1:
        p.error("--tokens, --seq-length, --micro-batch, --samples and --epochs must be positive")
    return args


def write_synthetic(prefix: str, num_tokens: int, seed: int = 0, vocab: int = 50257) -> dict:
    """Documents of 16-2047 tokens (ids below ``vocab``, GPT-2's by default) up to ``num_tokens``, one sequence each."""
    from libai_lite.data.indexed_dataset import MMapIndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = MMapIndexedDatasetBuilder(prefix, dtype=np.uint16)
    written = docs = 0
    while written < num_tokens:
        # A chunk of documents at a time keeps memory flat for billions of tokens.
        remaining = num_tokens - written
        lengths = rng.integers(16, 2048, size=4096)
        if lengths.sum() > remaining:
            lengths = lengths[np.cumsum(lengths) <= remaining]
            rest = remaining - int(lengths.sum())
            if rest:
                lengths = np.append(lengths, rest)
        tokens = rng.integers(0, vocab, size=int(lengths.sum()), dtype=np.uint16)
        pos = 0
        for n in lengths.tolist():
            builder.add_doc(tokens[pos:pos + n], [n])
            pos += n
        written += pos
        docs += lengths.size
    builder.finalize()
    return {"tokens": written, "documents": docs}


BERT_VOCAB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data_test", "bert", "vocab.txt")


def bert_tokenizer():
    """projects/MT5/configs/t5_dataset.py's tokenizer: data_test's WordPiece vocabulary and 100 sentinels."""
    from libai_lite.tokenizer import BertTokenizer

    return BertTokenizer(BERT_VOCAB, do_lower_case=True, vocab_extra_ids=100)


def window_length(args) -> int:
    """Tokens one sample reads: the sequence, or for span corruption the raw window T5 corrupts."""
    if not args.span_corruption:
        return args.seq_length
    from projects.MT5.data.t5_dataset import random_spans_helper

    return random_spans_helper(args.seq_length)[0]


def build_loaders(prefix: str, args, train_samples: int, cache_dir: str, workers: int):
    """The train loader exactly as the trainer builds it (no valid/test split asked for)."""
    from libai_lite.data import build_gpt_train_valid_test_loaders

    if args.span_corruption:
        from projects.MT5.data.t5_dataset import build_t5_train_valid_test_loaders

        train, _, _ = build_t5_train_valid_test_loaders(
            prefix, args.tokenizer, splits_string="949,50,1", max_seq_length=args.seq_length, seed=1234,
            num_workers=workers, cache_dir=cache_dir, train_valid_test_num_samples=[train_samples, 0, 0],
            micro_batch_size=args.micro_batch)
        return train
    train, _, _ = build_gpt_train_valid_test_loaders(
        prefix, splits_string="949,50,1", seq_length=args.seq_length, seed=1234, num_workers=workers,
        cache_dir=cache_dir, train_valid_test_num_samples=[train_samples, 0, 0],
        micro_batch_size=args.micro_batch)
    return train


def sample_spans(dataset, count: int) -> list:
    """For samples ``0..count-1`` of a GPTDataset: the ``(sequence, offset, length)`` pieces it reads.

    Computed from the dataset's own index arrays before any timing, so the reference below pays
    only for reading tokens.
    """
    doc_sizes = dataset.indexed_dataset.document_sizes()
    spans = []
    for idx in range(count):
        i = int(dataset.shuffle_idx[idx])
        doc_f, off_f = (int(v) for v in dataset.sample_idx[i])
        doc_l, off_l = (int(v) for v in dataset.sample_idx[i + 1])
        if doc_f == doc_l:
            pieces = [(int(dataset.doc_idx[doc_f]), off_f, off_l - off_f + 1)]
        else:
            first = int(dataset.doc_idx[doc_f])
            pieces = [(first, off_f, int(doc_sizes[first]) - off_f)]
            for d in dataset.doc_idx[doc_f + 1:doc_l]:
                pieces.append((int(d), 0, int(doc_sizes[int(d)])))
            pieces.append((int(dataset.doc_idx[doc_l]), 0, off_l + 1))
        spans.append(pieces)
    return spans


def raw_reads(indexed, spans: list, micro_batch: int) -> float:
    """Seconds to read ``spans`` with ``MMapIndexedDataset.get_document`` into the loader's batch layout."""
    start = time.perf_counter()
    for b in range(0, len(spans) - micro_batch + 1, micro_batch):
        rows = []
        for pieces in spans[b:b + micro_batch]:
            parts = [indexed.get_document(doc, offset=off, length=n) for doc, off, n in pieces]
            rows.append(parts[0] if len(parts) == 1 else np.concatenate(parts))
        tokens = torch.from_numpy(np.stack(rows).astype(np.int64))
        _ = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    return time.perf_counter() - start


def time_loader(loader, samples: int, micro_batch: int) -> tuple:
    """``(seconds to the first batch, seconds for the next samples // micro_batch batches)``."""
    start = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    batches = samples // micro_batch
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return first, time.perf_counter() - start


def main(argv=None) -> dict:
    """Run the benchmark, print a table and the JSON line; returns the JSON object."""
    args = parse_args(argv)
    # Built once, outside the timed opens: the trainer builds its tokenizer apart from the loader too.
    args.tokenizer = bert_tokenizer() if args.span_corruption else None
    from libai_lite.data.build import open_indexed_dataset
    from libai_lite.data.gpt_dataset import token_id_range

    with tempfile.TemporaryDirectory(prefix="bench_data_loader_", dir=args.tmpdir) as tmp:
        cache_dir = os.path.join(tmp, "cache")
        if args.data_prefix is None:
            prefix = os.path.join(tmp, "synthetic_text_document")
            start = time.perf_counter()
            # Span corruption: ids of data_test's BERT vocabulary, below its sentinels.
            vocab = args.tokenizer.vocab_size - 100 if args.span_corruption else 50257
            info = write_synthetic(prefix, int(args.tokens), vocab=vocab)
            write_s = time.perf_counter() - start
            source = f"synthetic, {info['tokens'] / 1e6:.1f}M tokens in {info['documents']} documents"
            print(f"wrote {source} in {write_s:.1f}s")
        else:
            prefix = os.path.abspath(args.data_prefix)
            source = args.data_prefix
        indexed = open_indexed_dataset(prefix)
        total_tokens = int(np.asarray(indexed.sizes, dtype=np.int64).sum())
        from libai_lite.data.build import train_samples_per_epoch

        window = window_length(args)
        per_epoch = train_samples_per_epoch(prefix, "949,50,1", window)
        train_samples = max(per_epoch * args.epochs, args.samples + 2 * args.micro_batch)

        start = time.perf_counter()
        token_id_range(indexed, prefix, cache_dir)
        scan_s = time.perf_counter() - start
        start = time.perf_counter()
        loader = build_loaders(prefix, args, train_samples, cache_dir, 0)
        build_s = time.perf_counter() - start
        del loader
        start = time.perf_counter()
        loader = build_loaders(prefix, args, train_samples, cache_dir, 0)
        open_s = time.perf_counter() - start

        samples = min(args.samples, len(loader.batch_sampler) * args.micro_batch - args.micro_batch)
        # The loader's first batch is not timed (worker start-up), so the reference starts one batch in too.
        windows = loader.dataset.dataset if args.span_corruption else loader.dataset
        spans = sample_spans(windows, samples + args.micro_batch)[args.micro_batch:]
        del loader

        rows = []
        raw_s = []
        for w in args.workers:
            # The reference runs right before each loader measurement, so drifting load hits both.
            raw_s.append(raw_reads(indexed, spans, args.micro_batch))
            loader = build_loaders(prefix, args, train_samples, cache_dir, w)
            first, seconds = time_loader(loader, samples, args.micro_batch)
            del loader
            n = (samples // args.micro_batch) * args.micro_batch
            rows.append({"workers": w, "samples": n, "seconds": seconds, "first_batch_s": first,
                         "samples_per_s": n / seconds, "tokens_per_s": n * args.seq_length / seconds,
                         "raw_samples_per_s": n / raw_s[-1]})
        for r in rows:
            r["ratio_vs_raw"] = r["samples_per_s"] / r["raw_samples_per_s"]

    raw_best = max(r["raw_samples_per_s"] for r in rows)
    kind = f"span corruption, encoder {args.seq_length} from windows of {window}" if args.span_corruption else \
        f"seq {args.seq_length}"
    print(f"data: {source}; {kind}, micro batch {args.micro_batch}, {train_samples} train samples "
          f"({train_samples / per_epoch:.1f} epochs of the train split), {os.cpu_count()} CPUs")
    print(f"first open: token-id scan {scan_s:.2f}s + index build {build_s:.2f}s; second open (cache hit) "
          f"{open_s:.3f}s")
    print(f"{'workers':>7} {'samples/s':>10} {'tokens/s':>12} {'first batch s':>13} {'raw samples/s':>13} "
          f"{'vs raw':>7}")
    for r in rows:
        print(f"{r['workers']:>7} {r['samples_per_s']:>10.0f} {r['tokens_per_s']:>12.0f} {r['first_batch_s']:>13.3f} "
              f"{r['raw_samples_per_s']:>13.0f} {r['ratio_vs_raw']:>7.2f}")
    result = {
        "benchmark": "data_loader",
        "data": source,
        "tokens": total_tokens,
        "seq_length": args.seq_length,
        "span_corruption": args.span_corruption,
        "window": window,
        "micro_batch": args.micro_batch,
        "train_samples": train_samples,
        "train_samples_per_epoch": per_epoch,
        "token_scan_s": scan_s,
        "index_build_s": build_s,
        "index_open_s": open_s,
        "raw_samples_per_s": raw_best,
        "loaders": rows,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "date": datetime.date.today().isoformat(),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
