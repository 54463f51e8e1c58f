"""From data prefixes to train/valid/test datasets and loaders, the way Megatron-LM does it.

``data_prefix`` is one ``.bin/.idx`` prefix or Megatron's blend list ``[weight1, prefix1, ...]``. Each
prefix's documents are split into contiguous ranges by a splits string such as ``"949,50,1"``, and a
blend draws each sample from the dataset whose share is furthest behind its weight.
"""
from __future__ import annotations

import inspect
import logging
import math
import os
from typing import Sequence

import numpy as np
import torch

from .gpt_dataset import GPTDataset, check_token_ids, index_stem, num_epochs_needed, token_id_range
from .index_budget import Progress, available_memory, check_index_budget
from .indexed_dataset import IndexedDatasetError, MMapIndexedDataset
from .packing import check_eod_token_id, check_packing_options, wrap_packed_documents
from .samplers import MegatronPretrainingSampler, PaddedEvalDataset, SequentialEvalSampler
from .tokenizer_record import RECORD_SUFFIX, check_record
from ..config.validate import COUNT, NON_NEGATIVE_INT, OneOf, PathValue, Range
from ..utils.errors import UsageError
from ..utils.events import format_bytes

SPLIT_NAMES = ("train", "valid", "test")
_BLEND_CHUNK = 1 << 20
# build_blending_indices' two Python lists: a pointer each, plus an int object for most sample numbers.
_BLEND_BYTES_PER_SAMPLE = 2 * 8 + 32
logger = logging.getLogger("libai_lite")


# The ranges of the loaders' keys (any dataloader section) and of the vocabulary padding, and the paths they read.
RULES = {
    "dataloader.*.num_workers": NON_NEGATIVE_INT,
    "dataloader.*.seed": Range(low=0, high=2**32 - 1, integer=True),
    "dataloader.*.seq_length": COUNT,
    "tokenization.make_vocab_size_divisible_by": COUNT,
    "dataloader.*.split_rounding": OneOf(("core", "legacy")),
}
PATHS = {
    "dataloader.*.data_prefix": PathValue(blend=True),
    "dataloader.*.cache_dir": PathValue(nullable=True),
}


def parse_splits_string(splits_string) -> list:
    """``"949,50,1"``, ``"98/2/0"`` or ``[0.98, 0.02, 0]`` -> three weights summing to one."""
    usage = (f"bad splits string {splits_string!r}: expected up to three non-negative numbers "
             f"separated by ',' or '/' (train, valid, test), e.g. '949,50,1' or '0.98,0.02,0'")
    if isinstance(splits_string, (int, float)) and not isinstance(splits_string, bool):
        parts = [splits_string]  # a bare number on the command line, as its quoted form reads
    elif isinstance(splits_string, str):
        parts = splits_string.strip().split("," if "," in splits_string else "/")
    elif isinstance(splits_string, Sequence):
        parts = list(splits_string)
    else:
        raise UsageError(usage)
    try:
        splits = [float(str(p).strip()) for p in parts]
    except ValueError:
        raise UsageError(usage) from None
    if not 1 <= len(splits) <= 3 or any(not math.isfinite(s) or s < 0 for s in splits) or sum(splits) <= 0:
        raise UsageError(usage)
    splits += [0.0] * (3 - len(splits))
    return [s / sum(splits) for s in splits]


SPLIT_ROUNDINGS = ("core", "legacy")


