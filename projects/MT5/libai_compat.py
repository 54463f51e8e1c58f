"""LiBai's T5 and MT5 model classes, as LiBai config files name them, built as this project's MT5.

* ``libai.models.T5Model`` / ``T5ForPreTraining`` (LiBai's Megatron-style T5: learned absolute positions,
  LayerNorm, GeLU) train here as T5 v1.0, ``model_type="t5"`` (relative position buckets, RMSNorm,
  ReLU, tied and scaled head): ``max_position_embeddings`` has no effect, which the start-up warns.
* ``projects.MT5.mt5_model.MT5Model`` / ``MT5ForPreTraining`` (LiBai's MT5 project) are this MT5.

LiBai's ``initializer_range`` is a standard deviation (every weight ``N(0, std)``, output projections
``N(0, std / sqrt(2 * hidden_layers))``, Megatron's scaled init), here MT5's is T5's
``initializer_factor``: these builders draw the weights LiBai's way instead, so
``initializer_range=0.02`` means what it meant in LiBai. ``projects/libai_compat.py`` lists them.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from omegaconf import OmegaConf

from libai_lite.config.libai_compat import warn_once
from libai_lite.utils.errors import UsageError

from . import mt5_model

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
    return _build(mt5_model.MT5Model, cfg, "t5")


def T5ForPreTraining(cfg):  # noqa: N802
    """LiBai's ``T5ForPreTraining``: this MT5 pretraining model with ``model_type="t5"``."""
    return _build(mt5_model.MT5ForPreTraining, cfg, "t5")


def MT5Model(cfg):  # noqa: N802
    """LiBai's MT5 project's ``MT5Model`` (its ``model_type`` kept)."""
    return _build(mt5_model.MT5Model, cfg, None)


def MT5ForPreTraining(cfg):  # noqa: N802
    """LiBai's MT5 project's ``MT5ForPreTraining`` (its ``model_type`` kept)."""
    return _build(mt5_model.MT5ForPreTraining, cfg, None)


def T5Dataset(name: str = "t5", data_prefix=None, indexed_dataset=None, max_seq_length: int = 512,  # noqa: N802
              max_seq_length_dec: int = 128, masked_lm_prob: float = 0.15, short_seq_prob: float = 0.1,
              seed: int = 1234, max_num_samples: int | None = None):
    """LiBai's T5 dataset (Megatron-LM's): over sentence-split data (``..._sentence``) Megatron's own samples
    (``data/megatron_t5_dataset.py``); over a ``..._document`` prefix T5 span corruption (``data/t5_dataset.py``),
    which the start-up warns about (``short_seq_prob`` then has no effect)."""
    from libai_lite.data.libai_compat import LibaiDataset, libai_data_prefix

    from .data.megatron_t5_dataset import build_megatron_t5_train_valid_test_loaders
    from .data.t5_dataset import build_t5_train_valid_test_loaders, t5_train_samples_per_epoch

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
