"""Megatron-LM's own T5 dataset over sentence-split data (``{prefix}_text_sentence``), sample for sample.

For users who compare with Megatron runs or resume them (``t5_dataset.py`` follows the T5 paper instead):
``build_samples_mapping`` is ``helpers.cpp``'s ``build_mapping`` (runs of whole sentences of one document,
``short_seq_prob``, long-sentence documents skipped, epochs, shuffle) with Megatron's own random streams
(``std::mt19937`` reproduced), so the mapping equals Megatron's entry for entry; ``build_training_sample``
is Megatron's whole-word n-gram masking with sentinel spans. Samples come out in ``t5_dataset.py``'s
layout (labels -100 where Megatron's loss mask is 0), so the MT5 model and configs take them as they are.
"""
from __future__ import annotations

import collections
import os

import numpy as np
import torch

from libai_lite.data.build import (
    build_loaders_for_datasets,
    check_num_samples,
    get_train_valid_test_split,
    open_indexed_dataset,
)
from libai_lite.data.gpt_dataset import IGNORE_INDEX, token_id_range
from libai_lite.data.index_cache import cache_stem
from libai_lite.utils.errors import UsageError
from libai_lite.utils.files import atomic_write

from .t5_dataset import _resolve_tokenizer

LONG_SENTENCE_LEN = 512  # helpers.cpp: documents holding a longer sentence are skipped
_MASK64 = (1 << 64) - 1


# ----------------------------------------------------------------------------------------------
# The C++ standard library's Mersenne Twisters (helpers.cpp's random numbers)
# ----------------------------------------------------------------------------------------------
def _mt19937_32(seed: int) -> np.random.MT19937:
    """numpy's MT19937 in the state ``std::mt19937(seed)`` starts in (``random_raw`` gives its outputs).

    numpy seeds MT19937 its own way; the C++ constructor is Matsumoto and Nishimura's init_genrand.
    """
    key = np.empty(624, dtype=np.uint32)
    x = seed & 0xFFFFFFFF
    for i in range(624):
        key[i] = x
        x = (1812433253 * (x ^ (x >> 30)) + i + 1) & 0xFFFFFFFF
    gen = np.random.MT19937()
    gen.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": 624}}
    return gen


class _MT19937_64:
    """``std::mt19937_64``: the 64-bit Mersenne Twister (numpy has none), seeded as the C++ constructor does."""

    _N, _M = 312, 156
    _A = 0xB5026F5AA96619E9
    _UPPER, _LOWER = _MASK64 ^ ((1 << 31) - 1), (1 << 31) - 1

    def __init__(self, seed: int):
        state = [seed & _MASK64]
        for i in range(1, self._N):
            prev = state[-1]
            state.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & _MASK64)
        self._state, self._pos = state, self._N

    def _twist(self) -> None:
        mt, n, m = self._state, self._N, self._M
        for i in range(n):
            x = (mt[i] & self._UPPER) | (mt[(i + 1) % n] & self._LOWER)
            mt[i] = mt[(i + m) % n] ^ (x >> 1) ^ (self._A if x & 1 else 0)
        self._pos = 0

    def __call__(self) -> int:
        if self._pos >= self._N:
            self._twist()
        y = self._state[self._pos]
        self._pos += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        return (y ^ (y >> 43)) & _MASK64


