"""Parallel-aware building blocks: they declare the SBP of their weights and activations (``sbp``;
``parallel=`` is the shorthand) and their ``layer_idx``, which ``libai_lite.parallel`` acts on."""
from .attention import MultiheadAttention
from .embedding import Embedding, VocabEmbedding
from .init_methods import init_method_normal, scaled_init_method_normal
from .layer_norm import LayerNorm, RMSLayerNorm
from .linear import Linear1D
from .loss import ParallelCrossEntropyLoss, fusable_head_weight, linear_cross_entropy
from .mlp import MLP
from .rotary import RotaryEmbedding, apply_rotary, rope_inv_freq
from .moe import MoEConfig, MoELayer, collect_moe_outputs
from .transformer_layer import TransformerLayer

__all__ = ["Embedding", "LayerNorm", "Linear1D", "MLP", "MoEConfig", "MoELayer", "MultiheadAttention",
           "ParallelCrossEntropyLoss", "RMSLayerNorm", "RotaryEmbedding", "TransformerLayer", "VocabEmbedding",
           "apply_rotary", "collect_moe_outputs", "fusable_head_weight", "init_method_normal", "linear_cross_entropy",
           "rope_inv_freq", "scaled_init_method_normal"]
