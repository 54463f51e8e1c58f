"""One T5 block: RMS-normed pre-LN self-attention, cross-attention (decoder only) and feed-forward."""
import functools
import warnings
from typing import Optional, Tuple

import torch
from torch import nn

from libai_lite.layers import MLP, MoEConfig, MoELayer, MultiheadAttention, RMSLayerNorm, init_method_normal
from libai_lite.layers.attention import KVCache
from libai_lite.layers.init_methods import InitMethod

from .relative_position import RelativePositionBias, diagonal_buckets

# Each layer passes the stack's position bias on as it received it, and FSDP2 wraps a module's inputs in views of
# its own: it then warns, on every rank, that the layer returned a view an in-place op could detach from its hooks.
# No layer changes the bias in place, so the warning says nothing a user can act on.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPMT5TransformerLayer\) returned a view tensor")

# model_type -> (activation, gated): T5 v1.0 uses ReLU, T5 v1.1 / mT5 gated-GELU ("gelu_new").
FEED_FORWARD = {"t5": ("relu", False), "mt5": ("gelu_tanh", True)}


def fused_qkv_init_method(q_std: float, kv_std: float, head_size: int) -> InitMethod:
    """Initialiser for a head-major fused ``[heads, 3, head_size]`` projection whose q rows need their own std.

    T5 does not scale scores by ``1/sqrt(head_size)``; Mesh TensorFlow compensates by
    drawing q with std ``(d_model * d_kv) ** -0.5`` instead of k/v's ``d_model ** -0.5``.
    """

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            tensor.normal_(0.0, kv_std)
            tensor.view(-1, 3, head_size, tensor.shape[-1])[:, 0].mul_(q_std / kv_std)
        return tensor

    return init_


