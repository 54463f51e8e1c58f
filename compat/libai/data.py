"""LiBai's data config, as its config files write it, building this project's Megatron-format loaders.

LiBai describes data as ``build_nlp_train_val_test_loader(dataset=[GPT2Dataset(data_prefix=...,
indexed_dataset=get_indexed_dataset(...)), ...], splits=[[949, 50, 1]], weights=[1.0])``. Here the
dataset classes return a :class:`LibaiDataset` description (instantiating a config builds the inner
calls first), and the loader builder hands it, with the run's sample counts and layout, to the loader
builder it names: the core's GPT one, or a project's (``compat.libai.mt5``'s T5Dataset).
LiBai splits documents as legacy Megatron-LM does, so ``split_rounding="legacy"``.

LiBai's ``build_nlp_train_loader`` / ``build_nlp_test_loader`` also take map-style datasets (a project's
counterpart of LiBai's fine-tuning or span-corruption data, say): they are read through :class:`MapDatasetView` with this project's
samplers, and batched by the config's ``collate_fn``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from omegaconf import DictConfig, ListConfig

from libai_lite.config import instantiate
from libai_lite.data.build import build_gpt_train_valid_test_loaders, train_samples_per_epoch
from libai_lite.data.gpt_dataset import check_token_ids
from libai_lite.data.samplers import MegatronPretrainingSampler, PaddedEvalDataset, SequentialEvalSampler
from libai_lite.tokenizer import BertTokenizer as _BertTokenizer, GPT2Tokenizer as _GPT2Tokenizer
from libai_lite.utils.errors import UsageError

from .notice import warn_once

__all__ = ["LibaiDataset", "MapDatasetView", "get_indexed_dataset", "GPT2Dataset", "build_nlp_train_val_test_loader",
           "build_nlp_train_loader", "build_nlp_test_loader", "GPT2Tokenizer", "BertTokenizer", "libai_data_prefix"]


@dataclass
class LibaiDataset:
    """One LiBai dataset entry: its data, the loader builder that reads it here and that builder's options.

    ``blendable``: several entries of this kind may be mixed by ``weights`` (a Megatron blend list);
    ``samples_per_epoch``: counts the train split's samples for ``train.train_epoch`` (its accepted
    arguments are taken from ``options``).
    """

    kind: str
    data_prefix: str
    builder: Callable
    options: dict = field(default_factory=dict)
    blendable: bool = False
    samples_per_epoch: Optional[Callable] = None
    max_num_samples: Optional[int] = None


def get_indexed_dataset(data_prefix, data_impl: str = "mmap", skip_warmup: bool = False) -> str:
    """LiBai's indexed-dataset opener; here the prefix of the Megatron ``mmap`` ``.bin/.idx`` pair it names."""
    if data_impl not in ("mmap", "infer"):
        raise UsageError(f"data_impl={data_impl!r}: only Megatron's mmap .bin/.idx format is read here; "
                         f"re-run tools/preprocess_data.py on the corpus (it writes mmap)")
    return str(data_prefix)


def libai_data_prefix(name: str, data_prefix, indexed_dataset) -> str:
    """The one prefix a LiBai dataset entry names (``data_prefix`` and its ``indexed_dataset`` must agree)."""
    prefix = data_prefix if data_prefix is not None else indexed_dataset
    if prefix is None:
        raise UsageError(f"LiBai dataset {name!r} has no data_prefix; set dataloader.train.dataset.0.data_prefix")
    if indexed_dataset is not None and data_prefix is not None and str(indexed_dataset) != str(data_prefix):
        raise UsageError(f"LiBai dataset {name!r}: data_prefix={data_prefix} but indexed_dataset.data_prefix="
                         f"{indexed_dataset}; set both to the same prefix")
    return str(prefix)


def GPT2Dataset(name: str = "gpt-2", data_prefix=None, indexed_dataset=None, max_seq_length: int = 1024,  # noqa: N802
                mask_lm_prob: float = 0.15, max_num_samples: Optional[int] = None, seed: int = 1234) -> LibaiDataset:
    """LiBai's GPT dataset: Megatron's GPT samples of ``max_seq_length`` tokens (this package's GPT builder)."""
    return LibaiDataset("gpt", libai_data_prefix(name, data_prefix, indexed_dataset),
                        build_gpt_train_valid_test_loaders,
                        dict(seq_length=int(max_seq_length), seed=int(seed), split_rounding="legacy"),
                        blendable=True, samples_per_epoch=train_samples_per_epoch,
                        max_num_samples=max_num_samples)


def _splits_string(splits: Any, count: int) -> str:
    rows = [list(s) for s in (splits or [[949.0, 50.0, 1.0]])]
    if len(rows) == 1:
        rows *= count
    if len(rows) != count or any(r != rows[0] for r in rows):
        raise UsageError(f"LiBai splits {rows} differ between datasets; one splits list for all is supported here "
                         f"(set dataloader.train.splits=[[949,50,1]])")
    return ",".join(f"{float(x):g}" for x in rows[0])


