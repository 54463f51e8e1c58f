"""Hugging Face T5 / T5 v1.1 / mT5 (``(M)T5ForConditionalGeneration``) <-> ``MT5Model`` (``mt5_model`` of
``MT5ForPreTraining``), one entry per tensor; registered for ``MT5ForPreTraining`` when imported.

Layouts that differ: self-attention ``q``, ``k``, ``v`` interleave into our head-major ``query_key_value``
rows ``[heads, 3, d_kv]`` (cross-attention ``k``, ``v`` into ``key_value``); decoder block ``i`` is our
``decoder_layers.{L + i}``; ``wi``/``wo`` are ``dense_h_to_4h``/``dense_4h_to_h``, gated-GELU's ``wi_0`` and
``wi_1`` joined into our gated ``dense_h_to_4h`` (``join_gate_up``). Our ``tie_word_embeddings`` ties the head
AND scales the decoder output by ``d_model ** -0.5`` (T5 v1.0); Hugging Face reads the scaling from the config
(``scale_decoder_outputs``, else ``tie_word_embeddings`` for ``model_type="t5"``, never for ``"mt5"``) and a
head of its own from the weights, so an unscaled model whose head is the embedding imports untied, a copy.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch

from libai_lite.checkpoint.hf import HFTokenizer, StateDictSource, register_hf_model
from libai_lite.layers.mlp import LEGACY_UP, join_gate_up, split_gate_up
from libai_lite.utils.errors import UsageError

from .mt5_model import MT5Config, MT5ForPreTraining

HF_MODEL_TYPES = ("t5", "mt5")
EMBEDDING_KEY = "embedding.weight"
VOCAB_KEYS = (EMBEDDING_KEY, "lm_head.weight")

# HF feed_forward_proj -> our model_type (the feed-forward architecture), and back.
_ARCH_FROM_HF = {"relu": "t5", "gated-gelu": "mt5"}
_FFN_TO_HF = {"t5": "relu", "mt5": "gated-gelu"}
# Present in some HF checkpoints and ignored by HF itself (cross-attention has no position bias).
_IGNORED = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)
# Copies of shared.weight that HF ties on load.
_EMBED_COPIES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def _hf(cfg: Mapping[str, Any], key: str, default: Any = ...) -> Any:
    if cfg.get(key) is not None:
        return cfg[key]
    if default is ...:
        raise UsageError(f"config.json has no '{key}': it is not a complete T5 config; re-save it with transformers")
    return default


def decoder_output_scaled(hf_config: Mapping[str, Any]) -> bool:
    """Whether Hugging Face scales this model's decoder output by ``d_model ** -0.5`` before the head."""
    if hf_config.get("scale_decoder_outputs") is not None:
        return bool(hf_config["scale_decoder_outputs"])
    if hf_config.get("model_type") == "mt5":
        return False
    return hf_config.get("tie_word_embeddings", True) is not False


def config_from_hf(hf_config: Mapping[str, Any]) -> dict:
    """Our ``model.cfg`` (MT5Config keys) for a Hugging Face T5/mT5 ``config.json`` dict."""
    c = hf_config
    default_ffn = "gated-gelu" if c.get("model_type") == "mt5" else "relu"
    ffn = c.get("feed_forward_proj") or default_ffn
    if ffn not in _ARCH_FROM_HF:
        raise UsageError(f"config.json feed_forward_proj={ffn!r} is not supported; MT5Model runs 'relu' "
                         f"(T5 v1.0) and 'gated-gelu' (T5 v1.1, mT5)")
    layers = int(_hf(c, "num_layers"))
    if int(_hf(c, "num_decoder_layers", layers)) != layers:
        raise UsageError(f"config.json has num_layers={layers} but num_decoder_layers={c['num_decoder_layers']}; "
                         f"MT5Model needs as many decoder as encoder layers")
    dropout = float(_hf(c, "dropout_rate", 0.1))
    return dict(
        vocab_size=int(_hf(c, "vocab_size")),
        hidden_size=int(_hf(c, "d_model")),
        hidden_layers=layers,
        num_attention_heads=int(_hf(c, "num_heads")),
        intermediate_size=int(_hf(c, "d_ff")),
        head_size=int(_hf(c, "d_kv")),
        embedding_dropout_prob=dropout,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        relative_attention_num_buckets=int(_hf(c, "relative_attention_num_buckets", 32)),
        relative_attention_max_distance=int(_hf(c, "relative_attention_max_distance", 128)),
        initializer_range=float(_hf(c, "initializer_factor", 1.0)),
        layernorm_eps=float(_hf(c, "layer_norm_epsilon", 1e-6)),
        model_type=_ARCH_FROM_HF[ffn],
        tie_word_embeddings=decoder_output_scaled(c),
    )


