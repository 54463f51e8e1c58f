"""LiBai's T5 and MT5 model classes, as LiBai config files name them, built as this project's MT5.

``libai.models.T5Model`` / ``T5ForPreTraining`` train as T5 v1.0 (``model_type="t5"``), LiBai's MT5 and T5
projects' ``MT5Model`` / ``T5Model`` and their ``ForPreTraining`` classes as this MT5, and the T5 project's
``UnsuperviseT5Dataset`` / ``collate_fn`` as ``UnsuperviseT5Dataset`` and ``T5SpanCollator``.

LiBai's ``initializer_range`` is a standard deviation (every weight ``N(0, std)``, output projections
``N(0, std / sqrt(2 * hidden_layers))``), while MT5's is T5's ``initializer_factor``: these builders draw
the weights LiBai's way, so ``initializer_range=0.02`` means what it meant in LiBai.
``compat/libai/models.py`` lists the classes; docs/migrating.md, section "LiBai (OneFlow)", says what differs.
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping

import numpy as np
import torch
from omegaconf import OmegaConf

from libai_lite.config import LazyCall
from libai_lite.utils.errors import UsageError
from projects.MT5 import MT5ForPreTraining as _MT5ForPreTraining, MT5Model as _MT5Model
from projects.MT5.data.megatron_t5_dataset import build_megatron_t5_train_valid_test_loaders
from projects.MT5.data.t5_dataset import (build_t5_train_valid_test_loaders, random_spans_helper,
                                          random_spans_noise_mask, t5_train_samples_per_epoch)

from .notice import warn_once
from .data import LibaiDataset, libai_data_prefix

# Output projections (attention output, MLP output): Megatron's scaled init in LiBai.
_OUTPUT_WEIGHTS = ("dense.weight", "dense_4h_to_h.weight")


def _plain(cfg: Any) -> dict:
    return OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)


def translate_libai_t5_cfg(cfg: Mapping[str, Any], model_type: str | None = None) -> tuple[dict, float]:
    """(this MT5's cfg, LiBai's init std) for a LiBai T5/MT5 ``cfg``; refuses keys whose meaning is not built here."""
    cfg = _plain(cfg)
    std = float(cfg.pop("initializer_range", 0.02))
    if cfg.pop("apply_residual_post_layernorm", False):
        raise UsageError("model.cfg.apply_residual_post_layernorm=True (residual taken after the layer norm) is not "
                         "built by this T5; set it to False")
    if cfg.pop("pretrained_model_path", None):
        raise UsageError("model.cfg.pretrained_model_path: LiBai's loader of Hugging Face weights is "
                         "tools/hf_convert.py here; convert them and set train.load_weight to the result")
    positions = cfg.pop("max_position_embeddings", None)
    if model_type is not None:
        cfg["model_type"] = model_type
    if cfg.get("model_type") == "t5" and positions is not None:
        warn_once(f"LiBai keys with no effect here: model.cfg.max_position_embeddings={positions} (LiBai's T5Model, "
                  f"Megatron-style with learned positions, trains here as T5 v1.0: relative position buckets, "
                  f"RMSNorm, ReLU, tied and scaled head)")
    return cfg, std


def libai_init_(model: torch.nn.Module, std: float, hidden_layers: int) -> torch.nn.Module:
    """Draw ``model``'s matrices as LiBai does: ``N(0, std)``, output projections ``N(0, std / sqrt(2 L))``."""
    scaled = std / math.sqrt(2.0 * hidden_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                torch.nn.init.normal_(param, 0.0, scaled if name.endswith(_OUTPUT_WEIGHTS) else std)
    return model


def _build(cls, cfg, model_type: str | None):
    ours, std = translate_libai_t5_cfg(cfg, model_type)
    return libai_init_(cls(ours), std, int(ours["hidden_layers"]))


def T5Model(cfg):  # noqa: N802 - LiBai's class name
    """LiBai's ``T5Model``: this MT5 model with ``model_type="t5"``."""
    return _build(_MT5Model, cfg, "t5")


def T5ForPreTraining(cfg):  # noqa: N802
    """LiBai's ``T5ForPreTraining``: this MT5 pretraining model with ``model_type="t5"``."""
    return _build(_MT5ForPreTraining, cfg, "t5")


def MT5Model(cfg):  # noqa: N802
    """LiBai's MT5 project's ``MT5Model`` (its ``model_type`` kept)."""
    return _build(_MT5Model, cfg, None)


def MT5ForPreTraining(cfg):  # noqa: N802
    """LiBai's MT5 project's ``MT5ForPreTraining`` (its ``model_type`` kept)."""
    return _build(_MT5ForPreTraining, cfg, None)


def T5Dataset(name: str = "t5", data_prefix=None, indexed_dataset=None, max_seq_length: int = 512,  # noqa: N802
              max_seq_length_dec: int = 128, masked_lm_prob: float = 0.15, short_seq_prob: float = 0.1,
              seed: int = 1234, max_num_samples: int | None = None):
    """LiBai's T5 dataset (Megatron-LM's): over sentence-split data (``..._sentence``) Megatron's own samples
    (``projects/MT5/data/megatron_t5_dataset.py``); over a ``..._document`` prefix T5 span corruption
    (``projects/MT5/data/t5_dataset.py``), which the start-up warns about (``short_seq_prob`` then has no effect)."""
    prefix = libai_data_prefix(name, data_prefix, indexed_dataset)
    options = dict(max_seq_length=int(max_seq_length), max_seq_length_dec=int(max_seq_length_dec),
                   masked_lm_prob=float(masked_lm_prob), seed=int(seed))
    if prefix.endswith("_sentence"):
        return LibaiDataset("t5", prefix, build_megatron_t5_train_valid_test_loaders,
                            dict(options, short_seq_prob=float(short_seq_prob)), max_num_samples=max_num_samples)
    warn_once(f"LiBai keys with no effect here: T5Dataset(short_seq_prob) ({prefix} is not sentence-split, so "
              f"T5 span corruption over token windows builds the samples instead of Megatron's sentence-based "
              f"T5 dataset; preprocess with --split-sentences for that)")
    return LibaiDataset("t5", prefix, build_t5_train_valid_test_loaders, options,
                        samples_per_epoch=t5_train_samples_per_epoch, max_num_samples=max_num_samples)


def _t5_project_head(cfg) -> None:
    if cfg.get("model_type") == "t5":
        warn_once("LiBai's projects/T5 model with model_type='t5' ties the head without scaling the decoder output; "
                  "here the tied head is scaled by hidden_size^-0.5, as in T5 v1.0 and Hugging Face")


def T5ProjectModel(cfg):  # noqa: N802
    """LiBai's T5 project's ``T5Model`` (``projects.T5.models.t5_model``): this MT5 model, its ``model_type`` kept."""
    _t5_project_head(cfg)
    return _build(_MT5Model, cfg, None)


def T5ProjectForPreTraining(cfg):  # noqa: N802
    """LiBai's T5 project's ``T5ForPreTraining``: this MT5 pretraining model, its ``model_type`` kept."""
    _t5_project_head(cfg)
    return _build(_MT5ForPreTraining, cfg, None)


class UnsuperviseT5Dataset(torch.utils.data.Dataset):
    """LiBai's T5 project's dataset: the ``input_ids`` rows of ten Hugging Face ``datasets`` folders, read lazily.

    As in LiBai, ``data_path`` names the first (``.../part_0``) and the folders are it with its last character
    replaced by 0 to 9. Reading them needs the ``datasets`` library (``pip install -e .[corpora]``).
    """

    def __init__(self, data_path):
        try:
            import datasets
        except ImportError:
            raise UsageError("UnsuperviseT5Dataset reads Hugging Face datasets folders: pip install -e .[corpora] "
                             "(the datasets library)") from None
        path = os.fspath(data_path)
        parts = [path[:-1] + str(i) for i in range(10)]
        missing = [p for p in parts if not os.path.isdir(p)]
        if missing:
            raise UsageError(f"UnsuperviseT5Dataset(data_path={path}) reads {parts[0]} ... {parts[-1]}, as LiBai "
                             f"does; {missing[0]} is not a folder (relative paths start at {os.getcwd()})")
        loaded = []
        for part in parts:
            try:
                loaded.append(datasets.load_from_disk(part))
            except Exception as e:  # not a save_to_disk folder
                why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
                raise UsageError(f"UnsuperviseT5Dataset: {part} is not a Hugging Face datasets folder ({why}); "
                                 f"write it with save_to_disk") from None
        if any("input_ids" not in d.column_names for d in loaded):
            raise UsageError(f"UnsuperviseT5Dataset: the folders under {os.path.dirname(path)} need an input_ids "
                             f"column of pre-tokenized windows")
        self.data = datasets.concatenate_datasets(loaded).select_columns(["input_ids"])

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, idx: int) -> dict:
        return {"input_ids": np.asarray(self.data[int(idx)]["input_ids"], dtype=np.int64)}


