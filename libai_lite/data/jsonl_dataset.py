"""Perplexity data: a JSON-lines file (or a `.bin/.idx` prefix) cut into fixed-length windows.

Each document is tokenized, followed by the end-of-document id and preceded by BOS when the tokenizer
adds one, and the stream is cut into windows of `seq_length` input tokens. Every token after the first
is predicted exactly once: in consecutive windows by default, or, with `stride < seq_length`, in windows
every `stride` tokens that score only their last `stride` predictions, so each keeps at least
`seq_length - stride` tokens of context. Samples are the GPT loader's `{"input_ids", "labels"}`.

    dataloader.test = [LazyCall(build_ppl_eval_loader)(data_path="held_out.jsonl")]
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import torch

from .build import SPLIT_NAMES, get_train_valid_test_split, open_indexed_dataset
from .gpt_dataset import IGNORE_INDEX, check_id_range
from .samplers import PaddedEvalDataset, SequentialEvalSampler
from ..utils.errors import UsageError

logger = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json")


def is_jsonl_path(path) -> bool:
    """True for a JSON-lines file name (`.jsonl`/`.json`), False for a `.bin/.idx` prefix."""
    return os.fspath(path).endswith(JSONL_SUFFIXES)


def read_jsonl(path, json_key: str = "text") -> list[tuple[int, str]]:
    """`(line number, text)` for the `json_key` field of every non-blank line of a JSON-lines file.

    Raises a one-line UsageError for a missing or empty file, a line that is not a JSON object,
    and a line without the key or whose value is not a string.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise UsageError(f"data file {path} not found (relative paths start at {os.getcwd()}); "
                         f"give an existing JSON-lines file")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path} line {n} is not valid JSON ({e.msg}); "
                                 f"the file must hold one JSON object per line") from None
            if not isinstance(row, dict) or json_key not in row:
                keys = sorted(row) if isinstance(row, dict) else []
                raise UsageError(f"{path} line {n} has no '{json_key}' field (it has {keys}); "
                                 f"choose the field with --json-key (json_key= in a config)")
            value = row[json_key]
            if not isinstance(value, str):
                raise UsageError(f"{path} line {n}: '{json_key}' is a {type(value).__name__}, not a string")
            rows.append((n, value))
    if not rows:
        raise UsageError(f"{path} holds no documents; give a JSON-lines file with one "
                         f"{{\"{json_key}\": ...}} object per line")
    return rows


def read_jsonl_texts(path, json_key: str = "text") -> list[str]:
    """The `json_key` texts of a JSON-lines file (see `read_jsonl` for the errors)."""
    return [text for _, text in read_jsonl(path, json_key)]


def jsonl_token_stream(path, tokenizer, json_key: str = "text") -> np.ndarray:
    """Every document of a JSON-lines file tokenized, each followed by the tokenizer's EOD id, as one array.

    A document starts with the tokenizer's BOS when the tokenizer adds one (a Llama-family ``tokenizer.json``),
    as transformers' ``tokenizer(text)`` gives it and as those models were trained.
    """
    texts = read_jsonl_texts(path, json_key)
    eod = getattr(tokenizer, "eod_id", None)
    if eod is None:
        raise UsageError(f"{type(tokenizer).__name__} has no end-of-document id, which separates the "
                         f"documents of {path}; use a tokenizer with one (GPT-2 BPE, SentencePiece)")
    bos = (tokenizer.bos_token_id,) if tokenizer.add_bos_token else ()
    docs = tokenizer.encode_batch(texts)
    return np.fromiter((t for doc in docs for t in (*bos, *doc, eod)), dtype=np.int64,
                       count=sum(len(bos) + len(d) + 1 for d in docs))


def indexed_token_stream(data_prefix, split: str = "all", splits_string: str = "949,50,1") -> np.ndarray:
    """The tokens of a `.bin/.idx` prefix's documents in file order: all of them, or one split's.

    `split` is "all" or "train"/"valid"/"test" of `splits_string`, cut the way the GPT dataset
    cuts it (contiguous document ranges), so `test` is the same held-out documents training used.
    """
    ds = open_indexed_dataset(data_prefix)
    if split == "all":
        first, last = 0, ds.num_documents
    elif split in SPLIT_NAMES:
        i = SPLIT_NAMES.index(split)
        first, last = get_train_valid_test_split(splits_string, ds.num_documents)[i:i + 2]
    else:
        raise UsageError(f"split {split!r} is not one of all, train, valid, test")
    if last <= first:
        raise UsageError(f"the {split} split of {data_prefix} holds no documents (splits {splits_string!r}); "
                         f"choose another split or evaluate the whole file")
    return np.concatenate(ds[int(ds.doc_idx[first]):int(ds.doc_idx[last])]).astype(np.int64)