def config_to_hf(model_cfg: Mapping[str, Any]) -> dict:
    """A Hugging Face config dict for our ``model.cfg``.

    A tied (and so scaled) model is ``T5ForConditionalGeneration`` with ``tie_word_embeddings:
    true`` whatever its feed-forward; an untied mT5-architecture model is
    ``MT5ForConditionalGeneration`` and an untied ReLU one ``T5ForConditionalGeneration``, both
    with ``tie_word_embeddings: false`` (which every transformers version reads as "no scaling").
    """
    cfg = MT5Config.from_mapping(model_cfg)
    if (getattr(cfg, "moe", None) or {}).get("enabled"):
        raise UsageError("model.cfg.moe is enabled: mixture-of-experts layers have no T5 equivalent, "
                         "so this model cannot be exported to Hugging Face")
    tied = bool(cfg.tie_word_embeddings)
    hf_type = "mt5" if cfg.model_type == "mt5" and not tied else "t5"
    return {
        "architectures": ["MT5ForConditionalGeneration" if hf_type == "mt5" else "T5ForConditionalGeneration"],
        "model_type": hf_type,
        "vocab_size": int(cfg.vocab_size),
        "d_model": int(cfg.hidden_size),
        "d_kv": int(cfg.head_size),
        "d_ff": int(cfg.intermediate_size),
        "num_layers": int(cfg.hidden_layers),
        "num_decoder_layers": int(cfg.hidden_layers),
        "num_heads": int(cfg.num_attention_heads),
        "relative_attention_num_buckets": int(cfg.relative_attention_num_buckets),
        "relative_attention_max_distance": int(cfg.relative_attention_max_distance),
        "dropout_rate": float(cfg.hidden_dropout_prob),
        "layer_norm_epsilon": float(cfg.layernorm_eps),
        "initializer_factor": float(cfg.initializer_range),
        "feed_forward_proj": _FFN_TO_HF[cfg.model_type],
        "is_encoder_decoder": True,
        "tie_word_embeddings": tied,
        "use_cache": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
    }


def special_token_ids(tokenizer) -> dict:
    """``config.json`` token ids for one of our tokenizers, with the decoder start the T5 dataset trains with."""
    from ..data.t5_dataset import t5_special_ids

    ids = t5_special_ids(tokenizer)
    return {"pad_token_id": ids["pad"], "eos_token_id": ids["eos"], "decoder_start_token_id": ids["decoder_start"]}


def find_tokenizer(hf_dir: str) -> HFTokenizer | None:
    """Our T5-style SentencePieceTokenizer for a directory's ``spiece.model``, or None when it has none."""
    from libai_lite.tokenizer import SentencePieceTokenizer

    model_file, tok_cfg = os.path.join(hf_dir, "spiece.model"), os.path.join(hf_dir, "tokenizer_config.json")
    if not os.path.isfile(model_file):
        return None
    extra_ids = 100  # transformers' T5Tokenizer default
    if os.path.isfile(tok_cfg):
        try:
            with open(tok_cfg, encoding="utf-8") as f:
                extra_ids = int(json.load(f).get("extra_ids", extra_ids))
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise UsageError(f"{tok_cfg} cannot be read ({type(e).__name__}); re-download it") from e
    try:
        tok = SentencePieceTokenizer(model_file, extra_ids=extra_ids, style="t5")
    except ValueError as e:
        raise UsageError(f"the SentencePiece model in {hf_dir} cannot be loaded: {e}") from e
    return HFTokenizer(tok, {"spiece.model": model_file},
                       f'LazyCall(SentencePieceTokenizer)(model_file=os.path.join(_here, "spiece.model"), '
                       f'extra_ids={extra_ids}, style="t5")',
                       "from libai_lite.tokenizer import SentencePieceTokenizer")