def _entries(dataset: Any) -> list:
    if isinstance(dataset, (LibaiDataset, DictConfig)):
        dataset = [dataset]
    entries = [d if isinstance(d, LibaiDataset) else instantiate(d) for d in (dataset or [])]
    if not entries or not all(isinstance(e, LibaiDataset) for e in entries):
        raise UsageError("dataloader.train.dataset must list LiBai datasets (GPT2Dataset, T5Dataset, ...)")
    kinds = {e.kind for e in entries}
    if len(kinds) > 1 or (len(entries) > 1 and not entries[0].blendable):
        raise UsageError(f"dataloader.train.dataset mixes {len(entries)} datasets of kind {sorted(kinds)}; only GPT "
                         f"datasets of one sequence length blend here")
    return entries


def _blend(entries: list, weights: Any):
    if len(entries) == 1:
        return entries[0].data_prefix
    weights = list(weights or [1.0] * len(entries))
    if len(weights) != len(entries):
        raise UsageError(f"dataloader.train.weights has {len(weights)} weights for {len(entries)} datasets")
    if any(e.options != entries[0].options for e in entries):
        raise UsageError("the blended LiBai datasets differ in max_seq_length or seed; give them the same values")
    return [x for w, e in zip(weights, entries) for x in (float(w), e.data_prefix)]


def _call(builder: Callable, **kwargs: Any):
    accepted = inspect.signature(builder).parameters
    return builder(**{k: v for k, v in kwargs.items() if k in accepted})


def build_nlp_train_val_test_loader(dataset, splits=None, weights=None, train_val_test_num_samples=None,
                                    train_batch_size=None, test_batch_size=None, sampler=None, num_workers: int = 4,
                                    consumed_samples: int = 0, seed: int = 0, collate_fn=None, dataset_mixer=None,
                                    tokenizer=None, *, train_valid_test_num_samples, micro_batch_size: int,
                                    eval_micro_batch_size: Optional[int] = None, data_parallel_rank: int = 0,
                                    data_parallel_size: int = 1, vocab_size: Optional[int] = None, **runtime: Any):
    """LiBai's train/valid/test loader builder (``dataloader.train``), over this project's Megatron datasets.

    LiBai's own batch sizes and sample counts (``train_val_test_num_samples``, ``train_batch_size``, which
    LiBai's trainer fills in) are the run's here: the trainer passes them, with the data position.
    """
    entries = _entries(dataset)
    first = entries[0]
    return _call(first.builder, data_prefix=_blend(entries, weights), tokenizer=tokenizer,
                 splits_string=_splits_string(splits, len(entries)), num_workers=int(num_workers), **first.options,
                 train_valid_test_num_samples=train_valid_test_num_samples, micro_batch_size=micro_batch_size,
                 eval_micro_batch_size=eval_micro_batch_size, consumed_samples=consumed_samples,
                 data_parallel_rank=data_parallel_rank, data_parallel_size=data_parallel_size,
                 vocab_size=vocab_size, **runtime)


def _samples_per_epoch(dataset, splits=None, weights=None) -> int:
    entries = _entries(dataset)
    count = entries[0].samples_per_epoch
    if count is None:
        raise UsageError(f"LiBai's {entries[0].kind} dataset cannot count an epoch here; set train.train_iter "
                         f"and train.train_epoch=0")
    return _call(count, data_prefix=_blend(entries, weights), splits_string=_splits_string(splits, len(entries)),
                 **entries[0].options)


# What the trainer asks when a config counts training in epochs (train.train_epoch).
build_nlp_train_val_test_loader.samples_per_epoch = _samples_per_epoch


def build_nlp_test_loader(dataset, test_batch_size: Optional[int] = None, sampler=None, num_workers: int = 4,
                          seed: int = 0, collate_fn=None, tokenizer=None, micro_batch_size: Optional[int] = None,
                          data_parallel_rank: int = 0, data_parallel_size: int = 1, vocab_size: Optional[int] = None):
    """LiBai's test loader (an entry of ``dataloader.test``), for ``--eval-only``: over a GPT2Dataset/T5Dataset
    entry ``max_num_samples`` samples (one epoch when unset) drawn from the whole of its documents; over a
    map-style dataset each sample once, in order (LiBai's ``SingleRoundSampler``), batched by ``collate_fn``."""
    batch = int(test_batch_size or micro_batch_size or 1)
    if not isinstance(dataset, (LibaiDataset, DictConfig)):
        view = PaddedEvalDataset(MapDatasetView(_map_datasets(dataset, None), prepare=getattr(collate_fn, "prepare",
                                                                                                 None)))
        batches = SequentialEvalSampler(len(view), 0, batch, int(data_parallel_rank), int(data_parallel_size))
        return _loader(view, batches, num_workers, collate_fn)
    entry = _entries([dataset])[0]
    n = entry.max_num_samples
    if n is None:
        n = _call(entry.samples_per_epoch, data_prefix=entry.data_prefix, splits_string="0,0,1", **entry.options)
    loaders = _call(entry.builder, data_prefix=entry.data_prefix, tokenizer=tokenizer, splits_string="0,0,1",
                    num_workers=int(num_workers), **entry.options, train_valid_test_num_samples=[0, 0, int(n)],
                    micro_batch_size=batch, data_parallel_rank=data_parallel_rank,
                    data_parallel_size=data_parallel_size, vocab_size=vocab_size)
    return loaders[2]


