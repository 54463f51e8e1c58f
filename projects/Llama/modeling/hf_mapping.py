"""Hugging Face ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``Qwen3MoeForCausalLM`` and ``MixtralForCausalLM`` <-> ``LlamaModel``.

HF's ``q_proj``/``k_proj``/``v_proj`` become our fused ``query_key_value`` laid out per key/value head,
``[kv_heads, group + 2, head_size]``, so a tensor-parallel split hands each rank whole groups; RoPE uses
HF's rotate-half convention, so rows load unpermuted. ``gate_proj`` and ``up_proj`` join, rows interleaved,
into our gated ``dense_h_to_4h``. Mixtral's sparse blocks are our MoE layers (router ``gate``, experts'
``w1``/``w3``/``w2`` or transformers 5's fused ``gate_up_proj``/``down_proj``; export writes the Hub's
layout). Mistral's ``sliding_window`` maps to ``model.cfg.sliding_window`` and a Llama checkpoint with a
window exports as ``MistralForCausalLM``; Qwen2's and Qwen3's per-layer window is refused. Qwen3's per-head
``q_norm``/``k_norm`` are our attention's ``qk_norm`` scales (one ``head_dim`` vector each per layer).
Qwen3-MoE is Qwen3's attention with every ``decoder_sparse_step``-th feed-forward a mixture of narrow experts
(``moe_intermediate_size``, our ``moe.ffn_hidden_size``; router ``mlp.gate``, experts ``mlp.experts.{e}.*_proj``
or the fused layout), the others Qwen3's dense MLP (``intermediate_size``).
"""
from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

from libai_lite.checkpoint.hf import HFTokenizer, StateDictSource, register_hf_model
from libai_lite.checkpoint.hf_io import find_hf_tokenizer
from libai_lite.layers.mlp import join_gate_up, split_gate_up
from libai_lite.utils.errors import UsageError

from .llama_model import LlamaForPreTraining, LlamaModel

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
_QK_NORM = ("qwen3", "qwen3_moe")
EMBEDDING_KEY = "embeddings.weight"
VOCAB_KEYS = (EMBEDDING_KEY, "lm_head.weight")
_DEFAULTS = {k: p.default for k, p in inspect.signature(LlamaModel.__init__).parameters.items()
             if p.default is not inspect.Parameter.empty}


def _hf(cfg: Mapping[str, Any], key: str, default: Any = inspect.Parameter.empty) -> Any:
    if cfg.get(key) is not None:
        return cfg[key]
    if default is inspect.Parameter.empty:
        raise UsageError(f"config.json has no '{key}': it is not a complete Llama-family config; re-save it with "
                         f"transformers")
    return default