def sentencepiece_config(tokenizer) -> dict | None:
    """``tokenizer_config.json`` for transformers' ``T5Tokenizer`` when our SentencePiece tokenizer follows its
    conventions (``style="t5"``: only the sentinels added, numbered from the end), else None."""
    if getattr(tokenizer, "style", None) != "t5":
        return None
    return {"tokenizer_class": "T5Tokenizer",
            "extra_ids": len(getattr(tokenizer, "additional_special_tokens_ids", []) or [])}


def _fuse(heads: int, head_size: int, *weights: torch.Tensor) -> torch.Tensor:
    """Separate ``[heads * d_kv, d]`` projections -> head-major fused rows ``[heads, n, d_kv]``."""
    return torch.stack([w.reshape(heads, head_size, w.shape[-1]) for w in weights], dim=1).reshape(
        -1, weights[0].shape[-1])


def _unfuse(fused: torch.Tensor, heads: int, head_size: int, n: int) -> list[torch.Tensor]:
    grouped = fused.reshape(heads, n, head_size, fused.shape[-1])
    return [grouped[:, j].reshape(heads * head_size, fused.shape[-1]) for j in range(n)]


def _mlp_names(cfg: MT5Config) -> list[tuple[str, str]]:
    if cfg.model_type == "mt5":  # gated-GELU: wi_0 goes through the activation, wi_1 is the linear gate
        return [("dense_h_to_4h", "wi_0"), ("dense_h_to_4h_linear", "wi_1"), ("dense_4h_to_h", "wo")]
    return [("dense_h_to_4h", "wi"), ("dense_4h_to_h", "wo")]


class _GateUp(tuple):
    """Hugging Face's ``(gate key, up key)`` of our gated ``dense_h_to_4h`` (rows interleaved)."""


def _mlp_pairs(cfg: MT5Config, ours: str, ffn: str):
    """``(our key, Hugging Face key)`` of one feed-forward block; ``_mlp_names``' ``dense_h_to_4h_linear``
    (the up projection's old name) is joined into the gated ``dense_h_to_4h``, a ``_GateUp`` pair."""
    names = dict(_mlp_names(cfg))
    gated = "dense_h_to_4h" in names and LEGACY_UP in names
    for our_name, hf_name in _mlp_names(cfg):
        if gated and our_name == LEGACY_UP:
            continue
        theirs = f"{ffn}{hf_name}.weight"
        if gated and our_name == "dense_h_to_4h":
            theirs = _GateUp((theirs, f"{ffn}{names[LEGACY_UP]}.weight"))
        yield f"{ours}mlp.{our_name}.weight", theirs


def _key_pairs(cfg: MT5Config):
    """``(our key, Hugging Face key)`` of every tensor but the embedding and the head; a tuple of keys is fused
    (a ``_GateUp`` pair into a gated MLP's interleaved rows, any other into head-major attention rows)."""
    yield "encoder_final_layernorm.weight", "encoder.final_layer_norm.weight"
    yield "decoder_final_layernorm.weight", "decoder.final_layer_norm.weight"
    n = cfg.hidden_layers
    for stack, offset in (("encoder", 0), ("decoder", n)):
        for i in range(n):
            hf, ours = f"{stack}.block.{i}.layer.", f"{stack}_layers.{offset + i}."
            attn = hf + "0.SelfAttention."
            yield ours + "input_layernorm.weight", hf + "0.layer_norm.weight"
            qkv = (attn + "q.weight", attn + "k.weight", attn + "v.weight")
            yield ours + "self_attention.query_key_value.weight", qkv
            yield ours + "self_attention.dense.weight", attn + "o.weight"
            if i == 0:
                yield ours + "relative_attention_bias.weight", attn + "relative_attention_bias.weight"
            yield ours + "post_attention_layernorm.weight", hf + "1.layer_norm.weight"
            ffn = hf + "1.DenseReluDense."
            if stack == "decoder":
                cross = hf + "1.EncDecAttention."
                yield ours + "cross_attention.query.weight", cross + "q.weight"
                yield ours + "cross_attention.key_value.weight", (cross + "k.weight", cross + "v.weight")
                yield ours + "cross_attention.dense.weight", cross + "o.weight"
                yield ours + "post_cross_attention_layernorm.weight", hf + "2.layer_norm.weight"
                ffn = hf + "2.DenseReluDense."
            yield from _mlp_pairs(cfg, ours, ffn)


