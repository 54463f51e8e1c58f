"""T5/mT5 span-corruption pretraining data over Megatron ``.bin/.idx`` files (projects/MT5/README.md,
"What a sample is", has the whole format).

A split's documents form one token stream cut into disjoint windows of ``raw_length`` tokens (T5's
``random_spans_helper``: the longest window whose corrupted input fits ``max_seq_length``; 568 for 512 at
15% noise, mean span 3) by the GPT dataset's cached indices; document ends are dropped; sentence
boundaries play no part, as in the T5 paper. ``random_spans_noise_mask`` draws the spans from
``numpy.random.default_rng((seed, index))``, so a sample depends only on the seed and its index. Span
``k`` becomes sentinel ``<extra_id_k>`` in the encoder input; labels are ``<extra_id_0> span_0 ... EOS``;
the decoder input is the labels shifted right behind the tokenizer's decoder start. A data id that is one
of the tokenizer's sentinels is refused, never read as one.
"""
from __future__ import annotations

import math
from collections import abc

import numpy as np
import torch

from libai_lite.data.build import (
    build_gpt_train_valid_test_datasets,
    build_loaders_for_datasets,
    check_num_samples,
    train_samples_per_epoch,
)
from libai_lite.data.gpt_dataset import IGNORE_INDEX
from libai_lite.data.packing import check_eod_token_id
from libai_lite.utils.errors import UsageError


# ----------------------------------------------------------------------------------------------
# T5's span arithmetic
# ----------------------------------------------------------------------------------------------
def _check_span_args(noise_density, mean_noise_span_length) -> None:
    if not (isinstance(noise_density, (int, float)) and 0.0 < noise_density < 1.0):
        raise UsageError(f"masked_lm_prob (noise density) must lie in (0, 1), got {noise_density!r}; "
                         f"T5 uses 0.15")
    if not (isinstance(mean_noise_span_length, (int, float)) and math.isfinite(mean_noise_span_length)
            and mean_noise_span_length >= 1.0):
        raise UsageError(f"mean_span_length must be a number >= 1, got {mean_noise_span_length!r}; T5 uses 3.0")


def _span_counts(length: int, noise_density: float, mean_noise_span_length: float) -> tuple:
    """``(num_noise_tokens, num_noise_spans)`` for ``length`` tokens, exactly as T5 rounds them."""
    length = max(int(length), 2)
    num_noise = int(np.round(length * noise_density))
    num_noise = min(max(num_noise, 1), length - 1)
    num_spans = max(int(np.round(num_noise / mean_noise_span_length)), 1)
    # T5 itself breaks here (more spans than kept tokens to separate them); only extreme
    # densities get here, and capping keeps every span separated by at least one kept token.
    num_spans = min(num_spans, length - num_noise)
    return num_noise, num_spans


