"""LiBai's Llama project (its ``projects/Llama``) as LiBai config files name it, built from this Llama.

* ``projects.Llama.llama.LlamaForCausalLM`` (LiBai's Llama 2: RMSNorm, rotary positions, SwiGLU, no biases,
  multi-head attention, an untied head) is ``LlamaForPreTraining`` with LiBai's cfg keys renamed
  (``translate_libai_llama_cfg``); keys of this Llama (``num_key_value_heads``, ``rope_theta``, ...) pass through.
* ``projects.Llama.tokenizer.LlamaTokenizer(pretrained_model_path)`` is the SentencePiece ``tokenizer.model``
  read as Hugging Face's Llama tokenizer reads it (``SentencePieceTokenizer(style="t5")``: the model's own ids).
* ``projects.Llama.dataset.AlpacaDataset(path)`` reads the pre-tokenized SFT samples that LiBai's
  ``utils/prepare_alpaca.py`` makes, saved with ``torch.save`` (LiBai's ``flow.load`` reads that format too).

``compat/libai/models.py`` lists them.
"""
from __future__ import annotations

import inspect
import os
import zipfile
from typing import Any, Mapping

import torch
from omegaconf import OmegaConf

from libai_lite.data.gpt_dataset import IGNORE_INDEX
from libai_lite.tokenizer import SentencePieceTokenizer
from libai_lite.utils.errors import UsageError
from projects.Llama.modeling import LlamaForPreTraining, LlamaModel

from .notice import warn_once

# LiBai's key -> this Llama's.
_RENAMED = {"intermediate_size": "ffn_hidden_size", "max_position_embeddings": "max_seq_length",
            "rms_norm_eps": "layernorm_epsilon"}
# Read by LiBai's generation utilities only; tools/generate.py takes its own options.
_GENERATION = ("is_encoder_decoder", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
               "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
               "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
               "num_return_sequences", "chunk_size_feed_forward", "output_scores", "use_cache", "bos_token_id",
               "eos_token_id", "pad_token_id", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
               "exponential_decay_length_penalty", "sep_token_id", "decoder_start_token_id")
# Named by compat.libai.config's warning with the other model.cfg keys of no effect.
_CORE_NAMED = ("amp_enabled", "scale_mask_softmax_fusion")
_OURS = set(inspect.signature(LlamaModel.__init__).parameters) - {"self"}


def translate_libai_llama_cfg(cfg: Mapping[str, Any]) -> dict:
    """This Llama's cfg for the cfg of LiBai's ``LlamaForCausalLM``; names the keys with no effect in one warning.

    LiBai's Llama never reads ``rope_scaling``, ``tie_word_embeddings`` or ``pretraining_tp`` (its head is always
    untied, its rotary frequencies unscaled), so they keep that meaning here: no effect.
    """
    cfg = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    act = cfg.pop("hidden_act", "silu")
    if act != "silu":
        raise UsageError(f"model.cfg.hidden_act={act!r}: LiBai's Llama and this one build SwiGLU (silu) MLPs only; "
                         f"set model.cfg.hidden_act='silu'")
    if cfg.pop("pretrained_model_path", None):
        raise UsageError("model.cfg.pretrained_model_path: LiBai's loader of Hugging Face weights is "
                         "tools/hf_convert.py import --model llama here; convert them, set train.load_weight to the "
                         "result and model.cfg.pretrained_model_path=null")
    ignored = []
    for key, default in (("rope_scaling", None), ("tie_word_embeddings", False), ("pretraining_tp", 1)):
        value = cfg.pop(key, default)
        if value != default:
            ignored.append(f"model.cfg.{key}={value} (LiBai's Llama does not read it)")
    generation = [k for k in _GENERATION if cfg.pop(k, None) is not None]
    if generation:
        more = f" and {len(generation) - 4} more" if len(generation) > 4 else ""
        ignored.append(f"model.cfg's generation settings {', '.join(generation[:4])}{more} (read by LiBai's "
                       f"generator only; tools/generate.py takes its own options)")
    for key in _CORE_NAMED:
        cfg.pop(key, None)
    ours = {_RENAMED.get(k, k): v for k, v in cfg.items()}
    unknown = sorted(k for k in ours if k not in _OURS)
    ignored += [f"model.cfg.{k} (LiBai's Llama does not read it)" for k in unknown]
    if ignored:
        warn_once("LiBai keys with no effect here: " + "; ".join(ignored))
    return {k: v for k, v in ours.items() if k in _OURS}