class TokenWindowDataset(torch.utils.data.Dataset):
    """Fixed-length `{"input_ids", "labels"}` windows over one token stream, each prediction scored once.

    Window `k` reads `tokens[k * stride : k * stride + seq_length + 1]`; after the first window
    only the last `stride` labels count (the rest are IGNORE_INDEX), and the last window is
    right-padded with `pad_id` inputs and IGNORE_INDEX labels.
    """

    def __init__(self, tokens, seq_length: int, stride: int | None = None, pad_id: int = 0):
        seq_length = int(seq_length)
        stride = seq_length if stride is None else int(stride)
        if seq_length < 1:
            raise UsageError(f"seq_length must be positive, got {seq_length}")
        if not 1 <= stride <= seq_length:
            raise UsageError(f"stride={stride} must lie in [1, seq_length={seq_length}]: windows that skip "
                             f"tokens would leave them unscored")
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.seq_length, self.stride, self.pad_id = seq_length, stride, int(pad_id)
        if self.tokens.size < 2:
            raise UsageError("the evaluation data holds fewer than two tokens: nothing to predict")
        self.num_windows = 1 + -(-max(self.num_predictions - seq_length, 0) // stride)

    def __len__(self) -> int:
        return self.num_windows

    @property
    def num_predictions(self) -> int:
        """Tokens scored over all windows: every token but the first."""
        return int(self.tokens.size - 1)

    @property
    def max_token_id(self) -> int:
        return int(self.tokens.max())

    @property
    def min_token_id(self) -> int:
        return int(self.tokens.min())

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < self.num_windows:
            raise IndexError(f"window {idx} out of range for {self.num_windows} windows")
        begin = idx * self.stride
        chunk = self.tokens[begin:begin + self.seq_length + 1]
        n = chunk.size - 1
        input_ids = torch.full((self.seq_length,), self.pad_id, dtype=torch.long)
        labels = torch.full((self.seq_length,), IGNORE_INDEX, dtype=torch.long)
        input_ids[:n] = torch.from_numpy(chunk[:-1])
        labels[:n] = torch.from_numpy(chunk[1:])
        if idx > 0:
            # Predictions up to the previous window's last one were scored there.
            labels[:self.seq_length - self.stride] = IGNORE_INDEX
        return {"input_ids": input_ids, "labels": labels}


def build_ppl_eval_dataset(data_path, seq_length: int, tokenizer=None, json_key: str = "text",
                           stride: int | None = None, split: str = "all", splits_string: str = "949,50,1",
                           vocab_size: int | None = None) -> TokenWindowDataset:
    """Windows over a JSON-lines file (tokenized with `tokenizer`) or a `.bin/.idx` prefix (`split` of it)."""
    if is_jsonl_path(data_path):
        if tokenizer is None:
            raise UsageError(f"{data_path} is JSON lines and needs a tokenizer; set tokenization.tokenizer")
        tokens = jsonl_token_stream(data_path, tokenizer, json_key)
        where = str(data_path)
    else:
        tokens = indexed_token_stream(data_path, split, splits_string)
        where = f"{data_path} ({split})"
    pad = getattr(tokenizer, "eod_id", None) or 0
    ds = TokenWindowDataset(tokens, seq_length, stride, pad_id=pad)
    if vocab_size is not None:
        check_id_range(data_path, ds.min_token_id, ds.max_token_id, vocab_size)
    logger.info(f"Perplexity data {where}: {tokens.size} tokens in {len(ds)} windows of {ds.seq_length} "
                f"(stride {ds.stride})")
    return ds


def build_ppl_eval_loader(data_path, seq_length: int | None = None, json_key: str = "text",
                          stride: int | None = None, split: str = "all", splits_string: str = "949,50,1",
                          num_workers: int = 0, *, tokenizer=None, micro_batch_size: int,
                          data_parallel_rank: int = 0, data_parallel_size: int = 1,
                          batches_multiple_of: int = 1, vocab_size: int | None = None):
    """A loader over `build_ppl_eval_dataset`'s windows that scores each prediction once on one rank.

    Every data-parallel rank gets the same number of equally shaped batches (the last global
    batch is padded with all-IGNORE_INDEX samples, which perplexity does not count); with
    `batches_multiple_of` > 1 the count is rounded up to a multiple of it (a pipeline schedule
    evaluates that many micro-batches at once). The run-time keyword arguments are what the
    trainer fills in.
    """
    if seq_length is None:
        raise UsageError(f"no sequence length for the perplexity windows of {data_path}; set seq_length")
    ds = build_ppl_eval_dataset(data_path, int(seq_length), tokenizer, json_key, stride, split, splits_string,
                                vocab_size)
    group = int(micro_batch_size) * int(data_parallel_size) * max(int(batches_multiple_of), 1)
    total = -(-len(ds) // group) * group
    padded = PaddedEvalDataset(ds, len(ds))
    sampler = SequentialEvalSampler(total, 0, int(micro_batch_size), int(data_parallel_rank),
                                    int(data_parallel_size), drop_last=False)
    return torch.utils.data.DataLoader(padded, batch_sampler=sampler, num_workers=int(num_workers),
                                       pin_memory=torch.cuda.is_available())