def random_spans_helper(inputs_length: int = 512, noise_density: float = 0.15,
                        mean_noise_span_length: float = 3.0) -> tuple:
    """T5's ``random_spans_helper``: ``(raw_length, targets_length)`` for an encoder of ``inputs_length``.

    ``raw_length`` is the longest token window whose corruption (kept tokens, one sentinel per
    noise span, one EOS) is at most ``inputs_length`` tokens; ``targets_length`` counts the
    noise tokens, one sentinel per span and EOS. ``(512, 0.15, 3.0) -> (568, 114)``.
    """
    _check_span_args(noise_density, mean_noise_span_length)
    if int(inputs_length) < 2:
        raise UsageError(f"max_seq_length must be >= 2 (room for one token and EOS), got {inputs_length}")
    inputs_length = int(inputs_length)

    def lengths(tokens_length: int) -> tuple:
        num_noise, num_spans = _span_counts(tokens_length, noise_density, mean_noise_span_length)
        return tokens_length - num_noise + num_spans + 1, num_noise + num_spans + 1

    tokens_length = inputs_length - 1
    while lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    _, targets_length = lengths(tokens_length)
    # T5's own adjustment: at 50% noise keep the targets no longer than the inputs.
    if noise_density == 0.5 and targets_length > inputs_length:
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, targets_length


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Lengths of ``num_segments`` non-empty segments of ``num_items``, all cuts equally likely."""
    first_in_segment = np.zeros(num_items, dtype=np.int64)
    first_in_segment[1:] = rng.permutation(num_items - 1) < num_segments - 1
    return np.bincount(np.cumsum(first_in_segment), minlength=num_segments)


def random_spans_noise_mask(length: int, noise_density: float, mean_noise_span_length: float,
                            rng: np.random.Generator) -> np.ndarray:
    """T5's ``random_spans_noise_mask``: a bool array of ``length``, True at noise (masked) tokens.

    Alternates kept and noise spans, starting with kept tokens and ending with noise; span
    lengths are random segmentations of the kept and noise token counts.
    """
    if length < 1:
        raise ValueError(f"cannot mask an empty sequence (length {length})")
    num_noise, num_spans = _span_counts(length, noise_density, mean_noise_span_length)
    padded_length = max(length, 2)
    noise_lengths = _random_segmentation(num_noise, num_spans, rng)
    kept_lengths = _random_segmentation(padded_length - num_noise, num_spans, rng)
    interleaved = np.stack([kept_lengths, noise_lengths], axis=1).reshape(-1)
    span_index = np.repeat(np.arange(interleaved.size), interleaved)
    return (span_index % 2 == 1)[:length]


# ----------------------------------------------------------------------------------------------
# Tokenizer ids
# ----------------------------------------------------------------------------------------------
def _resolve_tokenizer(tokenizer):
    """A tokenizer object, or a LazyCall/``_target_`` mapping that builds one."""
    if isinstance(tokenizer, abc.Mapping) and "_target_" in tokenizer:
        from libai_lite.config import instantiate

        tokenizer = instantiate(tokenizer)
    if tokenizer is None or not hasattr(tokenizer, "additional_special_tokens_ids"):
        raise UsageError(f"the T5 dataset needs a tokenizer with sentinel tokens, got {type(tokenizer).__name__}: "
                         f"pass tokenizer='${{tokenization.tokenizer}}' (e.g. BertTokenizer(vocab_file, "
                         f"vocab_extra_ids=100) or SentencePieceTokenizer(model_file, extra_ids=100))")
    return tokenizer


def t5_special_ids(tokenizer, eod_token_id: int | None = None) -> dict:
    """``pad``, ``eos``, ``decoder_start``, ``sentinels`` and ``eod`` (dropped) ids of ``tokenizer`` (None if absent).

    The decoder starts with pad for a ``style="t5"`` SentencePiece tokenizer (Hugging Face T5/mT5)
    and with the tokenizer's bos otherwise (``[BOS]`` for BERT vocabularies, as LiBai and
    Megatron-LM do). ``eod_token_id`` overrides the tokenizer's ``eod_id`` as the document-end id
    dropped from the data.
    """
    tokenizer = _resolve_tokenizer(tokenizer)
    name = type(tokenizer).__name__
    pad, eos, bos = tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id
    if getattr(tokenizer, "style", None) == "t5" or bos is None:
        start = pad
    else:
        start = bos
    eod = tokenizer.eod_id if eod_token_id is None else int(eod_token_id)
    sentinels = np.asarray(list(tokenizer.additional_special_tokens_ids), dtype=np.int64)
    return {"pad": pad, "eos": eos, "decoder_start": start, "sentinels": sentinels,
            "eod": None if eod is None else int(eod), "tokenizer_name": name}


# ----------------------------------------------------------------------------------------------
# The dataset
# ----------------------------------------------------------------------------------------------
class T5Dataset(torch.utils.data.Dataset):
    """Span-corrupted T5 samples from a dataset of token windows.

    ``dataset[i]["input_ids"]`` must be ``raw_length`` tokens (a ``GPTDataset`` or
    ``BlendableDataset`` built with ``seq_length=raw_length``; see ``build_t5_train_valid_test_datasets``).
    ``max_seq_length_dec`` defaults to the computed targets length and may be larger (more
    padding), never smaller. ``len(self) == len(dataset)``; see the module docstring for the
    sample format.
    """

    def __init__(self, dataset, tokenizer, max_seq_length: int = 512, max_seq_length_dec: int | None = None,
                 masked_lm_prob: float = 0.15, mean_span_length: float = 3.0, seed: int = 1234,
                 eod_token_id: int | None = None):
        raw_length, targets_length = random_spans_helper(max_seq_length, masked_lm_prob, mean_span_length)
        if max_seq_length_dec is None:
            max_seq_length_dec = targets_length
        elif int(max_seq_length_dec) < targets_length:
            raise UsageError(
                f"max_seq_length_dec={max_seq_length_dec} is too short: {max_seq_length} encoder tokens at "
                f"masked_lm_prob={masked_lm_prob}, mean_span_length={mean_span_length} give {targets_length} "
                f"label tokens; set max_seq_length_dec={targets_length} or null (computed)")
        ids = t5_special_ids(tokenizer, eod_token_id)
        _, max_spans = _span_counts(raw_length, masked_lm_prob, mean_span_length)
        if ids["sentinels"].size < max_spans:
            raise UsageError(
                f"{ids['tokenizer_name']} has {ids['sentinels'].size} sentinel ids but samples of "
                f"{max_seq_length} tokens need up to {max_spans} (<extra_id_0> ... <extra_id_{max_spans - 1}>): "
                f"build it with vocab_extra_ids=100 (BertTokenizer) or extra_ids=100 (SentencePieceTokenizer)")
        for what in ("pad", "eos"):
            if ids[what] is None:
                raise UsageError(f"{ids['tokenizer_name']} has no {what} token; the T5 dataset pads with pad and "
                                 f"ends the encoder input and labels with eos: use a BertTokenizer or a "
                                 f"SentencePiece model trained with pad and eos ids")
        self.dataset = dataset
        self.max_seq_length = int(max_seq_length)
        self.max_seq_length_dec = int(max_seq_length_dec)
        self.raw_length = raw_length
        self.masked_lm_prob = float(masked_lm_prob)
        self.mean_span_length = float(mean_span_length)
        self.seed = int(seed)
        self.pad_id = int(ids["pad"])
        self.eos_id = int(ids["eos"])
        self.decoder_start_id = int(ids["decoder_start"])
        self.eod_id = ids["eod"]
        self.sentinel_ids = ids["sentinels"]
        self.tokenizer_name = ids["tokenizer_name"]
        self._sentinel_position = {int(s): k for k, s in enumerate(self.sentinel_ids)}
        lo, hi = int(self.sentinel_ids.min()), int(self.sentinel_ids.max())
        # Every tokenizer here appends its sentinels as one block of ids; a range test is then
        # exact and much cheaper than a set lookup per token.
        self._sentinel_range = (lo, hi) if hi - lo + 1 == self.sentinel_ids.size else None
        self.check_data_ids()

    # -- checks --------------------------------------------------------------------------------
    def _members(self) -> list:
        return list(getattr(self.dataset, "datasets", None) or [self.dataset])

    def _sentinel_name(self, token: int) -> str:
        return f"<extra_id_{self._sentinel_position[int(token)]}>"

    def _sentinel_clash(self, token: int, where: str) -> UsageError:
        hint = ""
        if self.tokenizer_name == "SentencePieceTokenizer":
            hint = (f"; data preprocessed with a Megatron-style SentencePiece tokenizer ends documents with "
                    f"<EOD> ({token} here?): set eod_token_id={token} to drop it")
        return UsageError(
            f"{where} holds token id {token}, which {self.tokenizer_name} uses for sentinel "
            f"{self._sentinel_name(token)}: the data was tokenized with another vocabulary or convention; "
            f"re-run tools/preprocess_data.py with this tokenizer{hint}")

    def check_data_ids(self) -> None:
        """Refuse, up front, data whose largest id is one of the sentinels (and not the dropped eod)."""
        for ds in self._members():
            hi = getattr(ds, "max_token_id", None)
            if hi is not None and hi != self.eod_id and int(hi) in self._sentinel_position:
                raise self._sentinel_clash(int(hi), getattr(ds, "data_prefix", "the data"))

    # -- samples -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.dataset)

    def raw_tokens(self, idx: int) -> np.ndarray:
        """The window of sample ``idx`` with document-end tokens dropped (what gets corrupted)."""
        window = self.dataset[idx]["input_ids"]
        tokens = window.numpy() if isinstance(window, torch.Tensor) else np.asarray(window)
        if tokens.size != self.raw_length:
            raise RuntimeError(f"the token dataset gives {tokens.size} tokens per sample, the T5 dataset needs "
                               f"{self.raw_length}: build it with seq_length={self.raw_length}")
        if self.eod_id is not None:
            tokens = tokens[tokens != self.eod_id]
        tokens = tokens.astype(np.int64, copy=False)
        if self._sentinel_range is not None:
            clash = (tokens >= self._sentinel_range[0]) & (tokens <= self._sentinel_range[1])
        else:
            clash = np.isin(tokens, self.sentinel_ids)
        if clash.any():
            where = f"sample {idx} of {getattr(self.dataset, 'data_prefix', 'the data')}"
            raise self._sentinel_clash(int(tokens[np.argmax(clash)]), where)
        return tokens

    def noise_mask(self, idx: int, length: int) -> np.ndarray:
        """The noise mask of sample ``idx``: a function of ``(seed, idx)`` and ``length`` only."""
        rng = np.random.default_rng((self.seed, int(idx)))
        return random_spans_noise_mask(length, self.masked_lm_prob, self.mean_span_length, rng)

    def __getitem__(self, idx: int) -> dict:
        idx = int(idx)
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        tokens = self.raw_tokens(idx)
        if tokens.size == 0:
            raise RuntimeError(f"sample {idx} holds only document-end tokens ({self.eod_id}); the corpus "
                               f"has runs of empty documents longer than {self.raw_length} tokens")
        noise = self.noise_mask(idx, tokens.size)
        span_start = noise & ~np.concatenate(([False], noise[:-1]))
        num_spans = int(span_start.sum())
        sentinels = self.sentinel_ids[:num_spans]

        # Encoder: kept tokens, each noise span collapsed to its sentinel, then EOS.
        encoder = tokens.copy()
        encoder[span_start] = sentinels
        encoder = encoder[~noise | span_start]
        # Labels: each span behind its sentinel, then EOS.
        labels = np.insert(tokens[noise], np.flatnonzero(span_start[noise]), sentinels)

        n_enc, n_dec = encoder.size + 1, labels.size + 1
        if n_enc > self.max_seq_length or n_dec > self.max_seq_length_dec:
            raise RuntimeError(f"sample {idx} corrupts to {n_enc}/{n_dec} tokens, more than "
                               f"{self.max_seq_length}/{self.max_seq_length_dec}")
        enc = np.full(self.max_seq_length, self.pad_id, dtype=np.int64)
        enc[:encoder.size] = encoder
        enc[encoder.size] = self.eos_id
        lab = np.full(self.max_seq_length_dec, IGNORE_INDEX, dtype=np.int64)
        lab[:labels.size] = labels
        lab[labels.size] = self.eos_id
        dec = np.full(self.max_seq_length_dec, self.pad_id, dtype=np.int64)
        dec[0] = self.decoder_start_id
        dec[1:n_dec] = lab[:n_dec - 1]
        enc_mask = torch.arange(self.max_seq_length) < n_enc
        dec_mask = torch.arange(self.max_seq_length_dec) < n_dec
        return {
            "encoder_input_ids": torch.from_numpy(enc),
            "decoder_input_ids": torch.from_numpy(dec),
            "labels": torch.from_numpy(lab),
            "encoder_attn_mask": enc_mask,
            "decoder_attn_mask": dec_mask,
            "encoder_decoder_attn_mask": enc_mask.clone(),
        }

    # -- what checks and logs read off a dataset -----------------------------------------------
    @property
    def data_prefix(self):
        return getattr(self.dataset, "data_prefix", None)

    @property
    def max_token_id(self):
        return getattr(self.dataset, "max_token_id", None)

    @property
    def min_token_id(self):
        return getattr(self.dataset, "min_token_id", None)


# ----------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------
def build_t5_train_valid_test_datasets(data_prefix, tokenizer, splits_string="949,50,1",
                                       train_valid_test_num_samples=(0, 0, 0), max_seq_length: int = 512,
                                       max_seq_length_dec: int | None = None, masked_lm_prob: float = 0.15,
                                       mean_span_length: float = 3.0, seed: int = 1234,
                                       cache_dir: str | None = None, eod_token_id: int | None = None,
                                       *, vocab_size: int | None = None) -> tuple:
    """``(train, valid, test)`` T5Datasets (None where 0 samples are asked for).

    Splits, blends, index caches and the vocabulary check are the GPT dataset's, over windows
    of ``random_spans_helper(max_seq_length, ...)[0]`` tokens.
    """
    tokenizer = _resolve_tokenizer(tokenizer)
    check_eod_token_id(eod_token_id, vocab_size)
    raw_length, _ = random_spans_helper(max_seq_length, masked_lm_prob, mean_span_length)
    windows = build_gpt_train_valid_test_datasets(
        data_prefix, splits_string, train_valid_test_num_samples, raw_length, seed, cache_dir,
        vocab_size=vocab_size)
    return tuple(
        None if ds is None else T5Dataset(ds, tokenizer, max_seq_length, max_seq_length_dec, masked_lm_prob,
                                          mean_span_length, seed, eod_token_id)
        for ds in windows)


def build_t5_train_valid_test_loaders(data_prefix, tokenizer, splits_string="949,50,1", max_seq_length: int = 512,
                                      max_seq_length_dec: int | None = None, masked_lm_prob: float = 0.15,
                                      mean_span_length: float = 3.0, seed: int = 1234, num_workers: int = 2,
                                      cache_dir: str | None = None, eod_token_id: int | None = None, *,
                                      train_valid_test_num_samples, micro_batch_size: int,
                                      eval_micro_batch_size: int | None = None, consumed_samples: int = 0,
                                      data_parallel_rank: int = 0, data_parallel_size: int = 1,
                                      vocab_size: int | None = None) -> tuple:
    """``(train_loader, valid_loader, test_loader)`` of T5 span-corruption micro-batches.

    ``tokenizer`` is a tokenizer or its LazyCall; configs pass ``"${tokenization.tokenizer}"``,
    which ``instantiate`` builds. The runtime keyword arguments are the GPT builder's (the trainer
    passes them): the train loader starts after ``consumed_samples`` and drops the final incomplete
    global batch; valid/test cover exactly their sample counts, the last global batch padded
    with samples whose labels are all ``-100``. A split asked for 0 samples gets None.
    """
    nums = check_num_samples(train_valid_test_num_samples)
    datasets = build_t5_train_valid_test_datasets(
        data_prefix, tokenizer, splits_string, nums, max_seq_length, max_seq_length_dec, masked_lm_prob,
        mean_span_length, seed, cache_dir, eod_token_id, vocab_size=vocab_size)
    return build_loaders_for_datasets(datasets, nums, micro_batch_size, eval_micro_batch_size, consumed_samples,
                                      data_parallel_rank, data_parallel_size, num_workers)


def t5_train_samples_per_epoch(data_prefix, splits_string="949,50,1", max_seq_length: int = 512,
                               masked_lm_prob: float = 0.15, mean_span_length: float = 3.0) -> int:
    """T5 samples in one epoch of the train split: its tokens // the raw window length."""
    raw_length, _ = random_spans_helper(max_seq_length, masked_lm_prob, mean_span_length)
    return train_samples_per_epoch(data_prefix, splits_string, raw_length)


def t5_valid_samples_per_epoch(data_prefix, splits_string="949,50,1", max_seq_length: int = 512,
                               masked_lm_prob: float = 0.15, mean_span_length: float = 3.0) -> int:
    """T5 samples in one epoch of the valid split (what one evaluation can read without repeating)."""
    raw_length, _ = random_spans_helper(max_seq_length, masked_lm_prob, mean_span_length)
    return train_samples_per_epoch(data_prefix, splits_string, raw_length, split=1)


# What the trainer asks a loader builder when the config counts training in epochs (train.train_epoch),
# and how large an evaluation can be (train.evaluation.eval_iter).
build_t5_train_valid_test_loaders.samples_per_epoch = t5_train_samples_per_epoch
build_t5_train_valid_test_loaders.valid_samples_per_epoch = t5_valid_samples_per_epoch
