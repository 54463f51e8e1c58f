#!/usr/bin/env python
"""Throughput of ``tools/preprocess_data.py``: documents, MB and tokens per second, beside same-job references.

    python bench/preprocess.py                  # 50 MB, 1 and 2 workers, GPT-2 BPE, WordPiece, SentencePiece
    python bench/preprocess.py --corpus-mb 200 --workers 1 2 4
    python bench/preprocess.py --megatron /tmp/megatron --workers 2 --no-naive   # beside Megatron-LM's tool

The last line of the output is one JSON object with the numbers.
The references and the MB/s columns: bench/README.md, section "preprocess.py: how it measures".
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_CORPUS = os.path.join(ROOT, "data_test", "corpus.jsonl")
TOKENIZERS = {
    "gpt2": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "data_test/gpt2/vocab.json",
             "--merge-file", "data_test/gpt2/merges.txt"],
    "bert": ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", "data_test/bert/vocab.txt"],
    "spm": ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "data_test/spm/spiece.model"],
}
# ../shared/fixtures/README.md: Megatron-LM's tools/preprocess_data.py, GPT-2 BPE, --workers 2,
# on a 2-core machine. A recorded number, not a run in this job.
MEGATRON_RECORDED_MB_S = 1.8
MEGATRON_RECORDED = dict(tokenizer="gpt2", workers=2)
_DONE = re.compile(r"done: (\d+) documents, (\d+) tokens, ([\d.]+) MB in ([\d.]+) s .*, ([\d.]+) CPU-seconds")


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options; see ``--help``."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus-mb", type=float, default=50.0, help="corpus size in MB (default 50)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts (default 1 2)")
    p.add_argument("--tokenizers", nargs="+", choices=sorted(TOKENIZERS),
                   default=["gpt2", "bert", "spm"])
    p.add_argument("--no-naive", action="store_true", help="skip the naive single-process reference")
    p.add_argument("--tmpdir", default=None, help="where the corpus and outputs go (default: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="a ~1 MB corpus: checks the script runs")
    p.add_argument("--megatron", metavar="DIR", default=None,
                   help="a Megatron-LM checkout: run its tools/preprocess_data.py on the same corpus with the same "
                        "flags beside ours, print the ratio of their wall times and check the outputs are "
                        "byte-identical")
    args = p.parse_args(argv)
    if args.smoke:
        args.corpus_mb = 1.0
    if args.corpus_mb <= 0 or any(w < 1 for w in args.workers):
        p.error("--corpus-mb must be > 0 and --workers >= 1")
    if args.megatron is not None and not os.path.isfile(os.path.join(args.megatron, "tools", "preprocess_data.py")):
        p.error(f"--megatron {args.megatron}: no tools/preprocess_data.py there; pass a Megatron-LM checkout")
    return args


def make_corpus(path: str, target_mb: float) -> dict:
    """Write ``data_test/corpus.jsonl`` repeated (cut at a line) until it reaches ``target_mb`` MB."""
    with open(SOURCE_CORPUS, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    target = int(target_mb * 1e6)
    size = docs = 0
    with open(path, "wb") as out:
        while size < target:
            for line in lines:
                out.write(line)
                size += len(line)
                docs += 1
                if size >= target:
                    break
    return {"bytes": size, "documents": docs}


def count_tokens(prefix: str) -> int:
    """Tokens in a ``.bin/.idx`` pair, from its index."""
    from libai_lite.data.indexed_dataset import MMapIndexedDataset

    return int(np.asarray(MMapIndexedDataset(prefix).sizes, dtype=np.int64).sum())


def run_tool(corpus: str, out_prefix: str, tokenizer: str, workers: int, append_eod: bool = True) -> dict:
    """Run tools/preprocess_data.py once; the tool's own rates and the end-to-end ones.

    The tool prints its time to 0.01 s; MB is taken from the corpus file, exactly.
    """
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus,
           "--output-prefix", out_prefix, "--json-keys", "text", "--workers", str(workers),
           "--log-interval", str(10**9), *TOKENIZERS[tokenizer]] + (["--append-eod"] if append_eod else [])
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    m = _DONE.search(proc.stdout)
    if m is None:
        raise RuntimeError(f"no 'done:' line in the tool's output: {proc.stdout[-500:]}")
    docs, tokens, seconds, cpu = int(m[1]), int(m[2]), max(float(m[4]), 0.01), max(float(m[5]), 0.01)
    mb = os.path.getsize(corpus) / 1e6
    if tokens != count_tokens(f"{out_prefix}_text_document"):
        raise RuntimeError("the tool's token count does not match the .idx it wrote")
    return {"documents": docs, "tokens": tokens, "mb": mb, "seconds": seconds, "wall_seconds": wall,
            "docs_per_s": docs / seconds, "mb_per_s": mb / seconds, "tokens_per_s": tokens / seconds,
            "wall_mb_per_s": mb / wall, "cpu_seconds": cpu, "mb_per_cpu_s": mb / cpu}


def run_megatron(megatron: str, corpus: str, out_prefix: str, tokenizer: str, workers: int,
                 append_eod: bool = True) -> dict:
    """Run Megatron-LM's own tools/preprocess_data.py once with our flags; its wall time (start-up included,
    as for ours in ``wall_seconds``)."""
    flags = [os.path.join(ROOT, f) if f.startswith("data_test/") else f for f in TOKENIZERS[tokenizer]]
    cmd = [sys.executable, os.path.join(megatron, "tools", "preprocess_data.py"), "--input", corpus,
           "--output-prefix", out_prefix, "--json-keys", "text", "--workers", str(workers),
           "--log-interval", str(10**9), *flags] + (["--append-eod"] if append_eod else [])
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=megatron, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    mb = os.path.getsize(corpus) / 1e6
    return {"documents": None, "tokens": count_tokens(f"{out_prefix}_text_document"), "mb": mb,
            "seconds": wall, "wall_seconds": wall, "mb_per_s": mb / wall, "wall_mb_per_s": mb / wall}


def _build(tokenizer: str):
    from libai_lite.tokenizer import build_tokenizer

    flags = TOKENIZERS[tokenizer]
    kwargs = {"tokenizer_type": flags[1]}
    for flag, key in (("--vocab-file", "vocab_file"), ("--merge-file", "merge_file"),
                      ("--tokenizer-model", "tokenizer_model")):
        if flag in flags:
            kwargs[key] = os.path.join(ROOT, flags[flags.index(flag) + 1])
    return build_tokenizer(**kwargs)


def run_encode_batch(corpus: str, tokenizer: str) -> dict:
    """The library's own batched encoder on the parsed texts, all cores: the tokenizer's floor.

    Only the encode call is timed (no JSON, no writing), in batches of 1,000 texts so that
    memory stays modest while every call is large enough for the thread pool.
    """
    tok = _build(tokenizer)
    with open(corpus, "rb") as f:
        texts = [json.loads(line)["text"] for line in f]
    mb = os.path.getsize(corpus) / 1e6
    if hasattr(tok, "sp"):
        threads = os.cpu_count() or 1

        def encode(batch):
            return tok.sp.encode(batch, out_type=int, num_threads=threads)
    else:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)

        def encode(batch):
            return tok._tok.encode_batch_fast(batch, add_special_tokens=False)
    tokens = 0
    start, cpu0 = time.perf_counter(), time.process_time()
    for i in range(0, len(texts), 1000):
        tokens += sum(len(e if isinstance(e, list) else e.ids) for e in encode(texts[i:i + 1000]))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0  # cpu: all its threads
    return {"documents": len(texts), "tokens": tokens, "mb": mb, "seconds": seconds,
            "docs_per_s": len(texts) / seconds, "mb_per_s": mb / seconds, "tokens_per_s": tokens / seconds,
            "cpu_seconds": cpu, "mb_per_cpu_s": mb / cpu}


def same_bytes(prefix_a: str, prefix_b: str) -> bool:
    """Whether two ``.bin/.idx`` pairs are byte-identical."""
    for ext in (".bin", ".idx"):
        with open(prefix_a + ext, "rb") as a, open(prefix_b + ext, "rb") as b:
            if a.read() != b.read():
                return False
    return True


def run_naive(corpus: str, out_prefix: str, tokenizer: str, append_eod: bool = True) -> dict:
    """The reference loop: one process, ``tokenizer.encode`` per document, one builder."""
    from libai_lite.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype

    tok = _build(tokenizer)
    builder = MMapIndexedDatasetBuilder(f"{out_prefix}_text_document", dtype=best_fitting_dtype(tok.vocab_size))
    docs = tokens = nbytes = 0
    start = time.perf_counter()
    with open(corpus, "rb") as f:
        for line in f:
            nbytes += len(line)
            ids = tok.encode(json.loads(line)["text"])
            if ids:
                if append_eod:
                    ids.append(tok.eod_id)
                builder.add_item(ids)
            builder.end_document()
            docs += 1
            tokens += len(ids)
    builder.finalize()
    seconds = time.perf_counter() - start
    mb = nbytes / 1e6
    return {"documents": docs, "tokens": tokens, "mb": mb, "seconds": seconds,
            "docs_per_s": docs / seconds, "mb_per_s": mb / seconds, "tokens_per_s": tokens / seconds}


class _ProgressRows(list):
    """The result rows; each is echoed to stderr when it lands, so a long run shows its progress."""

    def append(self, row: dict) -> None:
        super().append(row)
        print(f"  {row['tokenizer']} {row['impl']} workers={row['workers']}: {row['mb_per_s']:.2f} MB/s",
              file=sys.stderr, flush=True)


def main(argv=None) -> dict:
    """Run the benchmark, print a table and the JSON line; returns the JSON object."""
    args = parse_args(argv)
    rows = _ProgressRows()
    with tempfile.TemporaryDirectory(prefix="bench_preprocess_", dir=args.tmpdir) as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        info = make_corpus(corpus, args.corpus_mb)
        print(f"corpus: {info['bytes'] / 1e6:.1f} MB, {info['documents']} documents "
              f"(data_test/corpus.jsonl repeated), {os.cpu_count()} CPUs, load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (others' work slows MB/s, not MB/CPU-s)")
        for tok in args.tokenizers:
            # BERT has no end-of-document token of its own ([SEP] stands in): Megatron's BERT
            # corpora are made without --append-eod.
            eod = tok != "bert"
            floor = run_encode_batch(corpus, tok)
            rows.append({"tokenizer": tok, "workers": os.cpu_count(), "impl": "encode_batch (same job)", **floor})
            naive = None
            if not args.no_naive:
                naive = run_naive(corpus, os.path.join(tmp, f"naive_{tok}"), tok, eod)
                rows.append({"tokenizer": tok, "workers": 1, "impl": "naive loop (same job)", **naive})
            for w in args.workers:
                out = os.path.join(tmp, f"tool_{tok}_{w}")
                res = run_tool(corpus, out, tok, w, eod)
                row = {"tokenizer": tok, "workers": w, "impl": "tools/preprocess_data.py", **res,
                       "ratio_vs_encode_batch": res["mb_per_s"] / floor["mb_per_s"],
                       "cpu_ratio_vs_encode_batch": res["mb_per_cpu_s"] / floor["mb_per_cpu_s"]}
                if naive is not None:
                    row["ratio_vs_naive"] = res["mb_per_s"] / naive["mb_per_s"]
                    row["identical_to_naive"] = same_bytes(f"{out}_text_document",
                                                           os.path.join(tmp, f"naive_{tok}_text_document"))
                    if not row["identical_to_naive"]:
                        raise RuntimeError(f"{tok}, {w} worker(s): the tool's .bin/.idx differ from the naive loop's")
                if args.megatron is not None:
                    mout = os.path.join(tmp, f"megatron_{tok}_{w}")
                    mrow = run_megatron(args.megatron, corpus, mout, tok, w, eod)
                    mrow["docs_per_s"], mrow["tokens_per_s"] = res["documents"] / mrow["seconds"], \
                        mrow["tokens"] / mrow["seconds"]
                    rows.append({"tokenizer": tok, "workers": w, "impl": "Megatron-LM (same job)", **mrow})
                    row["ratio_vs_megatron"] = mrow["wall_seconds"] / res["wall_seconds"]
                    row["identical_to_megatron"] = same_bytes(f"{out}_text_document", f"{mout}_text_document")
                    for ext in (".bin", ".idx"):
                        os.remove(f"{mout}_text_document{ext}")
                for ext in (".bin", ".idx"):
                    os.remove(f"{out}_text_document{ext}")
                if tok == MEGATRON_RECORDED["tokenizer"] and w == MEGATRON_RECORDED["workers"]:
                    row["ratio_vs_megatron_recorded"] = res["mb_per_s"] / MEGATRON_RECORDED_MB_S
                rows.append(row)

    print(f"{'tokenizer':<9} {'workers':>7} {'impl':<26} {'docs/s':>9} {'MB/s':>7} {'tokens/s':>10} "
          f"{'MB/s e2e':>8} {'vs naive':>8} {'vs encode_batch':>15} {'MB/CPU-s':>8} {'CPU vs eb':>9} "
          f"{'identical':>9}")
    for r in rows:
        e2e = f"{r['wall_mb_per_s']:.2f}" if "wall_mb_per_s" in r else "-"
        vs = f"{r['ratio_vs_naive']:.2f}x" if "ratio_vs_naive" in r else "-"
        e2e = f"{e2e} ({r['ratio_vs_megatron']:.1f}x M)" if "ratio_vs_megatron" in r else e2e
        vs_eb = f"{r['ratio_vs_encode_batch']:.2f}x" if "ratio_vs_encode_batch" in r else "-"
        per_cpu = f"{r['mb_per_cpu_s']:.2f}" if "mb_per_cpu_s" in r else "-"
        cpu_eb = f"{r['cpu_ratio_vs_encode_batch']:.2f}x" if "cpu_ratio_vs_encode_batch" in r else "-"
        same = {True: "yes", False: "NO"}.get(r.get("identical_to_naive", r.get("identical_to_megatron")), "-")
        print(f"{r['tokenizer']:<9} {r['workers']:>7} {r['impl']:<26} {r['docs_per_s']:>9.0f} "
              f"{r['mb_per_s']:>7.2f} {r['tokens_per_s']:>10.0f} {e2e:>8} {vs:>8} {vs_eb:>15} {per_cpu:>8} "
              f"{cpu_eb:>9} {same:>9}")
    for r in rows:
        if "ratio_vs_megatron" in r:
            same = "byte-identical" if r["identical_to_megatron"] else "OUTPUTS DIFFER"
            print(f"{r['tokenizer']}, {r['workers']} worker(s): {r['ratio_vs_megatron']:.2f}x Megatron-LM's "
                  f"tools/preprocess_data.py (wall, same corpus, same job), {same}")
    mega = [r for r in rows if "ratio_vs_megatron_recorded" in r]
    for r in mega:
        print(f"GPT-2 BPE, 2 workers: {r['mb_per_s']:.2f} MB/s = {r['ratio_vs_megatron_recorded']:.2f}x the "
              f"RECORDED Megatron-LM figure of {MEGATRON_RECORDED_MB_S} MB/s (../shared/fixtures/README.md; "
              f"not run in this job, other corpus)")
    result = {
        "benchmark": "preprocess",
        "load_average": os.getloadavg(),
        "corpus_mb": info["bytes"] / 1e6,
        "corpus_documents": info["documents"],
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "rows": list(rows),
        "megatron": args.megatron,
        "load_average_end": os.getloadavg(),
        "megatron_recorded_mb_per_s": MEGATRON_RECORDED_MB_S,
        "ratio_vs_megatron_recorded": mega[0]["ratio_vs_megatron_recorded"] if mega else None,
        "date": datetime.date.today().isoformat(),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