class MapDatasetView(torch.utils.data.Dataset):
    """A LiBai map-style dataset (``dataset[i]``, ``len``) as this project's samplers read it.

    Position ``i`` is sample ``i % n`` of pass ``i // n`` over the ``n`` samples, ``total`` positions in all
    (one pass when None). With ``shuffle`` each pass has its own order, ``torch.randperm(n)`` seeded by
    ``seed + pass`` (LiBai's ``CyclicSampler(shuffle=True)`` reshuffles each epoch too), so the sample at a
    position depends only on the seed and the position: a resumed run sees what an unbroken one would.
    ``prepare(sample, position)``, when the collate function has it, runs here, in the loader's workers.
    """

    def __init__(self, dataset, total: Optional[int] = None, shuffle: bool = False, seed: int = 0,
                 prepare: Optional[Callable] = None):
        self.dataset, self.n = dataset, len(dataset)
        if self.n < 1:
            raise UsageError(f"the LiBai dataset {type(dataset).__name__} in dataloader holds no samples; "
                             f"point it at data with at least one sample")
        self.total = self.n if total is None else int(total)
        self.shuffle, self.seed, self.prepare = bool(shuffle), int(seed), prepare
        self._order = (None, None)  # (pass, its permutation): passes are read in turn, so one is kept

    def __len__(self) -> int:
        return self.total

    def index(self, position: int) -> int:
        """The dataset index read at ``position``."""
        epoch, k = divmod(int(position), self.n)
        if not self.shuffle:
            return k
        if self._order[0] != epoch:
            self._order = (epoch, torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch)))
        return int(self._order[1][k])

    def __getitem__(self, position: int):
        if not 0 <= position < self.total:
            raise IndexError(f"position {position} out of range for {self.total}")
        sample = self.dataset[self.index(position)]
        return self.prepare(sample, int(position)) if self.prepare is not None else sample


def _map_datasets(dataset: Any, mixer: Any) -> torch.utils.data.Dataset:
    """LiBai's ``dataset`` argument of map-style datasets as one dataset (several are concatenated, as LiBai's
    default ``dataset_mixer=ConcatDataset`` does)."""
    items = list(dataset) if isinstance(dataset, (list, tuple, ListConfig)) else [dataset]
    if not items or any(isinstance(d, (LibaiDataset, DictConfig)) or not hasattr(d, "__getitem__") for d in items):
        raise UsageError("dataloader.train.dataset must list LiBai datasets (map-style datasets, or GPT2Dataset/"
                         "T5Dataset entries for build_nlp_train_val_test_loader)")
    if mixer is not None:
        raise UsageError("dataloader.train.dataset_mixer: LiBai's default (ConcatDataset) is the only mixer here; "
                         "remove the key")
    return items[0] if len(items) == 1 else torch.utils.data.ConcatDataset(items)


def _loader(dataset, batch_sampler, num_workers: int, collate_fn) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=batch_sampler, num_workers=int(num_workers), pin_memory=torch.cuda.is_available(),
        persistent_workers=int(num_workers) > 0,
        collate_fn=collate_fn if collate_fn is not None else torch.utils.data.default_collate,
        # Samples are functions of their position: the global RNG stays untouched, as in libai_lite.data.build.
        generator=torch.Generator().manual_seed(0))


def _has_libai_entries(dataset: Any) -> bool:
    items = dataset if isinstance(dataset, (list, tuple, ListConfig)) else [dataset]
    return any(isinstance(d, LibaiDataset) for d in items)