def state_dict_from_hf(sd: Mapping[str, torch.Tensor], model_cfg: Mapping[str, Any]) -> dict:
    """MT5Model's state dict (``lm_head.weight`` included, tied or not) from Hugging Face (m)T5 weights."""
    cfg = MT5Config.from_mapping(model_cfg)
    src = StateDictSource(sd, "the T5 weights")
    shared = src("shared.weight")
    out = {EMBEDDING_KEY: shared}
    for ours, theirs in _key_pairs(cfg):
        if isinstance(theirs, _GateUp):
            out[ours] = join_gate_up(*map(src, theirs))
        elif isinstance(theirs, tuple):
            out[ours] = _fuse(cfg.num_attention_heads, cfg.head_size, *map(src, theirs))
        else:
            out[ours] = src(theirs)
    for key in _EMBED_COPIES:
        if key in sd:
            src(key)
            if not torch.equal(sd[key], shared):
                raise UsageError(f"the T5 weights hold a {key} different from shared.weight; "
                                 f"MT5Model has one token embedding for both stacks")
    head = src("lm_head.weight") if "lm_head.weight" in sd else shared
    if cfg.tie_word_embeddings and not torch.equal(head, shared):
        raise UsageError("the T5 config scales the decoder output (tie_word_embeddings) but lm_head.weight differs "
                         "from shared.weight; MT5Model only scales a tied head: set tie_word_embeddings false "
                         "in config.json if the model was trained without scaling")
    out["lm_head.weight"] = shared if cfg.tie_word_embeddings else head
    src.check_all_used(ignore=lambda k: k in _IGNORED)
    return {k: v.contiguous() for k, v in out.items()}


def state_dict_to_hf(sd: Mapping[str, torch.Tensor], model_cfg: Mapping[str, Any]) -> dict:
    """Hugging Face (m)T5 weights from MT5Model's state dict; a tied head is written once, as ``shared.weight``."""
    cfg = MT5Config.from_mapping(model_cfg)
    src = StateDictSource(sd, "the MT5 model state dict")
    out = {"shared.weight": src(EMBEDDING_KEY)}
    for ours, theirs in _key_pairs(cfg):
        if isinstance(theirs, _GateUp):
            out.update(zip(theirs, split_gate_up(src(ours))))
        elif isinstance(theirs, tuple):
            out.update(zip(theirs, _unfuse(src(ours), cfg.num_attention_heads, cfg.head_size, len(theirs))))
        else:
            out[theirs] = src(ours)
    head = src("lm_head.weight")
    if cfg.tie_word_embeddings:
        if not torch.equal(head, out["shared.weight"]):
            raise UsageError("model.cfg.tie_word_embeddings is true but lm_head.weight differs from the embedding; "
                             "the checkpoint was trained untied: set model.cfg.tie_word_embeddings=False")
    else:
        out["lm_head.weight"] = head
    src.check_all_used()
    return {k: v.contiguous() for k, v in out.items()}


register_hf_model(
    __name__, model_class=MT5ForPreTraining, model_types=HF_MODEL_TYPES, inner="mt5_model", vocab_keys=VOCAB_KEYS,
    # Named from this module, so a copy of the project starts from the copy's own config.
    finetune_config=__name__.rsplit(".", 2)[0] + ".configs.mt5_pretrain",
    # The pipeline cuts the encoder and the decoder stacks as one list of layers.
    pipeline_num_layers=lambda cfg: 2 * int(cfg["hidden_layers"]),
)
