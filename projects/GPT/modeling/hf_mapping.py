"""Hugging Face GPT-2 (``GPT2LMHeadModel``) <-> ``GPTModel``: config keys and weights, one entry per tensor.

A bare ``GPT2Model`` checkpoint (keys without ``transformer.``, as OpenAI's ``gpt2`` on the Hub) is accepted
on import. GPT-2's ``Conv1D`` weights are ``[in, out]`` (ours ``[out, in]``: transposed), and ``c_attn``'s
``[q; k; v]`` rows become our head-major ``query_key_value`` ``[heads, 3, head_size]``, so a tensor-parallel
split hands each rank whole heads. The LM head is the token embedding in both: written once, and an HF
``lm_head.weight`` that differs from it is refused. Pure functions on tensors (the files are
``libai_lite/checkpoint/hf_io.py``'s), registered for ``GPTForPreTraining`` on import.
"""
from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

from libai_lite.checkpoint.hf import HFTokenizer, StateDictSource, register_hf_model
from libai_lite.checkpoint.hf_io import find_hf_tokenizer
from libai_lite.utils.errors import UsageError

from .gpt_model import GPTForPreTraining, GPTModel

HF_MODEL_TYPE = "gpt2"
HF_ARCHITECTURE = "GPT2LMHeadModel"
# Our keys (GPTModel) whose first dimension is the vocabulary: padded on import, trimmed on export.
EMBEDDING_KEY = "embeddings.token_embeddings.weight"
VOCAB_KEYS = (EMBEDDING_KEY, "lm_head.weight")

# HF activation_function -> ours, and back. "gelu_new" is GPT-2's tanh approximation.
_ACT_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
                "silu": "silu", "swish": "silu"}
_ACT_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}
# Causal-mask buffers that older transformers versions saved with the weights.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
_DEFAULTS = {k: p.default for k, p in inspect.signature(GPTModel.__init__).parameters.items()
             if p.default is not inspect.Parameter.empty}


def _hf(cfg: Mapping[str, Any], key: str, *aliases: str, default: Any = inspect.Parameter.empty) -> Any:
    for name in (key, *aliases):
        if cfg.get(name) is not None:
            return cfg[name]
    if default is inspect.Parameter.empty:
        raise UsageError(f"config.json has no '{key}': it is not a complete GPT-2 config; re-save it with transformers")
    return default


def config_from_hf(hf_config: Mapping[str, Any]) -> dict:
    """Our ``model.cfg`` (GPTModel arguments) for a Hugging Face GPT-2 ``config.json`` dict."""
    c = hf_config
    act = c.get("activation_function", "gelu_new")
    if act not in _ACT_FROM_HF:
        raise UsageError(f"config.json activation_function={act!r} is not supported; "
                         f"GPTModel runs {', '.join(sorted(_ACT_FROM_HF))}")
    for key, wanted in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
        if bool(c.get(key, wanted)) != wanted:
            raise UsageError(f"config.json sets {key}={c[key]} but GPTModel only runs {key}={wanted}; "
                             f"this GPT-2 variant cannot be converted")
    hidden = int(_hf(c, "n_embd", "hidden_size"))
    heads = int(_hf(c, "n_head", "num_attention_heads"))
    if hidden % heads:
        raise UsageError(f"config.json n_embd={hidden} is not divisible by n_head={heads}")
    return dict(
        hidden_layers=int(_hf(c, "n_layer", "num_hidden_layers")),
        vocab_size=int(_hf(c, "vocab_size")),
        hidden_size=hidden,
        ffn_hidden_size=int(_hf(c, "n_inner", default=4 * hidden)),
        num_attention_heads=heads,
        max_seq_length=int(_hf(c, "n_positions", "max_position_embeddings", "n_ctx", default=1024)),
        embedding_dropout_prob=float(_hf(c, "embd_pdrop", default=0.1)),
        attention_dropout_prob=float(_hf(c, "attn_pdrop", default=0.1)),
        output_dropout_prob=float(_hf(c, "resid_pdrop", default=0.1)),
        layernorm_epsilon=float(_hf(c, "layer_norm_epsilon", default=1e-5)),
        initializer_range=float(_hf(c, "initializer_range", default=0.02)),
        activation=_ACT_FROM_HF[act],
    )