def get_train_valid_test_split(splits_string, size: int, rounding: str = "core") -> list:
    """Document boundaries ``[0, end_train, end_valid, size]`` of the three contiguous splits.

    ``rounding="core"`` (default) is Megatron core's: each boundary is the cumulative share times ``size``,
    rounded. ``"legacy"`` is legacy Megatron's and LiBai's: round each share of ``size``, then shift the
    boundaries so the last is ``size``; when that would give a split a negative length or documents to a
    zero-weight split, the cumulative rounding is used instead.
    """
    if rounding not in SPLIT_ROUNDINGS:
        raise UsageError(f"split_rounding must be one of {', '.join(SPLIT_ROUNDINGS)}, got {rounding!r}: "
                         f"'core' splits as Megatron core does, 'legacy' as legacy Megatron-LM and LiBai do")
    size = int(size)
    splits = parse_splits_string(splits_string)
    # Megatron core adds the normalised shares one by one (its split matrix); so does cumsum.
    cumulative = [0] + [int(round(c * float(size))) for c in np.cumsum(splits)[:-1]] + [size]
    if rounding == "core":
        return cumulative
    index = np.concatenate(([0], np.cumsum([int(round(share * float(size))) for share in splits])))
    index[1:] -= index[-1] - size
    if any(b < a or (share == 0 and b > a) for share, a, b in zip(splits, index, index[1:])):
        return cumulative
    return [int(i) for i in index]


def parse_data_prefix(data_prefix) -> tuple:
    """``(prefixes, weights)``; ``weights`` is None for a single prefix, else normalised to sum 1."""
    if isinstance(data_prefix, (str, os.PathLike)):
        return [os.fspath(data_prefix)], None
    items = list(data_prefix)
    if len(items) == 1:
        return [os.fspath(items[0])], None
    usage = ("data_prefix must be one prefix or Megatron's blend list [weight1, prefix1, weight2, "
             f"prefix2, ...]; got {items!r}")
    if len(items) == 0 or len(items) % 2:
        raise UsageError(usage)
    weights, prefixes = [], []
    for weight, prefix in zip(items[0::2], items[1::2]):
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            raise UsageError(usage) from None
        if not math.isfinite(weight) or weight < 0:
            raise UsageError(f"blend weight {weight} for {prefix} must be a non-negative number")
        weights.append(weight)
        prefixes.append(os.fspath(prefix).strip())
    if sum(weights) <= 0:
        raise UsageError(f"blend weights {weights} sum to zero; give at least one prefix a positive weight")
    total = sum(weights)
    return prefixes, [w / total for w in weights]


def get_datasets_weights_and_num_samples(data_prefix, train_valid_test_num_samples) -> tuple:
    """Megatron's helper: per-prefix sample counts, 0.5% above the weighted share so the blend
    never runs out while its counts drift around the exact proportions."""
    prefixes, weights = parse_data_prefix(data_prefix)
    if weights is None:
        weights = [1.0]
    nums = [[int(math.ceil(n * w * 1.005)) for n in train_valid_test_num_samples] for w in weights]
    return prefixes, weights, nums


