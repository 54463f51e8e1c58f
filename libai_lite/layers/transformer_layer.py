"""Pre-norm transformer layer: GPT-2 style by default, Llama style with ``norm="rmsnorm"``, a gated MLP,
grouped-query attention and rotary positions."""
import functools
from typing import Optional

import torch
from torch import nn

from .attention import KVCache, MultiheadAttention
from .init_methods import InitMethod
from .layer_norm import LayerNorm, RMSLayerNorm
from .mlp import MLP
from .moe import MoEConfig, MoELayer


class TransformerLayer(nn.Module):
    """``x + attn(ln(x))`` then ``x + mlp(ln(x))``, with dropouts inside attention and MLP. With
    ``apply_residual_post_layernorm`` each residual is the normalised input; with ``moe`` the feed-forward
    is a ``MoELayer``. A Llama layer sets ``norm="rmsnorm"``, ``gated=True`` with ``activation="silu"``
    and the attention options of ``MultiheadAttention``; ``qk_norm`` normalises its query and key heads with
    ``layernorm_epsilon``; ``head_size`` (default ``hidden_size // num_attention_heads``) is its heads' width.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                 attention_dropout_prob: float = 0.0, output_dropout_prob: float = 0.0, layernorm_epsilon: float = 1e-5,
                 init_method: Optional[InitMethod] = None, output_layer_init_method: Optional[InitMethod] = None,
                 bias: bool = True, activation: str = "gelu_tanh", attn_mask_type: str = "causal",
                 apply_residual_post_layernorm: bool = False, layer_idx: int = 0, moe: Optional[MoEConfig] = None,
                 norm: str = "layernorm", gated: bool = False, num_key_value_heads: Optional[int] = None,
                 qkv_bias: Optional[bool] = None, rope_theta: Optional[float] = None, rope_scaling=None,
                 sliding_window: Optional[int] = None, qk_norm: bool = False, head_size: Optional[int] = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.apply_residual_post_layernorm = apply_residual_post_layernorm
        common = dict(output_dropout_prob=output_dropout_prob, init_method=init_method,
                      output_layer_init_method=output_layer_init_method, bias=bias, layer_idx=layer_idx)
        norms = {"layernorm": LayerNorm, "rmsnorm": RMSLayerNorm}
        if norm not in norms:
            raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {norm!r}")
        self.input_layernorm = norms[norm](hidden_size, eps=layernorm_epsilon, layer_idx=layer_idx)
        self.self_attention = MultiheadAttention(hidden_size, num_attention_heads, attn_mask_type=attn_mask_type,
                                                 attention_dropout_prob=attention_dropout_prob,
                                                 num_key_value_heads=num_key_value_heads, qkv_bias=qkv_bias,
                                                 rope_theta=rope_theta, rope_scaling=rope_scaling,
                                                 sliding_window=sliding_window, qk_norm=qk_norm,
                                                 qk_norm_eps=layernorm_epsilon, head_size=head_size, **common)
        self.post_attention_layernorm = norms[norm](hidden_size, eps=layernorm_epsilon, layer_idx=layer_idx)
        feed_forward = MLP if moe is None else functools.partial(MoELayer, moe)
        # Only a gated layer passes `gated`, so feed-forward blocks without the option still fit.
        self.mlp = feed_forward(hidden_size, ffn_hidden_size, activation=activation, **common,
                                **({"gated": True} if gated else {}))

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None, position_ids: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``hidden_states`` ``[batch, seq, hidden]``; mask, cache, positions and packed documents' ids as in
        ``MultiheadAttention``."""
        normed = self.input_layernorm(hidden_states)
        residual = normed if self.apply_residual_post_layernorm else hidden_states
        extra = {} if position_ids is None else {"position_ids": position_ids}
        if document_ids is not None:
            extra["document_ids"] = document_ids
        hidden_states = residual + self.self_attention(normed, attention_mask=attention_mask, kv_cache=kv_cache,
                                                       **extra)

        normed = self.post_attention_layernorm(hidden_states)
        residual = normed if self.apply_residual_post_layernorm else hidden_states
        return residual + self.mlp(normed)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}"