def _ours(cfg: Mapping[str, Any], key: str) -> Any:
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if key in _DEFAULTS:
        return _DEFAULTS[key]
    raise UsageError(f"model.cfg has no '{key}'; GPTModel needs it")


def config_to_hf(model_cfg: Mapping[str, Any]) -> dict:
    """A Hugging Face ``GPT2Config`` dict (``config.json``) for our ``model.cfg``."""
    cfg = dict(model_cfg)
    if (cfg.get("moe") or {}).get("enabled"):
        raise UsageError("model.cfg.moe is enabled: mixture-of-experts layers have no GPT-2 equivalent, "
                         "so this model cannot be exported to Hugging Face")
    if _ours(cfg, "apply_residual_post_layernorm"):
        raise UsageError("model.cfg.apply_residual_post_layernorm=True has no GPT-2 equivalent; "
                         "only pre-LN GPT models can be exported")
    act = _ours(cfg, "activation")
    if act not in _ACT_TO_HF:
        raise UsageError(f"model.cfg.activation={act!r} has no GPT-2 equivalent; use one of {sorted(_ACT_TO_HF)}")
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        "vocab_size": int(_ours(cfg, "vocab_size")),
        "n_positions": int(_ours(cfg, "max_seq_length")),
        "n_embd": int(_ours(cfg, "hidden_size")),
        "n_layer": int(_ours(cfg, "hidden_layers")),
        "n_head": int(_ours(cfg, "num_attention_heads")),
        "n_inner": int(_ours(cfg, "ffn_hidden_size")),
        "activation_function": _ACT_TO_HF[act],
        "resid_pdrop": float(_ours(cfg, "output_dropout_prob")),
        "embd_pdrop": float(_ours(cfg, "embedding_dropout_prob")),
        "attn_pdrop": float(_ours(cfg, "attention_dropout_prob")),
        "layer_norm_epsilon": float(_ours(cfg, "layernorm_epsilon")),
        "initializer_range": float(_ours(cfg, "initializer_range")),
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def special_token_ids(tokenizer) -> dict:
    """``config.json`` token ids for one of our tokenizers: GPT-2's end-of-document id is bos and eos."""
    eod = getattr(tokenizer, "eod_id", None)
    return {"bos_token_id": eod, "eos_token_id": eod}


def find_tokenizer(hf_dir: str) -> HFTokenizer | None:
    """Our GPT2Tokenizer for a directory's ``vocab.json`` + ``merges.txt``, or None when it has none."""
    # The Hub's GPT-2 directories also hold a tokenizer.json: the GPT-2 files are read, as GPT2Tokenizer.
    return find_hf_tokenizer(hf_dir, formats=("gpt2",))


def _sizes(cfg: Mapping[str, Any]) -> tuple[int, int, int]:
    heads = int(_ours(cfg, "num_attention_heads"))
    return int(_ours(cfg, "hidden_layers")), heads, int(_ours(cfg, "hidden_size")) // heads


