"""Multi-head attention with a head-major fused QKV projection, ready for tensor parallelism."""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..sbp import broadcast, declare, hidden, split
from ..utils.errors import UsageError
from .flex_attention import AttentionMask, check_buckets, flex_attend, flex_enabled, shared_mask
from .init_methods import InitMethod
from .layer_norm import RMSLayerNorm
from .linear import Linear1D
from .rotary import RotaryEmbedding, apply_rotary


class KVCache:
    """The keys and values ``[batch, local_heads, length, head_size]`` one attention layer has computed so
    far, for incremental decoding. With ``capacity`` the buffers are allocated once and written in place;
    without, they grow by concatenation (cross-attention fills it once from the encoder output)."""

    def __init__(self, capacity: Optional[int] = None):
        self.capacity = capacity
        self.length = 0
        self._key: Optional[torch.Tensor] = None
        self._value: Optional[torch.Tensor] = None

    def update(self, key: torch.Tensor, value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Append ``key``/``value`` ``[batch, heads, new, head_size]``; return all keys and values cached so far."""
        end = self.length + key.shape[-2]
        if self.capacity is None:
            grow = self._key is not None
            self._key = torch.cat([self._key, key], dim=-2) if grow else key
            self._value = torch.cat([self._value, value], dim=-2) if grow else value
        else:
            if end > self.capacity:
                raise ValueError(f"KVCache holds {self.capacity} positions; {end} were given")
            if self._key is None:
                shape = (*key.shape[:-2], self.capacity, key.shape[-1])
                self._key, self._value = key.new_empty(shape), value.new_empty(shape)
            self._key[..., self.length : end, :] = key
            self._value[..., self.length : end, :] = value
        self.length = end
        return self.key, self.value

    @property
    def key(self) -> Optional[torch.Tensor]:
        """Cached keys ``[batch, heads, length, head_size]`` (None while empty)."""
        return None if self._key is None else self._key[..., : self.length, :]

    @property
    def value(self) -> Optional[torch.Tensor]:
        """Cached values, shaped as ``key``."""
        return None if self._value is None else self._value[..., : self.length, :]


def document_mask(document_ids: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Boolean SDPA mask ``[batch, 1, seq, seq]``, True to attend, from ``document_ids`` ``[batch, seq]``.
    A query sees keys of its own document, and with ``causal`` only those at or before it."""
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [batch, seq], got shape {tuple(document_ids.shape)}")
    keep = document_ids[:, :, None] == document_ids[:, None, :]
    if causal:
        keep = keep.tril()
    return keep[:, None]


def _key_mask(attention_mask: torch.Tensor, device) -> torch.Tensor:
    """A boolean keep-mask broadcastable to ``[batch, heads, query, key]``; ``[batch, key]`` masks keys."""
    mask = attention_mask.to(device=device, dtype=torch.bool)
    return mask[:, None, None, :] if mask.dim() == 2 else mask


def _head_norm(head_size: int, eps: float, layer_idx: int) -> RMSLayerNorm:
    """An RMS norm over each head of ``[batch, seq, heads, head_size]``. Its scale is replicated under tensor
    parallelism while its input holds this rank's heads (split on dim 2), so the scale's gradient sums the
    ranks' partial ones."""
    norm = RMSLayerNorm(head_size, eps=eps, layer_idx=layer_idx)
    norm.sbp = declare(weight=broadcast, input=split(2), output=split(2))
    return norm


class MultiheadAttention(nn.Module):
    """Self- or cross-attention through ``F.scaled_dot_product_attention``.

    Self-attention uses one fused ``query_key_value`` projection laid out head-major (Megatron's
    ``[num_heads, 3, head_size]``), so an even tensor-parallel split of its outputs gives every rank
    whole heads; the forward reshapes with ``-1`` heads and runs unchanged on a shard. ``dense`` is
    row-parallel. Cross-attention uses a column-parallel ``query`` and a fused ``key_value`` over
    ``encoder_states``. The block needs ``hidden_states`` and ``encoder_states`` whole.

    ``attn_mask_type`` is ``"causal"`` or ``"padding"``. ``head_size`` defaults to
    ``hidden_size // num_attention_heads`` and ``softmax_scale`` to ``1/sqrt(head_size)``; T5 sets both.

    With ``num_key_value_heads`` below ``num_attention_heads`` (grouped-query attention) the fused
    projection is laid out per key/value group, ``[kv_heads, group + 2, head_size]``, so tensor
    parallelism splits whole groups and a ``KVCache`` stores only the key/value heads. Query head ``h``
    reads key/value head ``h // group``. ``qkv_bias`` (default ``bias``) sets the q/k/v bias alone.
    ``qk_norm`` RMS-normalises each query and key head over ``head_size`` (``q_norm``/``k_norm``, one
    scale shared by all heads, epsilon ``qk_norm_eps``) before the rotary embedding (self-attention only).
    ``rope_theta`` and ``rope_scaling`` enable rotary embeddings, computed after sequence parallelism
    has gathered the whole sequence. Under context parallelism keys and values are gathered over the
    cp ranks and masked by global positions.
    """

    sbp = declare(input=broadcast, output=hidden, args=("hidden_states", "encoder_states"))

    def __init__(self, hidden_size: int, num_attention_heads: int, attention_dropout_prob: float = 0.0,
                 output_dropout_prob: float = 0.0, init_method: Optional[InitMethod] = None,
                 output_layer_init_method: Optional[InitMethod] = None, layer_idx: int = 0,
                 attn_mask_type: str = "causal", bias: bool = True, is_cross_attention: bool = False,
                 head_size: Optional[int] = None, softmax_scale: Optional[float] = None,
                 num_key_value_heads: Optional[int] = None, qkv_bias: Optional[bool] = None,
                 rope_theta: Optional[float] = None, rope_scaling: Optional[dict] = None,
                 sliding_window: Optional[int] = None, qk_norm: bool = False, qk_norm_eps: float = 1e-6):
        super().__init__()
        if attn_mask_type not in ("causal", "padding"):
            raise ValueError(f"attn_mask_type must be 'causal' or 'padding', got {attn_mask_type!r}")
        if is_cross_attention and attn_mask_type == "causal":
            raise ValueError("cross-attention cannot be causal; use attn_mask_type='padding'")
        if head_size is None:
            if hidden_size % num_attention_heads != 0:
                raise ValueError(f"hidden_size {hidden_size} is not divisible by num_attention_heads "
                                 f"{num_attention_heads}; pass head_size explicitly")
            head_size = hidden_size // num_attention_heads
        kv_heads = num_attention_heads if num_key_value_heads is None else int(num_key_value_heads)
        if kv_heads < 1 or num_attention_heads % kv_heads:
            raise ValueError(f"num_attention_heads {num_attention_heads} is not a multiple of num_key_value_heads "
                             f"{kv_heads}")
        if kv_heads != num_attention_heads and is_cross_attention:
            raise ValueError("grouped-query attention is for self-attention; leave num_key_value_heads unset")
        if sliding_window is not None and (attn_mask_type != "causal" or int(sliding_window) < 1):
            raise ValueError(f"sliding_window={sliding_window} needs causal self-attention and a window of at least "
                             f"1 position")
        if qk_norm and is_cross_attention:
            raise ValueError("qk_norm normalises self-attention's query and key heads; leave it off for "
                             "cross-attention")

        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.head_size = head_size
        self.num_key_value_heads = kv_heads
        self.group = num_attention_heads // kv_heads
        self.attention_dropout_prob = attention_dropout_prob
        self.attn_mask_type = attn_mask_type
        self.is_cross_attention = is_cross_attention
        self.softmax_scale = softmax_scale
        self.layer_idx = layer_idx
        # Each query sees itself and the sliding_window - 1 positions before it (Mistral's window).
        self.sliding_window = None if sliding_window is None else int(sliding_window)

        inner = num_attention_heads * head_size

        in_bias = bias if qkv_bias is None else qkv_bias

        def proj(n_in, n_out, parallel, per_head, init=init_method, has_bias=in_bias, counts="num_attention_heads"):
            return Linear1D(n_in, n_out, bias=has_bias, parallel=parallel, init_method=init, layer_idx=layer_idx,
                            split_unit=per_head * head_size, split_counts=counts)

        if is_cross_attention:
            self.query = proj(hidden_size, inner, "col", 1)
            self.key_value = proj(hidden_size, 2 * inner, "col", 2)
        elif self.group == 1:
            self.query_key_value = proj(hidden_size, 3 * inner, "col", 3)
        else:
            # One block per key/value head: a tensor-parallel size must divide their number.
            self.query_key_value = proj(hidden_size, kv_heads * (self.group + 2) * head_size, "col", self.group + 2,
                                        counts="num_key_value_heads")
        self.dense = proj(inner, hidden_size, "row", 1, output_layer_init_method or init_method, bias)
        self.rotary = None if rope_theta is None else RotaryEmbedding(head_size, rope_theta, rope_scaling)
        self.q_norm = _head_norm(head_size, qk_norm_eps, layer_idx) if qk_norm else None
        self.k_norm = _head_norm(head_size, qk_norm_eps, layer_idx) if qk_norm else None
        self.output_dropout = nn.Dropout(output_dropout_prob)
        # Set by libai_lite.parallel.context_parallel.apply_context_parallel (causal self-attention only).
        self.context_parallel = None

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                encoder_states: Optional[torch.Tensor] = None, position_bias: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None, position_ids: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None, score_table: Optional[torch.Tensor] = None,
                score_buckets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attend and project back to ``hidden_size``.

        ``hidden_states`` ``[batch, seq, hidden]``. ``attention_mask`` marks keys that may be attended
        (True/1), ``[batch, key_seq]`` or broadcastable to ``[batch, heads, query_seq, key_seq]``, or is an
        ``AttentionMask`` that then says everything masked. ``position_bias`` is an additive score bias
        ``[batch or 1, local_heads, query_seq, key_seq]``. With ``kv_cache``, self-attention appends the new
        positions and attends over all cached keys; cross-attention fills the cache once from
        ``encoder_states``. ``position_ids`` ``[batch or 1, seq]`` default to the positions after the cache.
        ``document_ids`` ``[batch, seq]`` restrict each query to its own packed document (no cache).
        ``score_table`` ``[num_buckets, local_heads]`` with ``score_buckets`` ``[query_seq + key_seq - 1]``
        add ``score_table[score_buckets[k - q + query_seq - 1], h]``, a relative position bias. Masks and
        tables go through FlexAttention where ``flex_enabled`` allows it, else densely.
        """
        bsz, q_len, _ = hidden_states.shape
        if document_ids is not None:
            if self.is_cross_attention or kv_cache is not None:
                raise ValueError("document_ids mask self-attention over a whole sequence; they take no KV cache and "
                                 "no cross-attention")
            if document_ids.shape[-1] != q_len:
                raise ValueError(f"document_ids cover {document_ids.shape[-1]} positions, the sequence {q_len}")
        hd = self.head_size
        if self.is_cross_attention:
            query = self.query(hidden_states).view(bsz, q_len, -1, hd).transpose(1, 2)
            if kv_cache is not None and kv_cache.length:
                # The encoder output is fixed while decoding: its keys and values are projected once.
                key, value = kv_cache.key, kv_cache.value
            else:
                if encoder_states is None:
                    raise ValueError("cross-attention needs encoder_states")
                kv = self.key_value(encoder_states).view(bsz, encoder_states.shape[1], -1, 2 * hd).transpose(1, 2)
                key, value = kv.chunk(2, dim=-1)
                if kv_cache is not None:
                    key, value = kv_cache.update(key, value)
        else:
            g = self.group
            # Split before moving heads ahead of positions: the split's backward (a cat of the three gradients)
            # then writes the projection's gradient in its own layout, with no copy after it.
            qkv = self.query_key_value(hidden_states).view(bsz, q_len, -1, (g + 2) * hd)
            query, key, value = qkv.split([g * hd, hd, hd], dim=-1)
            # [b, s, kv, g * hd] -> [b, s, kv * g, hd]: query head kv * g + j belongs to key/value head kv.
            query = query.reshape(bsz, q_len, -1, hd)
            if self.q_norm is not None:
                # Back in the projection's dtype (fp32 norm scales under autocast): the cache and the kernels
                # then get q, k and v in one dtype.
                query, key = self.q_norm(query).to(query.dtype), self.k_norm(key).to(key.dtype)
            query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
            if self.rotary is not None:
                if position_ids is None:
                    past = kv_cache.length if kv_cache is not None else 0
                    position_ids = torch.arange(past, past + q_len, device=query.device)
                cos, sin = self.rotary(position_ids, query.dtype)
                query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
            if kv_cache is not None:
                key, value = kv_cache.update(key, value)

        cp = self.context_parallel
        if cp is not None and cp.enabled:
            # Keys were rotated by their global positions above; the mask uses global positions too.
            if kv_cache is not None or attention_mask is not None or position_bias is not None \
                    or score_table is not None:
                raise ValueError("context-parallel attention takes no KV cache, attention_mask or position_bias")
            if self.sliding_window is not None:
                raise UsageError("context parallelism does not apply a sliding attention window yet; set "
                                 "train.dist.context_parallel_size=1")
            key, value, attn_mask = cp.gather_kv(key, value, document_ids)
            is_causal = False
        elif isinstance(attention_mask, AttentionMask) or score_table is not None or self._shares_mask(
                key, attention_mask, position_bias, kv_cache, document_ids):
            dropout = self.attention_dropout_prob if self.training else 0.0
            if isinstance(attention_mask, AttentionMask) or score_table is not None:
                mask = self._attention_mask(query, key, attention_mask, document_ids)
            else:  # packed documents or a sliding window: one mask for every layer of the step
                mask = shared_mask(q_len, key.shape[-2], causal=True, window=self.sliding_window,
                                   document_ids=document_ids, device=query.device,
                                   flex=kv_cache is None and flex_enabled(query.device, dropout))
            if kv_cache is None and flex_enabled(query.device, dropout):
                context = flex_attend(query, key, value, mask, score_table, score_buckets, self.softmax_scale)
                return self.output_dropout(self.dense(context.transpose(1, 2).reshape(bsz, q_len, -1)))
            attn_mask, is_causal = self._dense_mask(query, mask, score_table, score_buckets), False
        else:
            attn_mask, is_causal = self._score_mask(query, key, attention_mask, position_bias, document_ids)
        gqa = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}
        context = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                                 dropout_p=self.attention_dropout_prob if self.training else 0.0,
                                                 scale=self.softmax_scale, **gqa)
        context = context.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.output_dropout(self.dense(context))

    def _shares_mask(self, key, attention_mask, position_bias, kv_cache, document_ids) -> bool:
        """Whether this call's only mask is causality with packed documents or a window (shared per step)."""
        window = self.sliding_window is not None and key.shape[-2] > self.sliding_window
        return (self.attn_mask_type == "causal" and (document_ids is not None or window) and kv_cache is None
                and attention_mask is None and position_bias is None)

    def _attention_mask(self, query, key, attention_mask, document_ids) -> AttentionMask:
        """``attention_mask`` as an ``AttentionMask`` (one given is checked against this attention)."""
        q_len, k_len = query.shape[-2], key.shape[-2]
        causal = self.attn_mask_type == "causal"
        if isinstance(attention_mask, AttentionMask):
            mask = attention_mask
            window = self.sliding_window if self.sliding_window is not None and k_len > self.sliding_window else None
            if (mask.q_len, mask.k_len) != (q_len, k_len) or (causal and not mask.causal) or mask.window != window:
                raise ValueError(f"the AttentionMask ({mask.q_len} queries x {mask.k_len} keys, causal={mask.causal}, "
                                 f"window={mask.window}) does not fit this attention ({q_len} x {k_len}, causal="
                                 f"{causal}, window={window})")
            return mask
        if attention_mask is None:
            keep = padding = None
        elif attention_mask.dim() == 2:
            keep, padding = None, attention_mask
        else:
            keep, padding = attention_mask, None
        return AttentionMask(q_len, k_len, causal=causal, window=self.sliding_window, document_ids=document_ids,
                             key_padding=padding, keep=keep, device=query.device)

    def _dense_mask(self, query, mask: AttentionMask, table, buckets) -> Optional[torch.Tensor]:
        """``mask`` and the table bias as one additive SDPA mask (what ``_score_mask`` computes for them)."""
        if table is not None and table.shape[-1] != query.shape[1]:
            raise ValueError(f"the score table holds {table.shape[-1]} heads but this attention {query.shape[1]}; "
                             f"under tensor parallelism give it this rank's heads only")
        if table is not None:
            check_buckets(buckets, query.shape[-2], mask.k_len)
        keep = mask.keep_mask
        if table is None and (keep is None or mask.sees_itself):
            return keep  # boolean, as document_mask: no row is empty
        return mask.dense_bias(table, buckets, query.dtype)

    def _score_mask(self, query, key, attention_mask, position_bias, document_ids=None):
        """Return ``(attn_mask, is_causal)`` for SDPA, preferring the mask-free causal kernel when possible."""
        causal = self.attn_mask_type == "causal"
        q_len, k_len = query.shape[-2], key.shape[-2]
        window = self.sliding_window if self.sliding_window is not None and k_len > self.sliding_window else None
        if document_ids is not None:
            keep = document_mask(document_ids.to(query.device), causal)
            if window is not None:
                keep = keep & self._window(q_len, k_len, query.device)
            if attention_mask is None and position_bias is None:
                # Every query sees at least itself, so a boolean mask has no empty row (no NaN).
                return keep, False
            attention_mask = keep if attention_mask is None else keep & _key_mask(attention_mask, query.device)
        if attention_mask is None and position_bias is None and window is None:
            if not causal or q_len == k_len:
                return None, causal
            if q_len == 1:  # the one new query of a cached decoding step may see every key
                return None, False

        if position_bias is not None and position_bias.shape[-3] not in (1, query.shape[1]):
            raise ValueError(
                f"position_bias holds {position_bias.shape[-3]} heads but this attention {query.shape[1]}; under "
                f"tensor parallelism give it this rank's heads only: split the table it comes from over heads "
                f"(Embedding(..., parallel=\"col\"))")
        keep = None
        if causal:
            # The queries are the last q_len of the k_len positions (fewer when keys come from a cache);
            # SDPA's is_causal would align them to the first ones instead.
            keep = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
            if window is not None and document_ids is None:
                keep = keep & self._window(q_len, k_len, query.device)
        if attention_mask is not None:
            mask = _key_mask(attention_mask, query.device)
            keep = mask if keep is None else keep & mask

        # A finite floor keeps rows with no visible key finite, where a boolean mask would give NaN.
        bias = torch.zeros((), dtype=query.dtype, device=query.device)
        if position_bias is not None:
            bias = bias + position_bias.to(query.dtype)
        if keep is not None:
            bias = torch.where(keep, bias, torch.finfo(query.dtype).min)
        return bias, False

    def _window(self, q_len: int, k_len: int, device) -> torch.Tensor:
        """``[q_len, k_len]``: True where a key lies less than ``sliding_window`` positions before its query
        (the queries being the last ``q_len`` positions, as after a cache)."""
        return torch.ones(q_len, k_len, dtype=torch.bool, device=device).triu(k_len - q_len - self.sliding_window + 1)

    def extra_repr(self) -> str:
        kind = "cross" if self.is_cross_attention else self.attn_mask_type
        kv = "" if self.group == 1 else f", kv_heads={self.num_key_value_heads}"
        qk = ", qk_norm" if self.q_norm is not None else ""
        return (f"heads={self.num_attention_heads}{kv}, head_size={self.head_size}{qk}, {kind}, "
                f"layer_idx={self.layer_idx}")