class MT5TransformerLayer(nn.Module):
    """A T5 encoder or decoder block on libai_lite's parallel layers.

    ``x + self_attention(rms(x))``, then (decoder) ``x + cross_attention(rms(x), encoder_states)``,
    then ``x + mlp(rms(x))``. Attention has no biases and no ``1/sqrt(d)`` score scaling
    (``softmax_scale=1.0``); its scores get the relative position bias of the stack, which
    only the stack's first layer (``has_relative_attention_bias=True``) owns and computes;
    every layer returns it so the next one reuses it. Dropouts live inside the attention
    (probabilities, output) and MLP (output) modules.

    Weights are drawn as Mesh TensorFlow / Hugging Face T5 draws them, all scaled by
    ``initializer_range`` (T5's ``initializer_factor``): q ``(d_model*d_kv)^-1/2``, k, v and
    the MLP input ``d_model^-1/2``, attention output ``(heads*d_kv)^-1/2``, MLP output
    ``d_ff^-1/2``, relative bias table ``d_model^-1/2``.

    Submodule names follow LiBai's MT5 project: ``input_layernorm``, ``self_attention``
    (fused head-major ``query_key_value``, ``dense``), ``relative_attention_bias`` (first
    layer only), ``post_attention_layernorm``, then for a decoder ``cross_attention``
    (``query``, ``key_value``, ``dense``) and ``post_cross_attention_layernorm``, then
    ``mlp`` (``dense_h_to_4h``, for mT5 gate and up in one weight with rows interleaved, ``dense_4h_to_h``), or with
    ``moe`` a ``MoELayer`` (``mlp.router``, ``mlp.experts.<e>.dense_h_to_4h``, ...).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        head_size: int,
        *,
        is_decoder: bool = False,
        has_relative_attention_bias: bool = False,
        relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128,
        attention_dropout_prob: float = 0.0,
        output_dropout_prob: float = 0.0,
        layernorm_epsilon: float = 1e-6,
        model_type: str = "mt5",
        initializer_range: float = 1.0,
        layer_idx: int = 0,
        moe: Optional[MoEConfig] = None,
    ):
        super().__init__()
        if model_type not in FEED_FORWARD:
            raise ValueError(f"model_type must be one of {sorted(FEED_FORWARD)}, got {model_type!r}")
        self.is_decoder = is_decoder
        self.layer_idx = layer_idx
        # Every layer of a stack reads its first layer's table through the same buckets.
        self.bucket_args = dict(bidirectional=not is_decoder, num_buckets=relative_attention_num_buckets,
                                max_distance=relative_attention_max_distance)
        factor = initializer_range
        inner = num_attention_heads * head_size
        q_init = init_method_normal(factor * (hidden_size * head_size) ** -0.5)
        in_init = init_method_normal(factor * hidden_size**-0.5)
        out_init = init_method_normal(factor * inner**-0.5)

        def attention(kind: str) -> MultiheadAttention:
            attn = MultiheadAttention(
                hidden_size,
                num_attention_heads,
                attention_dropout_prob=attention_dropout_prob,
                output_dropout_prob=output_dropout_prob,
                init_method=in_init,
                output_layer_init_method=out_init,
                layer_idx=layer_idx,
                attn_mask_type=kind if kind != "cross" else "padding",
                bias=False,
                is_cross_attention=kind == "cross",
                head_size=head_size,
                softmax_scale=1.0,
            )
            # MultiheadAttention takes one initialiser for all input projections; q needs its own std.
            q = attn.query if kind == "cross" else attn.query_key_value
            q.init_method = q_init if kind == "cross" else fused_qkv_init_method(
                factor * (hidden_size * head_size) ** -0.5, factor * hidden_size**-0.5, head_size
            )
            q.reset_parameters()
            return attn

        self.input_layernorm = RMSLayerNorm(hidden_size, eps=layernorm_epsilon, layer_idx=layer_idx)
        self.relative_attention_bias = (
            RelativePositionBias(
                relative_attention_num_buckets,
                num_attention_heads,
                bidirectional=not is_decoder,
                max_distance=relative_attention_max_distance,
                init_method=in_init,
                layer_idx=layer_idx,
            )
            if has_relative_attention_bias
            else None
        )
        self.self_attention = attention("causal" if is_decoder else "padding")
        self.post_attention_layernorm = RMSLayerNorm(hidden_size, eps=layernorm_epsilon, layer_idx=layer_idx)
        if is_decoder:
            self.cross_attention = attention("cross")
            self.post_cross_attention_layernorm = RMSLayerNorm(hidden_size, eps=layernorm_epsilon, layer_idx=layer_idx)
        else:
            self.cross_attention = None
            self.post_cross_attention_layernorm = None
        activation, gated = FEED_FORWARD[model_type]
        # With `moe`, a mixture of experts that are each this MLP (MoELayer takes MLP's arguments).
        self.mlp = (MLP if moe is None else functools.partial(MoELayer, moe))(
            hidden_size,
            ffn_hidden_size,
            output_dropout_prob=output_dropout_prob,
            init_method=in_init,
            output_layer_init_method=init_method_normal(factor * ffn_hidden_size**-0.5),
            bias=False,
            activation=activation,
            gated=gated,
            layer_idx=layer_idx,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_bias: Optional[torch.Tensor] = None,
        encoder_states: Optional[torch.Tensor] = None,
        encoder_attention_mask: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        cross_kv_cache: Optional[KVCache] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Run the block; returns ``(hidden_states, position_bias)`` so later layers reuse the bias.

        Args:
            hidden_states: ``[batch, seq, hidden]``.
            attention_mask: self-attention mask, True/1 = may attend (see ``MultiheadAttention``);
                a decoder adds causality itself. An ``AttentionMask`` (the model builds one per batch
                for all layers) says everything, causality included.
            position_bias: the stack's relative bias table ``[num_buckets, heads]`` as its first layer
                returns it (``RelativePositionBias.table()``: this rank's heads), which this layer indexes
                by the (cached) bucket of each key-minus-query diagonal; or a dense ``[1, heads, seq, seq]``
                bias. Ignored (and recomputed) by the layer that owns the table.
            encoder_states: encoder output ``[batch, enc_seq, hidden]`` (decoder only).
            encoder_attention_mask: cross-attention mask over the encoder positions (or an ``AttentionMask``).
            kv_cache, cross_kv_cache: incremental decoding (see ``MultiheadAttention``): the
                self-attention keys and values so far, and the encoder's projected once.
                ``hidden_states`` are then the new positions only, and the bias covers their
                rows against every cached key.
        """
        seq = hidden_states.shape[1]
        past = kv_cache.length if kv_cache is not None else 0
        if self.relative_attention_bias is not None:
            position_bias = self.relative_attention_bias.table()
        elif position_bias is None:
            raise ValueError(
                f"layer {self.layer_idx} reuses the relative position bias computed by the first layer of its stack; "
                "pass position_bias (a pipeline stage receives it from the stage before)"
            )
        bias = {"position_bias": position_bias}
        if position_bias.dim() == 2:
            # The table goes to attention with the bucket of every key-minus-query diagonal: flex reads the
            # [diagonals, heads] bias by kv_idx - q_idx in its kernel, the dense path gathers [1, heads, q, k].
            buckets = diagonal_buckets(seq, past + seq, past, device=position_bias.device, **self.bucket_args)
            bias = {"score_table": position_bias, "score_buckets": buckets}

        normed = self.input_layernorm(hidden_states)
        hidden_states = hidden_states + self.self_attention(
            normed, attention_mask=attention_mask, kv_cache=kv_cache, **bias
        )
        if self.is_decoder:
            normed = self.post_attention_layernorm(hidden_states)
            hidden_states = hidden_states + self.cross_attention(
                normed, attention_mask=encoder_attention_mask, encoder_states=encoder_states, kv_cache=cross_kv_cache
            )
            normed = self.post_cross_attention_layernorm(hidden_states)
        else:
            normed = self.post_attention_layernorm(hidden_states)
        return hidden_states + self.mlp(normed), position_bias

    def extra_repr(self) -> str:
        return f"{'decoder' if self.is_decoder else 'encoder'}, layer_idx={self.layer_idx}"