def _qkv_to_head_major(t: torch.Tensor, heads: int, head_size: int) -> torch.Tensor:
    """Rows ``[q; k; v]`` (each heads x head_size) -> ``[heads, 3, head_size]``."""
    return t.reshape(3, heads, head_size, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _qkv_from_head_major(t: torch.Tensor, heads: int, head_size: int) -> torch.Tensor:
    return t.reshape(heads, 3, head_size, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def state_dict_from_hf(sd: Mapping[str, torch.Tensor], model_cfg: Mapping[str, Any]) -> dict:
    """GPTModel's state dict (``lm_head.weight`` included, the tied embedding) from GPT-2 weights."""
    layers, heads, head_size = _sizes(model_cfg)
    sd = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in sd.items()}
    src = StateDictSource(sd, "the GPT-2 weights")
    wte = src("wte.weight")
    out = {
        EMBEDDING_KEY: wte,
        "embeddings.position_embeddings.weight": src("wpe.weight"),
        "final_layernorm.weight": src("ln_f.weight"),
        "final_layernorm.bias": src("ln_f.bias"),
        "lm_head.weight": wte,
    }
    for i in range(layers):
        p, q = f"h.{i}.", f"layers.{i}."
        for ours, theirs in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
            out[f"{q}{ours}.weight"] = src(f"{p}{theirs}.weight")
            out[f"{q}{ours}.bias"] = src(f"{p}{theirs}.bias")
        out[q + "self_attention.query_key_value.weight"] = _qkv_to_head_major(
            src(p + "attn.c_attn.weight").t(), heads, head_size)
        out[q + "self_attention.query_key_value.bias"] = _qkv_to_head_major(
            src(p + "attn.c_attn.bias"), heads, head_size)
        for ours, theirs in (("self_attention.dense", "attn.c_proj"), ("mlp.dense_h_to_4h", "mlp.c_fc"),
                             ("mlp.dense_4h_to_h", "mlp.c_proj")):
            out[f"{q}{ours}.weight"] = src(f"{p}{theirs}.weight").t()
            out[f"{q}{ours}.bias"] = src(f"{p}{theirs}.bias")
    if "lm_head.weight" in sd:
        src("lm_head.weight")
        if not torch.equal(sd["lm_head.weight"], wte):
            raise UsageError("the GPT-2 weights hold an lm_head.weight different from wte.weight; "
                             "GPTModel ties its head to the token embedding, so an untied GPT-2 cannot be converted")
    src.check_all_used(ignore=lambda k: k.endswith(_IGNORED_SUFFIXES))
    return {k: v.contiguous() for k, v in out.items()}


def state_dict_to_hf(sd: Mapping[str, torch.Tensor], model_cfg: Mapping[str, Any]) -> dict:
    """``GPT2LMHeadModel`` weights from GPTModel's state dict (the tied head written once, as wte)."""
    layers, heads, head_size = _sizes(model_cfg)
    src = StateDictSource(sd, "the GPT model state dict")
    out = {
        "transformer.wte.weight": src(EMBEDDING_KEY),
        "transformer.wpe.weight": src("embeddings.position_embeddings.weight"),
        "transformer.ln_f.weight": src("final_layernorm.weight"),
        "transformer.ln_f.bias": src("final_layernorm.bias"),
    }
    for i in range(layers):
        p, q = f"transformer.h.{i}.", f"layers.{i}."
        for ours, theirs in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
            out[f"{p}{theirs}.weight"] = src(f"{q}{ours}.weight")
            out[f"{p}{theirs}.bias"] = src(f"{q}{ours}.bias")
        out[p + "attn.c_attn.weight"] = _qkv_from_head_major(
            src(q + "self_attention.query_key_value.weight"), heads, head_size).t()
        out[p + "attn.c_attn.bias"] = _qkv_from_head_major(
            src(q + "self_attention.query_key_value.bias"), heads, head_size)
        for ours, theirs in (("self_attention.dense", "attn.c_proj"), ("mlp.dense_h_to_4h", "mlp.c_fc"),
                             ("mlp.dense_4h_to_h", "mlp.c_proj")):
            out[f"{p}{theirs}.weight"] = src(f"{q}{ours}.weight").t()
            out[f"{p}{theirs}.bias"] = src(f"{q}{ours}.bias")
    if "lm_head.weight" in sd:
        src("lm_head.weight")
        if not torch.equal(sd["lm_head.weight"], sd[EMBEDDING_KEY]):
            raise UsageError("lm_head.weight differs from the token embedding: GPT-2 ties them, so this model "
                             "cannot be exported as GPT-2")
    src.check_all_used()
    return {k: v.contiguous() for k, v in out.items()}


register_hf_model(
    __name__, model_class=GPTForPreTraining, model_types=(HF_MODEL_TYPE,), inner="GPT_model", vocab_keys=VOCAB_KEYS,
    # Named from this module, so a copy of the project starts from the copy's own config.
    finetune_config=__name__.rsplit(".", 2)[0] + ".configs.gpt2_pretrain",
)