# ----------------------------------------------------------------------------------------------
# The samples mapping
# ----------------------------------------------------------------------------------------------
def build_samples_mapping(doc_idx, sizes, num_epochs: int | None, max_num_samples: int | None,
                          max_seq_length: int, short_seq_prob: float, seed: int, min_num_sent: int = 1) -> np.ndarray:
    """Megatron's ``helpers.build_mapping``: ``[num_samples, 3]`` rows of (first sentence, end sentence, target length).

    ``doc_idx`` are the split's document boundaries into ``sizes`` (sentence lengths);
    ``num_epochs``/``max_num_samples`` None mean "no limit" as in ``get_samples_mapping`` (one of the
    two must be given). ``min_num_sent`` is 2 for a binary head (BERT), 1 for T5.
    """
    if not num_epochs and not max_num_samples:
        raise UsageError("the T5 samples mapping needs a number of epochs or of samples; pass one of them")
    if not 0.0 <= short_seq_prob <= 1.0 or max_seq_length <= 1 or seed <= 0:
        raise UsageError(f"short_seq_prob must lie in [0, 1], max_seq_length exceed 1 and seed be positive; got "
                         f"{short_seq_prob}, {max_seq_length}, {seed}")
    num_epochs = num_epochs or np.iinfo(np.int32).max - 1
    max_num_samples = max_num_samples or np.iinfo(np.int64).max - 1
    doc_idx = np.asarray(doc_idx, dtype=np.int64).tolist()
    sizes = np.asarray(sizes)
    # helpers.cpp works in C ints: the ratio is round(1 / p), the target a 32-bit draw.
    ratio = int(round(1.0 / short_seq_prob)) if short_seq_prob > 0 else 0
    long_sentence = sizes > LONG_SENTENCE_LEN
    rng = _mt19937_32(seed)
    draws, used = rng.random_raw(1 << 12), 0

    def target_length() -> int:
        nonlocal draws, used
        if ratio == 0:
            return max_seq_length
        if used == len(draws):
            draws, used = rng.random_raw(1 << 12), 0
        r = int(draws[used])
        used += 1
        return 2 + r % (max_seq_length - 1) if r % ratio == 0 else max_seq_length

    sizes = sizes.tolist()
    rows = []
    for epoch in range(num_epochs):
        if len(rows) >= max_num_samples:
            break
        before = len(rows)
        for doc in range(len(doc_idx) - 1):
            first, last = doc_idx[doc], doc_idx[doc + 1]
            remain = last - first
            if remain < min_num_sent or (remain > 1 and long_sentence[first:last].any()):
                continue
            start, seq_len, num_sent, target = first, 0, 0, target_length()
            for sent in range(first, last):
                seq_len += sizes[sent]
                num_sent += 1
                remain -= 1
                if (seq_len >= target and remain > 1 and num_sent >= min_num_sent) or remain == 0:
                    rows.append((start, sent + 1, target))
                    start, seq_len, num_sent, target = sent + 1, 0, 0, target_length()
        if len(rows) == before:
            # helpers.cpp would loop over empty epochs until the int32 epoch limit.
            raise UsageError("no document of this split can make a T5 sample (every one is empty or holds a "
                             f"sentence over {LONG_SENTENCE_LEN} tokens); check the data prefix and its split")
    dtype = np.uint64 if len(sizes) > np.iinfo(np.uint32).max else np.uint32
    mapping = np.asarray(rows, dtype=dtype).reshape(-1, 3)
    rand64 = _MT19937_64(seed + 1)
    # Fisher-Yates from the end, helpers.cpp's order of draws.
    for i in range(len(mapping) - 1, 0, -1):
        j = rand64() % (i + 1)
        mapping[[i, j]] = mapping[[j, i]]
    return mapping


# ----------------------------------------------------------------------------------------------
# One sample (megatron/data/t5_dataset.py and dataset_utils.create_masked_lm_predictions)
# ----------------------------------------------------------------------------------------------
_Span = collections.namedtuple("_Span", ["index", "label"])