def build_blending_indices(weights, size: int) -> tuple:
    """Megatron's build_blending_indices: ``(dataset_index, dataset_sample_index)`` for each blended sample.

    Sample ``n`` goes to the dataset whose count lags its weight the most (lowest index on ties), so every
    prefix of the blend is within one sample per dataset of the exact proportions.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim != 1 or weights.size == 0 or (weights < 0).any() or weights.sum() <= 0:
        raise UsageError(f"blend weights must be non-negative and not all zero, got {weights.tolist()}")
    # A sequential greedy has no closed form; plain Python floats and an unrolled argmax keep it fast.
    w, counts, others = (weights / weights.sum()).tolist(), [0] * weights.size, range(1, weights.size)
    chosen, taken = [0] * size, [0] * size
    progress = Progress("blending datasets", size)
    # In chunks, so a long blend reports progress at no cost per sample.
    for lo in range(0, size, _BLEND_CHUNK):
        for n in range(lo, min(lo + _BLEND_CHUNK, size)):
            scale = n if n > 1 else 1.0
            best, best_err = 0, w[0] * scale - counts[0]
            for i in others:
                err = w[i] * scale - counts[i]
                if err > best_err:
                    best, best_err = i, err
            chosen[n], taken[n] = best, counts[best]
            counts[best] += 1
        progress(min(lo + _BLEND_CHUNK, size))
    return np.array(chosen, dtype=np.uint8 if weights.size < 256 else np.int32), np.array(taken, dtype=np.int64)


class BlendableDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportion to ``weights`` (deterministic order)."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int):
        if len(datasets) == 0 or len(datasets) != len(weights):
            raise UsageError(f"need one weight per dataset, got {len(datasets)} datasets and {len(weights)} weights")
        self.datasets = list(datasets)
        self.size = int(size)
        have = available_memory()
        if have is not None and self.size * _BLEND_BYTES_PER_SAMPLE > have:
            raise UsageError(f"blending {self.size:,} samples needs about "
                             f"{format_bytes(self.size * _BLEND_BYTES_PER_SAMPLE)} of memory, more than the "
                             f"{format_bytes(have)} available; lower train.train_iter or train.evaluation.eval_iter")
        self.dataset_index, self.dataset_sample_index = build_blending_indices(weights, self.size)
        counts = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for i, (ds, need) in enumerate(zip(self.datasets, counts)):
            if need > len(ds):
                name = getattr(ds, "data_prefix", f"dataset {i}")
                raise UsageError(f"the blend takes {need} samples from {name}, which has only {len(ds)}: "
                                 f"build each part with ceil(weight * size * 1.005) samples")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]

    @property
    def max_token_id(self):
        ids = [d.max_token_id for d in self.datasets if getattr(d, "max_token_id", None) is not None]
        return max(ids) if ids else None

    @property
    def min_token_id(self):
        ids = [d.min_token_id for d in self.datasets if getattr(d, "min_token_id", None) is not None]
        return min(ids) if ids else None


def open_indexed_dataset(data_prefix: str) -> MMapIndexedDataset:
    """Open ``{data_prefix}.bin/.idx``; a missing pair raises a one-line IndexedDatasetError."""
    data_prefix = os.fspath(data_prefix)
    folders = [f"{data_prefix}{ext}" for ext in (".bin", ".idx") if os.path.isdir(f"{data_prefix}{ext}")]
    if folders:
        raise IndexedDatasetError(f"data prefix {data_prefix!r}: {folders[0]} is a directory, not the corpus file; "
                                  f"point the prefix at a .bin/.idx pair made by tools/preprocess_data.py")
    if not MMapIndexedDataset.exists(data_prefix):
        hint = ""
        if data_prefix.endswith((".bin", ".idx")):
            hint = " (give the prefix without the .bin/.idx suffix)"
        raise IndexedDatasetError(
            f"data prefix {data_prefix!r} not found: expected {data_prefix}.bin and {data_prefix}.idx"
            f"{hint}; relative paths start at the current directory {os.getcwd()}; create the files "
            f"with tools/preprocess_data.py")
    return MMapIndexedDataset(data_prefix)


def check_data_tokenizer(data_prefix, tokenizer, eod_token_id=None) -> None:
    """Refuse, in one line, a prefix of ``data_prefix`` (each one of a blend) whose tokenizer record names another
    tokenizer than the run's (``tokenizer_record.check_record``); prefixes with no record (made by Megatron-LM's
    tool, say) are named in one log line and train. Nothing to check without a tokenizer or a data prefix."""
    if tokenizer is None or data_prefix is None:
        return
    prefixes, _ = parse_data_prefix(data_prefix)
    unrecorded = [p for p in prefixes if not check_record(p, tokenizer, eod_token_id)]
    if unrecorded:
        logger.info(f"{', '.join(unrecorded)}: no tokenizer record ({RECORD_SUFFIX}; made by another tool?), so not "
                    f"checked against this run's {type(tokenizer).__name__}; tools/preprocess_data.py writes one")


def check_num_samples(train_valid_test_num_samples) -> list:
    nums = [0 if n is None else int(n) for n in train_valid_test_num_samples]
    if len(nums) != 3 or any(n < 0 for n in nums):
        raise UsageError(f"train_valid_test_num_samples must be three non-negative counts, "
                         f"got {train_valid_test_num_samples!r}")
    return nums


def _build_single_prefix(data_prefix, splits_string, nums, seq_length, seed, cache_dir, vocab_size=None,
                         split_rounding: str = "core") -> list:
    indexed = open_indexed_dataset(data_prefix)
    num_docs = indexed.num_documents
    if num_docs == 0:
        raise IndexedDatasetError(f"{data_prefix}.idx holds no documents: re-run tools/preprocess_data.py")
    bounds = get_train_valid_test_split(splits_string, num_docs, split_rounding)
    shares = parse_splits_string(splits_string)
    empty_test = False
    for i, name in enumerate(SPLIT_NAMES):
        # Before any split's index is cached: a refused split must leave nothing behind.
        if nums[i] and (i == 0 or shares[i] > 0) and bounds[i + 1] == bounds[i]:
            share = f"{name} needs at least 1/{num_docs} of the total to hold a document"
            if i == 2:
                # Megatron-LM goes on without a test split here (a small corpus under '949,50,1'): so do we, saying so.
                logger.warning(f"the test split of {data_prefix} has 0 of its {num_docs} documents (splits_string "
                               f"{splits_string!r}): no test dataset, as in Megatron-LM ({share})")
                empty_test = True
                continue
            raise UsageError(
                f"the {name} split of {data_prefix} has 0 of its {num_docs} documents (splits_string "
                f"{splits_string!r}) but {nums[i]} {name} samples were asked for: give {name} a larger share of "
                f"the splits string ({share}), or ask for 0 {name} samples"
                + (" (when training: train.evaluation.enabled=False)" if i else ""))
    sizes = indexed.document_sizes()
    for i, name in enumerate(SPLIT_NAMES):
        tokens = int(sizes[bounds[i]:bounds[i + 1]].sum(dtype=np.int64))
        if nums[i] and tokens:
            # Before anything is cached: a split the machine cannot index is one line and no files.
            stem = index_stem(data_prefix, cache_dir, name, nums[i], seq_length, seed)
            check_index_budget(name, data_prefix, nums[i], seq_length, tokens, bounds[i + 1] - bounds[i],
                               num_epochs_needed(tokens, seq_length, nums[i]), f"{stem}_sample_idx.npy", warn=False)
    if vocab_size is not None:
        # Before any index is cached: refused data must leave nothing behind.
        token_id_range(indexed, data_prefix, vocab_size=vocab_size)
    out = []
    for i, name in enumerate(SPLIT_NAMES):
        documents = np.arange(bounds[i], bounds[i + 1], dtype=np.int64)
        # A valid or test split given no share ("99,1,0") is not built, as in Megatron-LM and LiBai:
        # its evaluation is skipped (a training run that evaluates is refused that when resolved).
        if nums[i] == 0 or (i > 0 and shares[i] == 0) or (i == 2 and empty_test):
            out.append(None)
        else:
            out.append(GPTDataset(name, indexed, documents, nums[i], seq_length, seed, data_prefix, cache_dir))
    return out


def build_gpt_train_valid_test_datasets(data_prefix, splits_string, train_valid_test_num_samples,
                                        seq_length: int, seed: int, cache_dir: str | None = None,
                                        *, vocab_size: int | None = None, split_rounding: str = "core") -> tuple:
    """``(train, valid, test)`` GPT datasets (``BlendableDataset`` for a blend; None where 0 samples asked).

    With ``vocab_size``, data holding token ids outside the vocabulary is refused. ``split_rounding``
    chooses Megatron core's (default) or legacy Megatron's document split boundaries.
    """
    nums = check_num_samples(train_valid_test_num_samples)
    prefixes, weights = parse_data_prefix(data_prefix)
    if weights is None:
        result = _build_single_prefix(prefixes[0], splits_string, nums, seq_length, seed, cache_dir, vocab_size,
                                      split_rounding)
    else:
        _, _, per_prefix_nums = get_datasets_weights_and_num_samples(data_prefix, nums)
        parts = [_build_single_prefix(p, splits_string, n, seq_length, seed, cache_dir, vocab_size, split_rounding)
                 for p, n in zip(prefixes, per_prefix_nums)]
        result = []
        for i in range(3):
            members = [(ds[i], w) for ds, w in zip(parts, weights) if ds[i] is not None]
            result.append(BlendableDataset(*zip(*members), nums[i]) if nums[i] and members else None)
    if vocab_size is not None:
        for ds in result:
            if ds is not None:
                check_token_ids(ds, vocab_size)
    return tuple(result)


def _make_loader(dataset, batch_sampler, num_workers: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        # Samples are deterministic; a private generator keeps iterator creation from drawing
        # on the global RNG, so dropout streams after a resume match an uninterrupted run.
        generator=torch.Generator().manual_seed(0),
    )


def build_gpt_train_valid_test_loaders(data_prefix, splits_string="949,50,1", seq_length: int = 1024,
                                       seed: int = 1234, num_workers: int = 2, cache_dir: str | None = None,
                                       split_rounding: str = "core", *, train_valid_test_num_samples,
                                       micro_batch_size: int, consumed_samples: int = 0, data_parallel_rank: int = 0,
                                       data_parallel_size: int = 1, vocab_size: int | None = None,
                                       eval_micro_batch_size: int | None = None, reset_position_ids: bool = False,
                                       reset_attention_mask: bool = False, eod_mask_loss: bool = False,
                                       eod_token_id: int | None = None) -> tuple:
    """``(train_loader, valid_loader, test_loader)`` yielding ``{"input_ids", "labels"}`` micro-batches.

    The train loader starts after ``consumed_samples`` and drops the final incomplete global batch.
    Valid/test loaders cover their requested samples exactly once, padding the last global batch with
    ``labels == IGNORE_INDEX`` samples so all ranks stay in step; a split asked for 0 samples gets None.
    The packed-document options (``libai_lite.data.packing``) apply to every split and need ``eod_token_id``;
    ``reset_position_ids`` adds ``position_ids`` and ``reset_attention_mask`` adds ``document_ids`` to batches.
    """
    nums = check_num_samples(train_valid_test_num_samples)
    packing = dict(reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
                   eod_mask_loss=eod_mask_loss)
    # Refused before any index is built, so a bad config leaves nothing behind.
    check_packing_options(eod_token_id, **packing)
    check_eod_token_id(eod_token_id, vocab_size)
    datasets = build_gpt_train_valid_test_datasets(
        data_prefix, splits_string, nums, seq_length, seed, cache_dir, vocab_size=vocab_size,
        split_rounding=split_rounding)
    datasets = tuple(wrap_packed_documents(ds, eod_token_id, **packing) for ds in datasets)
    return build_loaders_for_datasets(datasets, nums, micro_batch_size, eval_micro_batch_size, consumed_samples,
                                      data_parallel_rank, data_parallel_size, num_workers)


def build_loaders_for_datasets(datasets, nums, micro_batch_size: int, eval_micro_batch_size: int | None,
                               consumed_samples: int, data_parallel_rank: int, data_parallel_size: int,
                               num_workers: int) -> tuple:
    """Loaders for (train, valid, test) datasets: resumable train sampler, padded exact-size eval samplers."""
    train_ds, valid_ds, test_ds = datasets
    layout = dict(micro_batch_size=micro_batch_size, data_parallel_rank=data_parallel_rank,
                  data_parallel_size=data_parallel_size)
    train_loader = None
    if train_ds is not None:
        sampler = MegatronPretrainingSampler(len(train_ds), consumed_samples, drop_last=True, **layout)
        train_loader = _make_loader(train_ds, sampler, num_workers)
    eval_loaders = []
    for ds, n in ((valid_ds, nums[1]), (test_ds, nums[2])):
        if ds is None:
            eval_loaders.append(None)
            continue
        padded = PaddedEvalDataset(ds, n)
        eval_layout = dict(layout, micro_batch_size=eval_micro_batch_size or micro_batch_size)
        sampler = SequentialEvalSampler(len(padded), 0, drop_last=False, **eval_layout)
        eval_loaders.append(_make_loader(padded, sampler, num_workers))
    return (train_loader, *eval_loaders)


def megatron_valid_samples(train_iter: int, eval_period: int, eval_iter: int, global_batch_size: int,
                           samples_read: int = 0) -> int:
    """Samples of the valid split, as Megatron-LM sizes it: one window of ``eval_iter`` global batches per
    evaluation, one evaluation every ``eval_period`` iterations and one at the end.

    The size decides the split's epochs and so the order of every sample. An evaluation that reads
    more than a window (``samples_read``) gets the room it needs past the last window's start.
    """
    window = eval_iter * global_batch_size
    windows = train_iter // max(eval_period, 1) + 1
    return max(windows * window, (windows - 1) * window + samples_read)


def megatron_consumed_valid_samples(evaluations_before: int, eval_iter: int, global_batch_size: int) -> int:
    """Where Megatron-LM's validation iterator stands after ``evaluations_before`` evaluations.

    Megatron's iterator runs on across evaluations, each reading ``eval_iter`` global batches, so evaluation
    k reads samples from ``k * eval_iter * global_batch_size`` on; a resumed run thus reads the same windows.
    """
    return max(int(evaluations_before), 0) * int(eval_iter) * int(global_batch_size)


def train_samples_per_epoch(data_prefix, splits_string: str, seq_length: int, split_rounding: str = "core",
                            split: int = 0) -> int:
    """Samples in one epoch of the train split (``split`` 1: valid, 2: test; summed over a blend):
    its tokens // seq_length."""
    prefixes, _ = parse_data_prefix(data_prefix)
    total = 0
    for prefix in prefixes:
        ds = open_indexed_dataset(prefix)
        bounds = get_train_valid_test_split(splits_string, ds.num_documents, split_rounding)
        first, last = int(ds.doc_idx[bounds[split]]), int(ds.doc_idx[bounds[split + 1]])
        total += max(int(ds.sizes[first:last].sum()) - 1, 0) // seq_length
    return total


