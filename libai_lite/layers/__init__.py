"""Parallel-aware building blocks. Layers declare intent (``parallel=``, ``layer_idx``); ``libai_lite.parallel`` acts on it."""
from .attention import MultiheadAttention
from .embedding import Embedding, VocabEmbedding
from .init_methods import init_method_normal, scaled_init_method_normal
from .layer_norm import LayerNorm, RMSLayerNorm
from .linear import Linear1D
from .loss import ParallelCrossEntropyLoss
from .mlp import MLP
from .transformer_layer import TransformerLayer

__all__ = [
    "Embedding",
    "LayerNorm",
    "Linear1D",
    "MLP",
    "MultiheadAttention",
    "ParallelCrossEntropyLoss",
    "RMSLayerNorm",
    "TransformerLayer",
    "VocabEmbedding",
    "init_method_normal",
    "scaled_init_method_normal",
]