def LlamaForCausalLM(cfg):  # noqa: N802 - LiBai's class name
    """LiBai's ``projects.Llama.llama.LlamaForCausalLM``: this ``LlamaForPreTraining``."""
    return LlamaForPreTraining(translate_libai_llama_cfg(cfg))


def LlamaTokenizer(pretrained_model_path=None, bos_token: str = "<s>", eos_token: str = "</s>",  # noqa: N802
                   pad_token: str = "<unk>", bos_token_id=None, eos_token_id=None) -> SentencePieceTokenizer:
    """LiBai's Llama tokenizer: the SentencePiece model's own bos/eos ids, as LiBai takes them when it has them."""
    if pretrained_model_path is None:
        raise UsageError("tokenization.tokenizer.pretrained_model_path is not set; set it to the Llama "
                         "tokenizer.model (SentencePiece) file")
    return SentencePieceTokenizer(pretrained_model_path, style="t5")


def _read_samples(path: str) -> list:
    if not os.path.isfile(path):
        raise UsageError(f"AlpacaDataset: {path} not found (relative paths start at {os.getcwd()}); set the "
                         f"dataset's path to the file LiBai's prepare_alpaca.py wrote (dataset_path/train)")
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            head = f.read(256)
        if b"oneflow" in head:
            raise UsageError(f"AlpacaDataset: {path} was written by flow.save, whose tensors only LiBai reads; "
                             f"save the samples with torch.save([{{'input_ids': LongTensor, 'labels': LongTensor}}, "
                             f"...], path) instead (LiBai's flow.load reads that file too)")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a pickle of anything else, a truncated file
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        raise UsageError(f"AlpacaDataset: cannot read {path} ({why}); it must be a torch.save file of "
                         f"[{{'input_ids': ..., 'labels': ...}}, ...]") from None
    if not isinstance(data, (list, tuple)) or not data:
        raise UsageError(f"AlpacaDataset: {path} holds {type(data).__name__}, not a non-empty list of "
                         f"{{'input_ids', 'labels'}} samples")
    return list(data)


class AlpacaDataset(torch.utils.data.Dataset):
    """LiBai's Alpaca SFT samples: ``{"input_ids", "labels"}`` of one padded length, labels already shifted.

    LiBai's Llama loss skips labels of 0 and below (prepare_alpaca.py marks the prompt and the padding -1, and
    token 0 is Llama's ``<unk>``): those become ``IGNORE_INDEX`` here, so the loss covers the same tokens.
    ``tokenizer`` is LiBai's argument; the samples are tokenized already.
    """

    def __init__(self, path, tokenizer=None):
        self.data_prefix = os.fspath(path)
        rows = _read_samples(self.data_prefix)
        self.input_ids, self.labels = [], []
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping) or "input_ids" not in row or "labels" not in row:
                raise UsageError(f"AlpacaDataset: sample {i} of {path} is not a {{'input_ids', 'labels'}} dict")
            ids, labels = (torch.as_tensor(row[k], dtype=torch.long).reshape(-1) for k in ("input_ids", "labels"))
            if ids.numel() != labels.numel() or ids.numel() != torch.as_tensor(rows[0]["input_ids"]).numel():
                raise UsageError(f"AlpacaDataset: sample {i} of {path} has {ids.numel()} input ids and "
                                 f"{labels.numel()} labels; every sample needs the same length for both "
                                 f"(prepare_alpaca.py pads them to max_seq_length - 1)")
            self.input_ids.append(ids)
            self.labels.append(torch.where(labels > 0, labels, IGNORE_INDEX))
        stacked = torch.stack(self.input_ids)
        # Read by the loader's check against the vocabulary (libai_lite.data.gpt_dataset.check_token_ids).
        self.min_token_id, self.max_token_id = int(stacked.min()), int(stacked.max())

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, idx: int) -> dict:
        return {"input_ids": self.input_ids[idx], "labels": self.labels[idx]}