def _masked_spans(tokens, is_start, cls_id, sep_id, masked_lm_prob, max_predictions, np_rng, max_ngrams=10):
    """``create_masked_lm_predictions(..., geometric_dist=True, masking_style="t5")``: the masked spans."""
    cand_indexes = []
    for i, token in enumerate(tokens):
        if token == cls_id or token == sep_id:
            continue
        # Whole-word masking: a WordPiece continuation ("##...") joins the word before it.
        if cand_indexes and not is_start(token):
            cand_indexes[-1].append(i)
        else:
            cand_indexes.append([i])
    if masked_lm_prob == 0:
        return []
    num_to_predict = min(max_predictions, max(1, int(round(len(tokens) * masked_lm_prob))))
    ngram_indexes = [[cand_indexes[idx:idx + n] for n in range(1, max_ngrams + 1)] for idx in range(len(cand_indexes))]
    np_rng.shuffle(ngram_indexes)
    masked, spans, covered = 0, [], set()
    for cand_index_set in ngram_indexes:
        if masked >= num_to_predict:
            break
        if not cand_index_set:
            continue
        # SpanBERT's geometric span length (p = 0.2), clipped to max_ngrams.
        n = min(np_rng.geometric(0.2), max_ngrams)
        index_set = sum(cand_index_set[n - 1], [])
        n -= 1
        while masked + len(index_set) > num_to_predict:
            if n == 0:
                break
            index_set = sum(cand_index_set[n - 1], [])
            n -= 1
        if masked + len(index_set) > num_to_predict or any(i in covered for i in index_set):
            continue
        covered.update(index_set)
        masked += len(index_set)
        spans.append(_Span(index=index_set, label=[tokens[i] for i in index_set]))
    # Megatron shuffles once more (for its permutation option, off for T5): the draws stay in step.
    np_rng.shuffle(ngram_indexes)
    return sorted(spans, key=lambda s: s.index[0])


def build_training_sample(sentences, target_seq_length: int, max_seq_length: int, max_seq_length_dec: int,
                          ids: dict, is_start, masked_lm_prob: float, np_rng) -> dict:
    """Megatron's ``build_training_sample``, as Megatron's arrays: ``text_enc``, ``text_dec``, ``labels``
    (-1 at padding), ``loss_mask``, ``truncated``."""
    tokens = [t for sentence in sentences for t in sentence]
    truncated = len(tokens) > target_seq_length
    tokens = tokens[:target_seq_length]
    spans = _masked_spans(tokens, is_start, ids["cls"], ids["sep"], masked_lm_prob,
                          masked_lm_prob * target_seq_length, np_rng)
    sentinels = collections.deque(ids["sentinels"])
    enc, dec_in, dec_out, start = [], [ids["bos"]], [], 0
    for span in spans:
        flag = sentinels.popleft()
        dec_in += [flag, *span.label]
        dec_out += [flag, *span.label]
        enc += tokens[start:span.index[0]] + [flag]
        start = span.index[-1] + 1
    dec_out.append(ids["eos"])
    enc += tokens[start:]
    if len(enc) > max_seq_length or len(dec_in) > max_seq_length_dec:
        raise UsageError(f"a T5 sample needs {len(enc)} encoder and {len(dec_in)} decoder positions, more than "
                         f"max_seq_length={max_seq_length} / max_seq_length_dec={max_seq_length_dec}; raise "
                         f"max_seq_length_dec (Megatron's default is 128 for 512)")
    pad_dec = max_seq_length_dec - len(dec_in)
    return {
        "text_enc": np.array(enc + [ids["pad"]] * (max_seq_length - len(enc)), dtype=np.int64),
        "text_dec": np.array(dec_in + [ids["pad"]] * pad_dec, dtype=np.int64),
        "labels": np.array(dec_out + [-1] * pad_dec, dtype=np.int64),
        "loss_mask": np.array([1] * len(dec_in) + [0] * pad_dec, dtype=np.int64),
        "truncated": int(truncated),
    }


def megatron_t5_ids(tokenizer) -> dict:
    """The ids Megatron's T5 dataset takes from its tokenizer (cls, sep, pad, bos, eos, sentinels)."""
    ids = {"cls": tokenizer.cls_token_id, "sep": tokenizer.sep_token_id, "pad": tokenizer.pad_token_id,
           "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id,
           "sentinels": list(tokenizer.additional_special_tokens_ids)}
    missing = [k for k in ("pad", "bos", "eos") if ids[k] is None]
    if missing or not ids["sentinels"]:
        raise UsageError(f"{type(tokenizer).__name__} lacks what Megatron's T5 dataset needs "
                         f"({', '.join(missing) or 'sentinels'}); build it with vocab_extra_ids=100 "
                         f"(BertWordPiece or a Megatron-style SentencePiece tokenizer)")
    return ids