def valid_samples_per_epoch(data_prefix, splits_string: str, seq_length: int, split_rounding: str = "core") -> int:
    """Samples in one epoch of the valid split (summed over a blend)."""
    return train_samples_per_epoch(data_prefix, splits_string, seq_length, split_rounding, split=1)


def cap_eval_iter(loader_cfg, eval_iter: int, samples_per_batch: int) -> int:
    """``eval_iter``, capped with one warning to the batches of one pass over the valid split.

    ``loader_cfg`` is the train loader's LazyCall; its builder's ``valid_samples_per_epoch`` gives the cap (a
    builder without it is not capped). More batches would reread samples and oversize the valid and test indices.
    """
    from ..config.instantiate import instantiate_target

    count = getattr(instantiate_target(loader_cfg), "valid_samples_per_epoch", None)
    if not callable(count):
        return eval_iter
    accepted = inspect.signature(count).parameters
    per_epoch = int(count(**{k: v for k, v in loader_cfg.items() if k in accepted}))
    most = max(1, per_epoch // max(int(samples_per_batch), 1))
    if per_epoch and eval_iter > most:
        logger.warning(f"train.evaluation.eval_iter={eval_iter} batches of {samples_per_batch} samples exceed the "
                       f"{per_epoch:,} samples of the valid split: capped to {most}, one pass over it")
        return most
    return eval_iter


# What the trainer asks a loader builder when the config counts training in epochs (train.train_epoch),
# and how large an evaluation can be (train.evaluation.eval_iter).
build_gpt_train_valid_test_loaders.samples_per_epoch = train_samples_per_epoch
build_gpt_train_valid_test_loaders.valid_samples_per_epoch = valid_samples_per_epoch