class T5SpanCollator:
    """LiBai's T5 project's ``collate_fn``: T5 span corruption of windows of ``raw_length`` tokens.

    ``raw_length`` is T5's ``random_spans_helper`` length for ``max_seq_length`` (568 for 512 at 15% noise in
    spans of 3), which the data must hold, as LiBai requires; span ``k`` becomes sentinel ``vocab_size - 1 - k``,
    the encoder input and the labels end with ``eos_token_id``, and the decoder starts with
    ``decoder_start_token_id``. LiBai draws the spans from NumPy's global generator; here ``prepare`` draws them
    from ``numpy.random.default_rng((seed, position))``, so a sample depends only on its place in the run.
    Every target token counts once in the loss: LiBai's collate passes the label ids as its loss mask, which
    weights each token by its id.
    """

    def __init__(self, vocab_size: int, max_seq_length: int, noise_density: float, mean_noise_span_length: float,
                 eos_token_id: int = 1, pad_token_id: int = 0, decoder_start_token_id: int = 0, seed: int = 0):
        self.vocab_size, self.max_seq_length = int(vocab_size), int(max_seq_length)
        self.noise_density, self.mean_noise_span_length = float(noise_density), float(mean_noise_span_length)
        self.eos, self.pad, self.start = int(eos_token_id), int(pad_token_id), int(decoder_start_token_id)
        self.seed = int(seed)
        self.raw_length, self.targets_length = random_spans_helper(self.max_seq_length, self.noise_density,
                                                                   self.mean_noise_span_length)
        warn_once("LiBai's projects/T5 collate_fn weights each target token's loss by its token id (it passes the "
                  "labels as loss_mask); here every target token counts once")

    def prepare(self, sample, position: int) -> dict:
        """One span-corrupted sample (the batch keys of this MT5) of the window at ``position`` of the run."""
        tokens = np.asarray(sample["input_ids"] if isinstance(sample, Mapping) else sample, dtype=np.int64)
        if tokens.ndim != 1 or tokens.size != self.raw_length:
            raise UsageError(f"a T5 sample holds {tokens.size} tokens; collate_fn(max_seq_length="
                             f"{self.max_seq_length}, noise_density={self.noise_density}, mean_noise_span_length="
                             f"{self.mean_noise_span_length}) needs windows of {self.raw_length}, as in LiBai")
        rng = np.random.default_rng((self.seed, int(position)))
        noise = random_spans_noise_mask(tokens.size, self.noise_density, self.mean_noise_span_length, rng)
        span_start = noise & ~np.concatenate(([False], noise[:-1]))
        sentinels = self.vocab_size - 1 - np.arange(int(span_start.sum()), dtype=np.int64)
        encoder = tokens.copy()
        encoder[span_start] = sentinels
        encoder = np.append(encoder[~noise | span_start], self.eos)
        labels = np.append(np.insert(tokens[noise], np.flatnonzero(span_start[noise]), sentinels), self.eos)
        decoder = np.concatenate(([self.start], labels[:-1]))
        return {
            "encoder_input_ids": torch.from_numpy(encoder),
            "decoder_input_ids": torch.from_numpy(decoder),
            "labels": torch.from_numpy(labels),
            "encoder_attn_mask": torch.ones(encoder.size, dtype=torch.bool),
            "decoder_attn_mask": torch.ones(decoder.size, dtype=torch.bool),
            "encoder_decoder_attn_mask": torch.ones(encoder.size, dtype=torch.bool),
        }

    def __call__(self, samples: list) -> dict:
        return torch.utils.data.default_collate(samples)


def collate_fn(vocab_size, max_seq_length, noise_density, mean_noise_span_length, eos_token_id=1,  # noqa: N802
               pad_token_id=0, decoder_start_token_id=0):
    """LiBai's ``collate_fn(...)``, called in the config file: here a lazy ``T5SpanCollator`` the loader builds, so
    the config keeps it as keys (``dataloader.train.collate_fn.max_seq_length=...``) and saves it as YAML."""
    return LazyCall(T5SpanCollator)(vocab_size=vocab_size, max_seq_length=max_seq_length, noise_density=noise_density,
                                    mean_noise_span_length=mean_noise_span_length, eos_token_id=eos_token_id,
                                    pad_token_id=pad_token_id, decoder_start_token_id=decoder_start_token_id)