class MegatronT5Dataset(torch.utils.data.Dataset):
    """Megatron-LM's ``T5Dataset`` over one split of a sentence-split ``.bin/.idx`` dataset.

    ``indexed`` is the whole ``MMapIndexedDataset``, ``doc_range`` the split's ``(first, end)`` documents;
    ``max_num_samples`` is the number of samples the run asks for (Megatron's
    ``train_valid_test_num_samples[split]``); the mapping holds whole epochs, so it may hold more.
    """

    def __init__(self, indexed, doc_range, tokenizer, max_num_samples: int, max_seq_length: int = 512,
                 max_seq_length_dec: int = 128, masked_lm_prob: float = 0.15, short_seq_prob: float = 0.1,
                 seed: int = 1234, mapping_file: str | None = None):
        self.indexed, self.seed = indexed, int(seed)
        self.max_seq_length, self.max_seq_length_dec = int(max_seq_length), int(max_seq_length_dec)
        self.masked_lm_prob = float(masked_lm_prob)
        self.ids = megatron_t5_ids(tokenizer)
        first, end = doc_range
        doc_idx = np.asarray(indexed.doc_idx)[first:end + 1]
        mapping = np.load(mapping_file, mmap_mode="r") if mapping_file and os.path.exists(mapping_file) else None
        # Megatron's file name does not say which documents the split holds: a mapping reaching outside
        # them was made for another splits string and is built afresh.
        if mapping is not None and len(mapping) and not (
                mapping[:, 0].min() >= doc_idx[0] and mapping[:, 1].max() <= doc_idx[-1]):
            mapping = None
        if mapping is not None:
            self.samples_mapping = mapping
        else:
            # Megatron accounts for the two tokens it once added (get_samples_mapping(..., max_seq_length - 2)).
            self.samples_mapping = build_samples_mapping(doc_idx, indexed.sizes, None, max_num_samples,
                                                         self.max_seq_length - 2, short_seq_prob, self.seed)
            if mapping_file is not None:
                atomic_write(mapping_file, lambda f: np.save(f, self.samples_mapping))
        vocab = getattr(tokenizer, "id_to_token")
        starts = {}

        def is_start(token: int) -> bool:
            if token not in starts:
                starts[token] = not (vocab(token) or "").startswith("##")
            return starts[token]

        self._is_start = is_start

    def __len__(self) -> int:
        return len(self.samples_mapping)

    def megatron_sample(self, idx: int) -> dict:
        """Sample ``idx`` exactly as Megatron's ``T5Dataset.__getitem__`` builds it (its array names)."""
        start, end, seq_length = (int(v) for v in self.samples_mapping[idx])
        sentences = [np.asarray(self.indexed[i]).tolist() for i in range(start, end)]
        # Megatron: numpy's RandomState (randint excludes its upper bound), seeded seed + index.
        np_rng = np.random.RandomState(seed=(self.seed + idx))
        return build_training_sample(sentences, seq_length, self.max_seq_length, self.max_seq_length_dec,
                                     self.ids, self._is_start, self.masked_lm_prob, np_rng)

    def __getitem__(self, idx: int) -> dict:
        s = self.megatron_sample(idx)
        enc, dec = torch.from_numpy(s["text_enc"]), torch.from_numpy(s["text_dec"])
        labels = torch.from_numpy(np.where(s["loss_mask"] == 1, s["labels"], IGNORE_INDEX))
        # Megatron's 2-D masks take a position where the id is >= 1; these are their key-padding rows.
        return {"encoder_input_ids": enc, "decoder_input_ids": dec, "labels": labels,
                "encoder_attn_mask": enc >= 1, "decoder_attn_mask": dec >= 1, "encoder_decoder_attn_mask": enc >= 1}


