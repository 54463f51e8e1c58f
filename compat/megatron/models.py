"""The model families the projects offer to Megatron command lines, and the choice among them.

The flags that shape the model (``--swiglu``, ``--normalization``, ``--position-embedding-type``,
``--disable-bias-linear``, ...) give Megatron's model arguments (``ARCHITECTURE``); the family of
``MEGATRON_MODELS`` that builds those (``STRUCTURE``'s arguments choose it) takes the rest as its
``model.cfg`` keys. A project that builds another Megatron architecture adds its entry.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .flags import _int, _Reader, _require

__all__ = ["ARCHITECTURE", "MEGATRON_MODELS", "MegatronModel", "STRUCTURE", "choose_model"]


@dataclass(frozen=True)
class MegatronModel:
    """A model family a project offers to Megatron command lines.

    ``config``: the module of the base config the assignments apply to. ``builds``: Megatron's model
    arguments (``ARCHITECTURE``'s names) the family always has, as a value or a tuple of the values it can
    take. ``keys``: the arguments it takes from the flags, as a ``model.cfg`` key or a tuple of keys. An
    argument in neither must keep Megatron's default. ``STRUCTURE``'s arguments choose the family.
    """

    name: str
    config: str
    builds: Mapping[str, Any] = field(default_factory=dict)
    keys: Mapping[str, Any] = field(default_factory=dict)


# Megatron's model arguments -> the flag that sets each (for messages).
ARCHITECTURE = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "ffn_hidden_size": "--ffn-hidden-size",
    "num_attention_heads": "--num-attention-heads", "max_position_embeddings": "--max-position-embeddings",
    "hidden_dropout": "--hidden-dropout", "embedding_dropout": "--hidden-dropout",
    "attention_dropout": "--attention-dropout", "init_method_std": "--init-method-std",
    "layernorm_epsilon": "--norm-epsilon", "normalization": "--normalization",
    "position_embedding_type": "--position-embedding-type", "mlp": "--swiglu",
    "add_bias_linear": "--disable-bias-linear",
    "qkv_bias": "--add-qkv-bias", "share_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "num_query_groups": "--num-query-groups", "kv_channels": "--kv-channels", "rotary_base": "--rotary-base",
    "rotary_percent": "--rotary-percent", "rope_scaling": "--use-rope-scaling",
}
# The arguments that choose the model family.
STRUCTURE = ("normalization", "position_embedding_type", "mlp", "add_bias_linear")
# Megatron-LM's --use-rope-scaling constants as the rotary layers' "llama3" scaling kind (libai_lite/layers/rotary.py).
_ROPE_SCALING = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)


def _architecture(raw: Dict[str, Any], read: _Reader) -> tuple:
    """(Megatron's model arguments, their defaults): what pretrain_gpt.py builds from the flags."""
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads"):
        _require(read, flag)
    if "max_position_embeddings" not in raw:
        _require(read, "--max-position-embeddings", "--seq-length")
    hidden, heads = raw.get("hidden_size", 0), raw.get("num_attention_heads", 0)
    mlp = raw.get("mlp", "gelu")
    if mlp == "swiglu":
        ffn = int((4 * hidden * 2 / 3) / 64) * 64  # Megatron's size for two projections in
    else:
        ffn = 4 * hidden
    defaults = {
        "ffn_hidden_size": ffn, "hidden_dropout": 0.1, "attention_dropout": 0.1, "init_method_std": 0.02,
        "layernorm_epsilon": 1e-5, "normalization": "LayerNorm", "position_embedding_type": "learned_absolute",
        "mlp": "gelu", "add_bias_linear": True, "share_embeddings_and_output_weights": True,
        "num_query_groups": heads, "kv_channels": hidden // heads if heads else 0, "rotary_base": 10000.0,
        "rotary_percent": 1.0, "rope_scaling": None,
    }
    arch = {k: raw[k] for k in ARCHITECTURE if k in raw}
    for key, value in defaults.items():
        arch.setdefault(key, value)
    arch["embedding_dropout"] = arch["hidden_dropout"]  # Megatron drops out after the embeddings with it too
    defaults["embedding_dropout"] = defaults["hidden_dropout"]
    arch["qkv_bias"] = bool(arch["add_bias_linear"] or raw.get("add_qkv_bias", False))
    defaults["qkv_bias"] = defaults["add_bias_linear"]
    # Megatron takes --num-query-groups only with --group-query-attention.
    if raw.get("group_query_attention"):
        arch["num_query_groups"] = raw.get("num_query_groups", 1)
    else:
        arch["num_query_groups"] = heads
    if raw.get("use_rope_scaling"):
        arch["rope_scaling"] = dict(_ROPE_SCALING, factor=raw.get("rope_scaling_factor", 8.0))
    return arch, defaults


def _accepts(build: Any, value: Any) -> bool:
    return value in build if isinstance(build, tuple) else value == build


def _mismatches(model: MegatronModel, arch: Dict[str, Any]) -> List[str]:
    return [s for s in STRUCTURE if s not in model.builds or not _accepts(model.builds[s], arch[s])]


def _describe(values: Mapping[str, Any]) -> str:
    def one(s):
        v = values.get(s)
        if s == "add_bias_linear":
            return "linear biases" if v else "no linear biases"
        v = "/".join(map(str, v)) if isinstance(v, tuple) else v
        return {"position_embedding_type": f"{v} positions", "mlp": f"{v} MLP"}.get(s, str(v))
    return ", ".join(one(s) for s in STRUCTURE)


def _flag_for(s: str, build: Any) -> str:
    """The flags that ask for ``build`` of structure argument ``s``."""
    value = build[0] if isinstance(build, tuple) else build
    if s == "mlp":
        return "--swiglu" if value == "swiglu" else "no --swiglu/--squared-relu"
    if s == "add_bias_linear":
        return "no --disable-bias-linear" if value else "--disable-bias-linear"
    return f"{ARCHITECTURE[s]} {value}"


def choose_model(read: _Reader, raw: Dict[str, Any], models: Sequence[MegatronModel], assignments: Dict[str, Any],
                 no_effect: List[str]) -> Optional[MegatronModel]:
    """The family of ``models`` that builds the model the flags describe (Megatron's model arguments ``raw``),
    its keys set in ``assignments``; None, with the problem read, when no family builds it."""
    seq = read.one("--seq-length", _int)
    if seq is not None:
        raw.setdefault("max_position_embeddings", seq)
        if seq > raw["max_position_embeddings"]:
            read.problems.add("--seq-length", f"{seq} exceeds --max-position-embeddings "
                                              f"{raw['max_position_embeddings']}")
        elif seq != raw["max_position_embeddings"]:
            assignments["dataloader.train.seq_length"] = seq
    arch, defaults = _architecture(raw, read)
    if "num_query_groups" in raw and not raw.get("group_query_attention"):
        no_effect.append("--num-query-groups (no effect without --group-query-attention, as in Megatron-LM)")
    if raw.get("layernorm_zero_centered_gamma"):
        no_effect.append("--apply-layernorm-1p (norm weights are stored as g here, not g - 1: the same model "
                             "and the same updates, as norm weights take no weight decay)")
    fits = [m for m in models if not _mismatches(m, arch)]
    if not fits:
        offers = "; ".join(f"{m.name} builds {_describe(m.builds)} ("
                           f"{', '.join(_flag_for(s, m.builds.get(s)) for s in _mismatches(m, arch))})"
                           for m in sorted(models, key=lambda m: len(_mismatches(m, arch))))
        read.problems.add("the model", f"{_describe(arch)} is built by no project here: {offers or 'none offered'}")
        return None
    model = fits[0]
    for arg, value in arch.items():
        if arg in model.keys:
            keys = model.keys[arg]
            for key in (keys if isinstance(keys, tuple) else (keys,)):
                assignments[f"model.cfg.{key}"] = value
        if arg in model.builds and not _accepts(model.builds[arg], value):
            read.problems.add(ARCHITECTURE[arg], f"{value!r} for Megatron's {arg}: {model.name} builds "
                              f"{model.builds[arg]!r}")
        elif arg not in model.keys and arg not in model.builds and value != defaults.get(arg, value):
            read.problems.add(ARCHITECTURE[arg], f"{value!r}: {model.name} has no setting for it (it builds "
                              f"Megatron's default, {defaults[arg]!r})")
    return model


# Megatron's shape arguments -> the model.cfg keys both projects give them.
_SHAPE = {
    "num_layers": "hidden_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "max_position_embeddings": "max_seq_length",
    "attention_dropout": "attention_dropout_prob",
    "init_method_std": "initializer_range",
    "layernorm_epsilon": "layernorm_epsilon",
}

MEGATRON_MODELS = [
    # Megatron-LM's default GPT: pre-LayerNorm, learned positions, GeLU, biases, the head tied to the embedding.
    MegatronModel(
        name="projects/GPT",
        config="projects.GPT.configs.gpt2_pretrain",
        builds=dict(normalization="LayerNorm", position_embedding_type="learned_absolute",
                    mlp=("gelu", "gelu_tanh"), add_bias_linear=True, qkv_bias=True,
                    share_embeddings_and_output_weights=True),
        keys=dict(_SHAPE, hidden_dropout="output_dropout_prob", embedding_dropout="embedding_dropout_prob",
                  mlp="activation"),
    ),
    # --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear: Llama (with
    # grouped-query attention, --add-qkv-bias for Qwen2, a tied or untied head). Llama drops out nothing
    # after the embeddings, where Megatron applies --hidden-dropout too: it must be 0 here.
    MegatronModel(
        name="projects/Llama",
        config="projects.Llama.configs.llama_demo",
        builds=dict(normalization="RMSNorm", position_embedding_type="rope", mlp="swiglu", add_bias_linear=False,
                    embedding_dropout=0.0, rotary_percent=1.0),
        keys=dict(_SHAPE, hidden_dropout="output_dropout_prob", num_query_groups="num_key_value_heads",
                  kv_channels="head_size", rotary_base="rope_theta", rope_scaling="rope_scaling",
                  qkv_bias="qkv_bias", share_embeddings_and_output_weights="tie_word_embeddings"),
    ),
]
