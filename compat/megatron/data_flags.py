"""The data and tokenizer flags of a Megatron-style command line: the corpus, its split and its tokenizer
(named by the flags, or by the tokenizer record ``tools/preprocess_data.py`` writes beside the corpus)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from .flags import _TOKENIZERS, Call, _int, _num, _Reader, _require
from .run import MegatronRun

__all__ = ["data_and_tokenizer"]


def data_and_tokenizer(run: MegatronRun, read: _Reader, corpus_record: Callable[[str], Optional[dict]]) -> None:
    """``--data-path``/``--split`` and the tokenizer flags; with no tokenizer flag, the corpus's tokenizer record."""
    a, problems = run.assignments, read.problems
    if _require(read, "--data-path"):
        paths = read.given["--data-path"]
        if len(paths) == 1:
            a["dataloader.train.data_prefix"] = paths[0]
        elif len(paths) % 2 == 0:
            try:
                a["dataloader.train.data_prefix"] = [_num(p) if i % 2 == 0 else p for i, p in enumerate(paths)]
            except ValueError:
                problems.add("--data-path", "several paths take a weight each: W1 PREFIX1 W2 PREFIX2 ...")
        else:
            problems.add("--data-path", "several paths take a weight each: W1 PREFIX1 W2 PREFIX2 ...")
    if "--split" in read.given:
        a["dataloader.train.splits_string"] = "".join(read.given["--split"]).strip("'\"").replace(" ", "")
    kind = read.one("--tokenizer-type")
    if kind is None and "--vocab-file" in read.given and "--merge-file" in read.given:
        kind = "GPT2BPETokenizer"
    vocab = read.one("--vocab-size", _int)
    if kind is None and not any(f in read.given for f in ("--vocab-file", "--merge-file", "--tokenizer-model")):
        prefix = a.get("dataloader.train.data_prefix")
        if isinstance(prefix, str) and _recorded_tokenizer(run, read, corpus_record(prefix), prefix, vocab):
            return
    if vocab is not None:
        run.no_effect.append("--vocab-size (the vocabulary is the tokenizer's, padded by "
                             "--make-vocab-size-divisible-by)")
    if kind is None:
        problems.add("--tokenizer-type", "missing: pretrain_gpt.py needs it too, and no tokenizer record beside "
                     "--data-path names one; for GPT-2's BPE (OneFlow-GPT's corpora) give --vocab-file "
                     "gpt2-vocab.json --merge-file gpt2-merges.txt")
        return
    if kind not in _TOKENIZERS:
        fix = ("no synthetic data here: preprocess a corpus with tools/preprocess_data.py and pass --data-path"
               if kind == "NullTokenizer" else
               f"not built here; the tokenizers taken are {', '.join(_TOKENIZERS)} (HuggingFaceTokenizer reads the "
               f"model's tokenizer.json from --tokenizer-model DIR)")
        problems.add(f"--tokenizer-type {kind}", fix)
        return
    if kind == "GPT2BPETokenizer":
        args = {"vocab_file": ("--vocab-file", "vocab_file"), "merges_file": ("--merge-file", "merges_file")}
    elif kind.startswith("Bert"):
        args = {"vocab_file": ("--vocab-file", "vocab_file")}
    elif kind == "HuggingFaceTokenizer":
        args = {"path": ("--tokenizer-model", "path")}
    else:
        args = {"model_file": ("--tokenizer-model", "model_file")}
    kwargs = {}
    for arg, (flag, _) in args.items():
        value = read.one(flag)
        if value is None:
            problems.add(flag, f"missing: --tokenizer-type {kind} reads it")
        kwargs[arg] = value
    if kind.startswith("Bert"):
        kwargs["do_lower_case"] = kind == "BertWordPieceLowerCase"
    a["tokenization.tokenizer"] = Call(_TOKENIZERS[kind], kwargs)


# A tokenizer record's file attributes -> the tokenizer's arguments, where they differ.
_RECORD_ARGS = {"tokenizer_file": "path"}


def _recorded_tokenizer(run: MegatronRun, read: _Reader, record: Optional[dict], prefix: str,
                        vocab: Optional[int]) -> bool:
    """Whether the tokenizer the corpus at ``prefix`` was made with (its ``record``) is this run's."""
    kind = (record or {}).get("tokenizer_type")
    if kind not in _TOKENIZERS:
        return False
    kwargs: Dict[str, Any] = {_RECORD_ARGS.get(k, k): v for k, v in (record.get("files") or {}).items()}
    if kind.startswith("Bert"):
        kwargs["do_lower_case"] = kind == "BertWordPieceLowerCase"
    run.assignments["tokenization.tokenizer"] = Call(_TOKENIZERS[kind], kwargs)
    size = record.get("vocab_size")
    if vocab is not None and size is not None and vocab != size:
        read.problems.add("--vocab-size", f"{vocab}, but the corpus {prefix} was made with a tokenizer of {size} "
                          f"tokens ({kind}, {prefix}.tokenizer.json): give {size} or drop it")
    elif vocab is not None:
        run.no_effect.append(f"--vocab-size (the tokenizer is the one {prefix} was made with, {kind} of "
                             f"{size} tokens, padded by --make-vocab-size-divisible-by)")
    else:
        run.no_effect.append(f"--data-path (no tokenizer flag: the tokenizer is the one {prefix} was made "
                             f"with, {kind})")
    return True