def _rope(c: Mapping[str, Any]) -> tuple[float, dict | None]:
    """``(theta, scaling)`` from either spelling: transformers 5's ``rope_parameters`` or ``rope_theta`` +
    ``rope_scaling``."""
    params = dict(c.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", c.get("rope_theta") or 10000.0))
    scaling = params or dict(c.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise UsageError(f"config.json rope type {kind!r} is not supported; LlamaModel runs 'default' and 'llama3'")
    return theta, (scaling if kind == "llama3" else None)


def config_from_hf(hf_config: Mapping[str, Any]) -> dict:
    """Our ``model.cfg`` (LlamaModel arguments) for a Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE or Mixtral
    ``config.json`` dict."""
    c = hf_config
    if c.get("hidden_act", "silu") != "silu":
        raise UsageError(f"config.json hidden_act={c['hidden_act']!r}; LlamaModel runs the SwiGLU (silu) MLP only")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise UsageError(f"config.json sets {key}=true; LlamaModel has no bias there (only Qwen2's q/k/v bias), "
                             f"so this model cannot be converted")
    heads = int(_hf(c, "num_attention_heads"))
    hidden = int(_hf(c, "hidden_size"))
    head_size = int(c.get("head_dim") or hidden // heads)
    theta, scaling = _rope(c)
    window = c.get("sliding_window") if c.get("model_type") in ("mistral", "mixtral") else None
    if c.get("model_type") in ("qwen2", *_QK_NORM) and c.get("use_sliding_window"):
        raise UsageError("config.json sets use_sliding_window=true: Qwen's window on the layers from "
                         "max_window_layers on is not supported, so this model cannot be converted")
    return dict(
        hidden_layers=int(_hf(c, "num_hidden_layers")),
        vocab_size=int(_hf(c, "vocab_size")),
        hidden_size=hidden,
        ffn_hidden_size=int(_hf(c, "intermediate_size")),
        num_attention_heads=heads,
        num_key_value_heads=int(c.get("num_key_value_heads") or heads),
        head_size=None if head_size * heads == hidden else head_size,
        max_seq_length=int(_hf(c, "max_position_embeddings", 2048)),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_dropout_prob=float(c.get("attention_dropout") or 0.0),
        output_dropout_prob=0.0,
        layernorm_epsilon=float(_hf(c, "rms_norm_eps", 1e-6)),
        initializer_range=float(_hf(c, "initializer_range", 0.02)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=c.get("model_type") == "qwen2",
        moe=_moe_from_hf(c),
        sliding_window=None if window is None else int(window),
        qk_norm=c.get("model_type") in _QK_NORM,
    )


def _moe_from_hf(c: Mapping[str, Any]) -> dict | None:
    if c.get("model_type") == "qwen3_moe":
        return _qwen3_moe_from_hf(c)
    if c.get("model_type") != "mixtral":
        return None
    return dict(enabled=True, num_experts=int(_hf(c, "num_local_experts")), top_k=int(_hf(c, "num_experts_per_tok")),
                ep_size=1, capacity_factor=None, aux_loss_weight=float(c.get("router_aux_loss_coef") or 0.0),
                every_n_layers=1, jitter_noise=float(c.get("router_jitter_noise") or 0.0))


def _qwen3_moe_from_hf(c: Mapping[str, Any]) -> dict | None:
    # The Hub's config.json says num_experts; transformers 5 saves it as num_local_experts.
    experts = int(_hf(c, "num_experts", None) or _hf(c, "num_local_experts", 0))
    top_k = int(_hf(c, "num_experts_per_tok"))
    if experts == 0:
        return None
    if c.get("mlp_only_layers"):
        raise UsageError(f"config.json sets mlp_only_layers={list(c['mlp_only_layers'])}: dense layers other than "
                         f"every decoder_sparse_step-th are not supported, so this model cannot be converted")
    if top_k > 1 and not c.get("norm_topk_prob", True):
        raise UsageError("config.json sets norm_topk_prob=false: the MoE router renormalises the top-k weights "
                         "(as every released Qwen3-MoE does), so this model cannot be converted")
    return dict(enabled=True, num_experts=experts, top_k=top_k, ep_size=1, capacity_factor=None,
                aux_loss_weight=float(c.get("router_aux_loss_coef") or 0.0),
                every_n_layers=int(c.get("decoder_sparse_step") or 1), jitter_noise=0.0,
                ffn_hidden_size=int(_hf(c, "moe_intermediate_size")))


def _ours(cfg: Mapping[str, Any], key: str) -> Any:
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if key in _DEFAULTS:
        return _DEFAULTS[key]
    raise UsageError(f"model.cfg has no '{key}'; LlamaModel needs it")


def config_to_hf(model_cfg: Mapping[str, Any]) -> dict:
    """A Hugging Face config dict (``config.json``): ``qwen3_moe`` with per-head q/k norms and MoE layers,
    ``mixtral`` with MoE layers alone, ``qwen2`` when q/k/v have biases, ``qwen3`` with per-head q/k norms,
    ``mistral`` with a sliding window, else ``llama``."""
    cfg = dict(model_cfg)
    moe = dict(cfg.get("moe") or {})
    window = cfg.get("sliding_window")
    qk_norm = bool(_ours(cfg, "qk_norm"))
    model_type = ("qwen3_moe" if moe.get("enabled") and qk_norm else "mixtral" if moe.get("enabled")
                  else "qwen2" if _ours(cfg, "qkv_bias") else "qwen3" if qk_norm else "mistral" if window else "llama")
    if qk_norm and (_ours(cfg, "qkv_bias") or window):
        raise UsageError(f"model.cfg sets qk_norm (Qwen3) with q/k/v biases or a sliding_window: "
                         f"{_ARCHITECTURES[model_type]} has neither, so this model cannot be exported")
    if moe.get("enabled") and (moe.get("router", "softmax") != "softmax" or int(moe.get("num_shared_experts") or 0)):
        raise UsageError(f"model.cfg.moe has router={moe.get('router', 'softmax')!r} and num_shared_experts="
                         f"{int(moe.get('num_shared_experts') or 0)}: {_ARCHITECTURES[model_type]} routes by softmax "
                         f"without shared experts, so this model cannot be exported")
    if model_type == "mixtral" and moe.get("ffn_hidden_size") not in (None, int(_ours(cfg, "ffn_hidden_size"))):
        raise UsageError("model.cfg.moe.ffn_hidden_size differs from ffn_hidden_size: Mixtral's experts are as wide "
                         "as its feed-forward, so this model cannot be exported (with qk_norm it is Qwen3-MoE)")
    if model_type == "qwen2" and window:
        raise UsageError("model.cfg has q/k/v biases (Qwen2) and a sliding_window: no Hugging Face class has both, "
                         "so this model cannot be exported")
    if model_type == "mixtral" and (int(moe.get("every_n_layers", 1)) != 1 or _ours(cfg, "qkv_bias")):
        raise UsageError("model.cfg.moe has every_n_layers != 1 or q/k/v biases: Mixtral makes every layer a "
                         "mixture of experts without biases, so this model cannot be exported")
    heads = int(_ours(cfg, "num_attention_heads"))
    hidden = int(_ours(cfg, "hidden_size"))
    scaling = _ours(cfg, "rope_scaling")
    rope = {"rope_type": "default", **(dict(scaling) if scaling else {}), "rope_theta": float(_ours(cfg, "rope_theta"))}
    out = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": int(_ours(cfg, "vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(_ours(cfg, "ffn_hidden_size")),
        "num_hidden_layers": int(_ours(cfg, "hidden_layers")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_ours(cfg, "num_key_value_heads") or heads),
        "head_dim": int(_ours(cfg, "head_size") or hidden // heads),
        "max_position_embeddings": int(_ours(cfg, "max_seq_length")),
        "hidden_act": "silu",
        "rms_norm_eps": float(_ours(cfg, "layernorm_epsilon")),
        "initializer_range": float(_ours(cfg, "initializer_range")),
        "attention_dropout": float(_ours(cfg, "attention_dropout_prob")),
        "tie_word_embeddings": bool(_ours(cfg, "tie_word_embeddings")),
        # Both spellings: transformers 5 reads rope_parameters, 4.x rope_theta and rope_scaling.
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": dict(scaling) if scaling else None,
        "use_cache": True,
    }
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if model_type == "mistral":
        out.update(sliding_window=int(window))
    if model_type in _QK_NORM:
        out.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    if model_type == "qwen3_moe":
        out.update(num_experts=int(moe["num_experts"]), num_experts_per_tok=int(moe["top_k"]),
                   moe_intermediate_size=int(moe.get("ffn_hidden_size") or _ours(cfg, "ffn_hidden_size")),
                   decoder_sparse_step=int(moe.get("every_n_layers", 1)), mlp_only_layers=[], norm_topk_prob=True,
                   router_aux_loss_coef=float(moe.get("aux_loss_weight", 0.0)), output_router_logits=False)
    if model_type == "mixtral":
        out.update(num_local_experts=int(moe["num_experts"]), num_experts_per_tok=int(moe["top_k"]),
                   router_aux_loss_coef=float(moe.get("aux_loss_weight", 0.0)),
                   router_jitter_noise=float(moe.get("jitter_noise", 0.0)),
                   sliding_window=None if window is None else int(window))
    return out


def special_token_ids(tokenizer) -> dict:
    """``config.json`` ids for one of our tokenizers: its bos/eos when it names them, else the end-of-document id."""
    eod = getattr(tokenizer, "eod_id", None)
    bos, eos = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)
    return {"bos_token_id": eod if bos is None else bos, "eos_token_id": eod if eos is None else eos}


def find_tokenizer(hf_dir: str) -> HFTokenizer | None:
    """Our tokenizer for a directory: ``tokenizer.json`` (Llama 3, Mistral, Qwen2 ship it) as a
    ``HuggingFaceTokenizer``, else GPT-2's ``vocab.json`` + ``merges.txt`` (the demo's), else None."""
    return find_hf_tokenizer(hf_dir, formats=("tokenizer.json", "gpt2"))


def _sizes(cfg: Mapping[str, Any]) -> tuple[int, int, int, int]:
    heads = int(_ours(cfg, "num_attention_heads"))
    kv = int(_ours(cfg, "num_key_value_heads") or heads)
    head_size = int(_ours(cfg, "head_size") or int(_ours(cfg, "hidden_size")) // heads)
    return int(_ours(cfg, "hidden_layers")), heads, kv, head_size


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: int) -> torch.Tensor:
    """Rows of q (heads x hd), k and v (kv x hd each) -> ``[kv, group + 2, hd]`` (per key/value head)."""
    rest = q.shape[1:]
    per_kv = lambda t: t.reshape(kv, -1, k.shape[0] // kv, *rest)  # noqa: E731  [kv, n, hd, ...]
    return torch.cat([per_kv(q), per_kv(k), per_kv(v)], dim=1).reshape(-1, *rest)


def _split_qkv(t: torch.Tensor, heads: int, kv: int, head_size: int) -> tuple[torch.Tensor, ...]:
    rest = t.shape[1:]
    g = heads // kv
    blocks = t.reshape(kv, g + 2, head_size, *rest)
    return (blocks[:, :g].reshape(-1, *rest), blocks[:, g].reshape(-1, *rest), blocks[:, g + 1].reshape(-1, *rest))


_LAYER_KEYS = (("input_layernorm.weight", "input_layernorm.weight"),
               ("post_attention_layernorm.weight", "post_attention_layernorm.weight"),
               ("self_attention.dense.weight", "self_attn.o_proj.weight"))
# (HF dense MLP, Hub Mixtral expert) names of the gate, up and down projections; the gate is the activated one.
_GATE, _UP, _DOWN = ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")


def _experts(cfg: Mapping[str, Any], layer: int) -> int:
    """Experts in layer ``layer``'s feed-forward: 0 for a dense one."""
    moe = dict(cfg.get("moe") or {})
    if not moe.get("enabled") or (layer + 1) % int(moe.get("every_n_layers", 1)):
        return 0
    return int(moe["num_experts"])


def _ours_mlp(q: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> dict:
    return {f"{q}dense_h_to_4h.weight": join_gate_up(gate, up), f"{q}dense_4h_to_h.weight": down}


def _mlp_from_hf(src: StateDictSource, p: str, q: str, experts: int) -> dict:
    """One layer's feed-forward weights: a SwiGLU MLP, or Mixtral's or Qwen3-MoE's router and experts in either
    layout."""
    if not experts:
        return _ours_mlp(f"{q}mlp.", *(src(f"{p}mlp.{names[0]}.weight") for names in (_GATE, _UP, _DOWN)))
    out = {}
    if f"{p}mlp.experts.0.gate_proj.weight" in src.sd:  # Qwen3-MoE's Hub layout
        out[f"{q}mlp.router.weight"] = src(f"{p}mlp.gate.weight")
        for e in range(experts):
            weights = (src(f"{p}mlp.experts.{e}.{names[0]}.weight") for names in (_GATE, _UP, _DOWN))
            out.update(_ours_mlp(f"{q}mlp.experts.{e}.", *weights))
        return out
    if f"{p}mlp.experts.gate_up_proj" in src.sd:  # transformers 5's fused layout
        out[f"{q}mlp.router.weight"] = src(f"{p}mlp.gate.weight")
        gate, up = src(f"{p}mlp.experts.gate_up_proj").chunk(2, dim=1)
        down = src(f"{p}mlp.experts.down_proj")
        for e in range(experts):
            out.update(_ours_mlp(f"{q}mlp.experts.{e}.", gate[e], up[e], down[e]))
        return out
    out[f"{q}mlp.router.weight"] = src(f"{p}block_sparse_moe.gate.weight")
    for e in range(experts):
        hub = f"{p}block_sparse_moe.experts.{e}."
        weights = (src(f"{hub}{names[1]}.weight") for names in (_GATE, _UP, _DOWN))
        out.update(_ours_mlp(f"{q}mlp.experts.{e}.", *weights))
    return out


def _theirs_mlp(src: StateDictSource, q: str, p: str, which: int) -> dict:
    gate, up = split_gate_up(src(f"{q}dense_h_to_4h.weight"))
    down = src(f"{q}dense_4h_to_h.weight")
    return {f"{p}{names[which]}.weight": t for names, t in zip((_GATE, _UP, _DOWN), (gate, up, down))}


def _mlp_to_hf(src: StateDictSource, p: str, q: str, experts: int, qwen: bool) -> dict:
    """One layer's feed-forward in the Hub's layout: Qwen3-MoE's ``mlp.experts.{e}.gate_proj`` or Mixtral's
    ``block_sparse_moe.experts.{e}.w1``."""
    if not experts:
        return _theirs_mlp(src, f"{q}mlp.", f"{p}mlp.", 0)
    block, which = (f"{p}mlp.", 0) if qwen else (f"{p}block_sparse_moe.", 1)
    out = {f"{block}gate.weight": src(f"{q}mlp.router.weight")}
    for e in range(experts):
        out.update(_theirs_mlp(src, f"{q}mlp.experts.{e}.", f"{block}experts.{e}.", which))
    return out


def state_dict_from_hf(sd: Mapping[str, torch.Tensor], model_cfg: Mapping[str, Any]) -> dict:
    """LlamaModel's state dict from ``*ForCausalLM`` weights (a tied head taken from the embedding)."""
    layers, heads, kv, head_size = _sizes(model_cfg)
    src = StateDictSource(sd, "the Llama-family weights")
    embed = src("model.embed_tokens.weight")
    tied = bool(_ours(model_cfg, "tie_word_embeddings"))
    out = {EMBEDDING_KEY: embed, "final_layernorm.weight": src("model.norm.weight"),
           "lm_head.weight": embed if tied else src("lm_head.weight")}
    if tied and "lm_head.weight" in sd and not torch.equal(src("lm_head.weight"), embed):
        raise UsageError("config.json ties the word embeddings but lm_head.weight differs from embed_tokens.weight")
    for i in range(layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        for ours, theirs in _LAYER_KEYS:
            out[q + ours] = src(p + theirs)
        out.update(_mlp_from_hf(src, p, q, _experts(model_cfg, i)))
        attn = p + "self_attn."
        if _ours(model_cfg, "qk_norm"):
            for n in "qk":
                out[f"{q}self_attention.{n}_norm.weight"] = src(f"{attn}{n}_norm.weight")
        for kind in ("weight", "bias") if _ours(model_cfg, "qkv_bias") else ("weight",):
            out[f"{q}self_attention.query_key_value.{kind}"] = _fuse_qkv(
                *(src(f"{attn}{n}_proj.{kind}") for n in "qkv"), kv)
    src.check_all_used(ignore=lambda k: k.endswith("rotary_emb.inv_freq"))
    return {k: v.contiguous() for k, v in out.items()}


def state_dict_to_hf(sd: Mapping[str, torch.Tensor], model_cfg: Mapping[str, Any]) -> dict:
    """``*ForCausalLM`` weights from LlamaModel's state dict (a tied head written once, as the embedding)."""
    layers, heads, kv, head_size = _sizes(model_cfg)
    src = StateDictSource(sd, "the Llama model state dict")
    out = {"model.embed_tokens.weight": src(EMBEDDING_KEY), "model.norm.weight": src("final_layernorm.weight")}
    head = src("lm_head.weight")
    if not _ours(model_cfg, "tie_word_embeddings"):
        out["lm_head.weight"] = head
    for i in range(layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        for ours, theirs in _LAYER_KEYS:
            out[p + theirs] = src(q + ours)
        out.update(_mlp_to_hf(src, p, q, _experts(model_cfg, i), qwen=bool(_ours(model_cfg, "qk_norm"))))
        for kind in ("weight", "bias") if _ours(model_cfg, "qkv_bias") else ("weight",):
            parts = _split_qkv(src(f"{q}self_attention.query_key_value.{kind}"), heads, kv, head_size)
            for n, t in zip("qkv", parts):
                out[f"{p}self_attn.{n}_proj.{kind}"] = t
        if _ours(model_cfg, "qk_norm"):
            for n in "qk":
                out[f"{p}self_attn.{n}_norm.weight"] = src(f"{q}self_attention.{n}_norm.weight")
    src.check_all_used()
    return {k: v.contiguous() for k, v in out.items()}


register_hf_model(
    __name__, model_class=LlamaForPreTraining, model_types=MODEL_TYPES, inner="llama", vocab_keys=VOCAB_KEYS,
    # Named from this module, so a copy of the project starts from the copy's own config.
    finetune_config=__name__.rsplit(".", 2)[0] + ".configs.llama_demo",
)