def build_megatron_t5_datasets(data_prefix: str, tokenizer, splits_string: str = "949,50,1",
                               train_valid_test_num_samples=(0, 0, 0), max_seq_length: int = 512,
                               max_seq_length_dec: int = 128, masked_lm_prob: float = 0.15,
                               short_seq_prob: float = 0.1, seed: int = 1234, cache_dir: str | None = None,
                               *, vocab_size: int | None = None) -> tuple:
    """``(train, valid, test)`` ``MegatronT5Dataset`` over ``data_prefix`` (a ``..._text_sentence`` prefix),
    split by documents as Megatron's legacy ``get_train_valid_test_split_`` does (None for an empty split
    or 0 samples).

    Each split's samples mapping is cached under Megatron's file name
    (``{prefix}_{split}_indexmap_{n}mns_{length}msl_{short_seq_prob}ssp_{seed}s.npy``), next to the
    data or in ``cache_dir`` as the GPT indices are, so a mapping Megatron wrote is read as it is. With
    ``vocab_size``, token ids outside the vocabulary are refused first (``token_id_range``).
    """
    if not str(data_prefix).endswith("_sentence"):
        raise UsageError(f"Megatron's T5 dataset reads sentence-split data, not {data_prefix}; preprocess with "
                         f"tools/preprocess_data.py --split-sentences and pass the ..._text_sentence prefix")
    tokenizer = _resolve_tokenizer(tokenizer)
    indexed = open_indexed_dataset(os.fspath(data_prefix))
    # Before any mapping is cached: refused data must leave nothing behind.
    token_id_range(indexed, os.fspath(data_prefix), vocab_size=vocab_size)
    bounds = get_train_valid_test_split(splits_string, indexed.num_documents, "legacy")
    stem = cache_stem(os.fspath(data_prefix), cache_dir)
    out = []
    for i, (name, n) in enumerate(zip(("train", "valid", "test"), train_valid_test_num_samples)):
        if bounds[i + 1] <= bounds[i] or not n:
            out.append(None)
            continue
        mapping = f"{stem}_{name}_indexmap_{int(n)}mns_{int(max_seq_length) - 2}msl_{short_seq_prob:0.2f}ssp_{seed}s.npy"
        out.append(MegatronT5Dataset(indexed, (bounds[i], bounds[i + 1]), tokenizer, int(n), max_seq_length,
                                     max_seq_length_dec, masked_lm_prob, short_seq_prob, seed, mapping))
    return tuple(out)


def build_megatron_t5_train_valid_test_loaders(data_prefix, tokenizer, splits_string="949,50,1",
                                               max_seq_length: int = 512, max_seq_length_dec: int = 128,
                                               masked_lm_prob: float = 0.15, short_seq_prob: float = 0.1,
                                               seed: int = 1234, num_workers: int = 2, cache_dir: str | None = None,
                                               *, train_valid_test_num_samples, micro_batch_size: int,
                                               eval_micro_batch_size: int | None = None, consumed_samples: int = 0,
                                               data_parallel_rank: int = 0, data_parallel_size: int = 1,
                                               vocab_size: int | None = None) -> tuple:
    """``(train_loader, valid_loader, test_loader)`` of Megatron T5 samples, for ``dataloader.train``.

    The runtime keyword arguments are the ones the trainer passes every loader builder (see
    ``build_t5_train_valid_test_loaders``); token ids outside ``vocab_size`` are refused.
    """
    nums = check_num_samples(train_valid_test_num_samples)
    datasets = build_megatron_t5_datasets(data_prefix, tokenizer, splits_string, nums, max_seq_length,
                                          max_seq_length_dec, masked_lm_prob, short_seq_prob, seed, cache_dir,
                                          vocab_size=vocab_size)
    return build_loaders_for_datasets(datasets, nums, micro_batch_size, eval_micro_batch_size, consumed_samples,
                                      data_parallel_rank, data_parallel_size, num_workers)