def build_nlp_train_loader(dataset, train_batch_size=None, test_batch_size=None, sampler=None, num_workers: int = 4,
                           consumed_samples: int = 0, seed: int = 0, collate_fn=None, dataset_mixer=None,
                           tokenizer=None, *, train_valid_test_num_samples, micro_batch_size: int,
                           data_parallel_rank: int = 0, data_parallel_size: int = 1, vocab_size: Optional[int] = None,
                           **runtime: Any):
    """LiBai's train-only loader builder (``dataloader.train``): ``(train_loader, None, None)``.

    Map-style datasets (a project's counterparts of LiBai's, e.g. pre-tokenized fine-tuning data) are read in a new
    order each pass (``MapDatasetView``) for the run's ``train_iter x global_batch`` samples, resuming after
    ``consumed_samples``; ``collate_fn`` batches them (``torch``'s default collation when None). GPT2Dataset /
    T5Dataset entries read all their documents. ``sampler`` has no counterpart but LiBai's default
    (``CyclicSampler(shuffle=True)``); the batch sizes and data position are the run's, as in
    ``build_nlp_train_val_test_loader``.
    """
    if sampler is not None:
        raise UsageError("dataloader.train.sampler: LiBai's default CyclicSampler(shuffle=True) is the only sampler "
                         "here; remove the key")
    if _has_libai_entries(dataset):
        loaders = build_nlp_train_val_test_loader(
            dataset, splits=[[1.0, 0.0, 0.0]], num_workers=num_workers, consumed_samples=consumed_samples,
            tokenizer=tokenizer, train_valid_test_num_samples=[int(train_valid_test_num_samples[0]), 0, 0],
            micro_batch_size=micro_batch_size, data_parallel_rank=data_parallel_rank,
            data_parallel_size=data_parallel_size, vocab_size=vocab_size, **runtime)
        return loaders[0], None, None
    total = int(train_valid_test_num_samples[0])
    data = _map_datasets(dataset, dataset_mixer)
    if vocab_size is not None:
        check_token_ids(data, vocab_size)  # a dataset that knows its id range (max_token_id) is checked
    view = MapDatasetView(data, total, shuffle=True, seed=int(seed), prepare=getattr(collate_fn, "prepare", None))
    batches = MegatronPretrainingSampler(total, int(consumed_samples), int(micro_batch_size), int(data_parallel_rank),
                                         int(data_parallel_size), drop_last=True)
    return _loader(view, batches, num_workers, collate_fn), None, None


def _train_loader_samples_per_epoch(dataset, dataset_mixer=None) -> int:
    dataset = instantiate(dataset)
    if _has_libai_entries(dataset):
        return _samples_per_epoch(dataset, splits=[[1.0, 0.0, 0.0]])
    return len(_map_datasets(dataset, dataset_mixer))


build_nlp_train_loader.samples_per_epoch = _train_loader_samples_per_epoch


def _no_effect(what: str, given: dict) -> None:
    set_keys = sorted(k for k, v in given.items() if v)
    if set_keys:
        warn_once(f"LiBai keys with no effect here: {what}({', '.join(set_keys)}) (the data was tokenized when "
                  f"preprocessed; the tokenizer here gives the vocabulary size and special ids)")


def GPT2Tokenizer(vocab_file, merges_file, do_lower_case: bool = False, do_chinese_wwm: bool = False,  # noqa: N802
                  add_bos_token: bool = False, **special_tokens: Any):
    """LiBai's GPT-2 tokenizer: this package's, which reads the same vocab.json and merges.txt."""
    _no_effect("GPT2Tokenizer", dict(do_lower_case=do_lower_case, do_chinese_wwm=do_chinese_wwm,
                                     add_bos_token=add_bos_token, **special_tokens))
    return _GPT2Tokenizer(vocab_file, merges_file)


def BertTokenizer(vocab_file, do_lower_case: bool = True, do_chinese_wwm: bool = False,  # noqa: N802
                  bos_token: Optional[str] = None, eos_token: Optional[str] = None,
                  additional_special_tokens: Optional[Sequence[str]] = None, add_bos_token: bool = False,
                  **others: Any):
    """LiBai's WordPiece tokenizer. LiBai's T5 configs add ``[BOS]``, ``[EOS]`` and ``<extra_id_0..N-1>``:
    this package's ``BertTokenizer(vocab_extra_ids=N)`` appends the same tokens in the same order."""
    extra = list(additional_special_tokens or [])
    if extra != [f"<extra_id_{i}>" for i in range(len(extra))]:
        raise UsageError(f"BertTokenizer(additional_special_tokens={extra[:3]}...): only T5 sentinels <extra_id_0> ... "
                         f"<extra_id_N-1>, in order, are supported here")
    for key, value, expected in (("bos_token", bos_token, "[BOS]"), ("eos_token", eos_token, "[EOS]")):
        if value not in (None, expected):
            raise UsageError(f"BertTokenizer({key}={value!r}): only {expected!r} is supported here")
    _no_effect("BertTokenizer", dict(do_chinese_wwm=do_chinese_wwm, add_bos_token=add_bos_token, **others))
    return _BertTokenizer(vocab_file, do_lower_case=do_lower_case, vocab_extra_ids=len(extra))
