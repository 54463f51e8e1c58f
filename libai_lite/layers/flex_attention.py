"""Attention masks built once per batch, and T5's relative bias read inside the kernel, for FlexAttention.

A mask or bias forces SDPA off its flash kernel and makes every layer read a ``[batch, heads, query, key]``
tensor. FlexAttention instead takes a ``BlockMask`` shared by every layer and a ``score_mod`` that reads
one bias row per key-minus-query diagonal.

Backends (``attention_backend``, else ``$LIBAI_LITE_ATTENTION``): ``auto`` runs flex compiled on CUDA
and, elsewhere, the same mask and bias materialised through SDPA (the CPU has no flex backward); ``flex``
and ``dense`` force one. A biased call is padded to whole 128-wide tiles, where flex's backward is right.
Both paths give zeros to a query that sees no key. ``flex_attend`` runs through ``FastPath``: each new
shape's first use also runs the dense path, and a failure or a difference beyond rounding logs one line
and keeps the dense path. tests/layers/test_flex_budget.py checks the kernels' shared memory.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..utils.fallback import FastPath, signature_of

BACKENDS = ("auto", "flex", "dense")
BACKEND_ENV = "LIBAI_LITE_ATTENTION"
_backend = None  # None: the environment's choice
_UNBUILT = object()
# Every tile size torch's flex kernels use divides this; a biased attention is padded to a multiple.
FLEX_TILE = 128


@contextlib.contextmanager
def attention_backend(name: str) -> Iterator[None]:
    """Within the block, masked or biased attention runs through ``name``: ``auto``, ``flex`` or ``dense``."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


def flex_enabled(device, dropout_p: float = 0.0) -> bool:
    """Whether masked or biased attention on ``device`` with this active dropout runs through flex.

    FlexAttention has no attention-probability dropout, so an active dropout keeps the dense path.
    """
    backend = current_backend()
    if dropout_p > 0.0 or backend == "dense":
        return False
    return backend == "flex" or torch.device(device).type == "cuda"


def current_backend() -> str:
    """The backend in force: ``attention_backend``'s, else ``$LIBAI_LITE_ATTENTION``, else ``auto``."""
    if _backend is not None:
        return _backend
    name = os.environ.get(BACKEND_ENV, "auto") or "auto"
    if name not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={name!r} is not an attention backend; use one of {', '.join(BACKENDS)}")
    return name


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    # One compiled function, so every call site shares its kernel cache.
    return torch.compile(flex_attention, dynamic=False)


def _tracing() -> bool:
    # Under torch.compile or a dispatch mode tensors are fake or traced and must not be kept.
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def relative_bias(rows: torch.Tensor, q_len: int):
    """FlexAttention's ``score_mod`` adding ``rows[kv_idx - q_idx + q_len - 1, h]``, where ``rows``
    ``[q_len + k_len - 1, heads]`` holds one bias per key-minus-query diagonal.

    A factory, so every layer hands flex a closure of the same code object and nothing recompiles.
    """
    offset = int(q_len) - 1

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + rows[kv_idx - q_idx + offset, h]

    return score_mod


@functools.lru_cache(maxsize=16)
def _cached_relative_index(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):
        return _relative_index(q_len, k_len, device)


def _relative_index(q_len: int, k_len: int, device) -> torch.Tensor:
    return torch.arange(k_len, device=device)[None, :] - torch.arange(q_len, device=device)[:, None] + (q_len - 1)


def relative_index(q_len: int, k_len: int, device=None) -> torch.Tensor:
    """``[q_len, k_len]``: the diagonal ``k - q + q_len - 1`` of each (query, key) pair, the row of
    ``rows`` (or of T5's ``diagonal_buckets``) that pair reads. Kept per shape outside tracing."""
    args = (int(q_len), int(k_len), torch.device(device if device is not None else "cpu"))
    return _relative_index(*args) if _tracing() else _cached_relative_index(*args)


def check_buckets(buckets: torch.Tensor, q_len: int, k_len: int) -> None:
    """Refuse ``buckets`` that are not one bucket per key-minus-query diagonal of ``q_len x k_len``."""
    if buckets.dim() != 1 or buckets.shape[0] != q_len + k_len - 1:
        raise ValueError(f"score_buckets must hold one bucket per key-minus-query diagonal, [{q_len + k_len - 1}] "
                         f"for {q_len} queries x {k_len} keys; got shape {tuple(buckets.shape)}")


def diagonal_bias(rows: torch.Tensor, q_len: int) -> torch.Tensor:
    """The bias ``[1, heads, q_len, k_len]`` that ``relative_bias(rows, q_len)`` adds, materialised."""
    k_len = rows.shape[0] - int(q_len) + 1
    return rows[relative_index(q_len, k_len, rows.device)].permute(2, 0, 1).unsqueeze(0)


def dense_bias(table: torch.Tensor, buckets: torch.Tensor, q_len: int) -> torch.Tensor:
    """The bias ``[1, heads, q_len, k_len]`` that ``table`` ``[num_buckets, heads]`` adds through ``buckets``
    ``[q_len + k_len - 1]``, the bucket of each key-minus-query diagonal (what flex adds, materialised)."""
    return diagonal_bias(table[buckets], q_len)


class AttentionMask:
    """Which keys each query may attend, for every layer of one batch: built once, read by all.

    All given conditions must hold. With ``causal`` a query sees keys at or before it, the queries being
    the last ``q_len`` of ``k_len`` positions; ``window`` also limits it to fewer than ``window`` positions
    back. ``document_ids`` ``[batch, seq]`` keep it to its own document, ``key_padding`` ``[batch, k_len]``
    marks real keys, and ``keep`` is any boolean mask broadcastable to ``[batch, heads, q_len, k_len]``.

    ``prepare(flex)`` builds ``block_mask`` or ``keep_mask`` outside any compiled region; otherwise they
    are built on first use and kept.
    """

    def __init__(self, q_len: int, k_len: int, *, causal: bool = False, window: Optional[int] = None,
                 document_ids: Optional[torch.Tensor] = None, key_padding: Optional[torch.Tensor] = None,
                 keep: Optional[torch.Tensor] = None, device=None):
        if document_ids is not None and (document_ids.dim() != 2 or q_len != k_len
                                         or document_ids.shape[-1] != q_len):
            raise ValueError(f"document_ids must be [batch, seq] over the {q_len} positions of a self-attention, "
                             f"got shape {tuple(document_ids.shape)}")
        if key_padding is not None and (key_padding.dim() != 2 or key_padding.shape[-1] != k_len):
            raise ValueError(f"key_padding must be [batch, {k_len}], got shape {tuple(key_padding.shape)}")
        if keep is not None:
            keep = keep if keep.dim() == 4 else keep[:, None] if keep.dim() == 3 else keep[:, None, None]
            if keep.shape[-2] not in (1, q_len) or keep.shape[-1] != k_len:
                raise ValueError(f"mask of shape {tuple(keep.shape)} does not cover {q_len} queries x {k_len} keys")
        if window is not None and int(window) < 1:
            raise ValueError(f"window must be at least 1 position, got {window}")
        present = [t for t in (document_ids, key_padding, keep) if t is not None]
        self.device = torch.device(device) if device is not None else present[0].device if present else None
        self.q_len, self.k_len, self.causal = int(q_len), int(k_len), bool(causal)
        self.window = None if window is None or int(window) >= k_len else int(window)
        self.document_ids = None if document_ids is None else document_ids.to(self.device)
        self.key_padding = None if key_padding is None else key_padding.to(self.device, torch.bool)
        self.keep = None if keep is None else keep.to(self.device, torch.bool)
        self.batch = max([1] + [t.shape[0] for t in present])
        self.heads = 1 if self.keep is None else self.keep.shape[1]
        self._block_mask: Optional[BlockMask] = None
        self._keep_mask: Optional[torch.Tensor] = None
        self._keep_built = False
        self._padded: dict = {}
        self._empty_rows = _UNBUILT

    @property
    def sees_itself(self) -> bool:
        """Every query sees at least its own key (causal, no padding): a boolean SDPA mask gives no NaN row."""
        return self.causal and self.q_len == self.k_len and self.key_padding is None and self.keep is None

    @property
    def masks_anything(self) -> bool:
        """False when every query may see every key (no condition set)."""
        return (self.causal or self.window is not None or self.document_ids is not None
                or self.key_padding is not None or self.keep is not None)

    def prepare(self, flex: bool) -> "AttentionMask":
        """Build the form ``flex`` (or SDPA) reads now, outside any compiled layer; returns self."""
        _ = self.block_mask if flex else self.keep_mask
        return self

    def mask_mod(self):
        """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` for these conditions."""
        offset, causal, window = self.k_len - self.q_len, self.causal, self.window
        docs, padding, keep = self.document_ids, self.key_padding, self.keep
        per_batch = [t is not None and t.shape[0] > 1 for t in (docs, padding, keep)]

        def mask_mod(b, h, q_idx, kv_idx):
            ok = (q_idx + offset >= kv_idx) if causal else (kv_idx >= 0)
            if window is not None:
                ok = ok & (q_idx + offset - kv_idx < window)
            if docs is not None:
                row = b if per_batch[0] else 0
                ok = ok & (docs[row, q_idx] == docs[row, kv_idx])
            if padding is not None:
                ok = ok & padding[b if per_batch[1] else 0, kv_idx]
            if keep is not None:
                ok = ok & keep[b if per_batch[2] else 0, h if keep.shape[1] > 1 else 0,
                               q_idx if keep.shape[2] > 1 else 0, kv_idx]
            return ok

        return mask_mod

    @property
    def block_mask(self) -> BlockMask:
        """The FlexAttention ``BlockMask`` (built on first use)."""
        if self._block_mask is None:
            self._block_mask = create_block_mask(
                self.mask_mod(), self.batch if self.batch > 1 else None, self.heads if self.heads > 1 else None,
                self.q_len, self.k_len, device=self.device if self.device is not None else "cpu")
        return self._block_mask

    def padded_block_mask(self, q_pad: int, k_pad: int) -> BlockMask:
        """The block mask over these positions padded at the end to ``q_pad x k_pad``: padded keys are
        hidden, padded queries see every real key (a row with no key has no finite softmax). Kept per size."""
        if (q_pad, k_pad) not in self._padded:
            inner = self.mask_mod() if self.masks_anything else None
            q_len, k_len = self.q_len, self.k_len

            def mask_mod(b, h, q_idx, kv_idx):
                real_key = kv_idx < k_len
                if inner is None:
                    return real_key
                # The inner mask reads its tensors at real positions only.
                seen = inner(b, h, torch.clamp(q_idx, max=q_len - 1), torch.clamp(kv_idx, max=k_len - 1))
                return real_key & (seen | (q_idx >= q_len))

            self._padded[(q_pad, k_pad)] = create_block_mask(
                mask_mod, self.batch if self.batch > 1 else None, self.heads if self.heads > 1 else None, q_pad, k_pad,
                device=self.device if self.device is not None else "cpu")
        return self._padded[(q_pad, k_pad)]

    @property
    def empty_rows(self) -> Optional[torch.Tensor]:
        """``[batch or 1, 1 or heads, q_len, 1]`` True where a query may see no key; None when none can.
        Built on first use, and kept for every layer of the batch."""
        if self._empty_rows is _UNBUILT:
            keep = self.keep_mask
            self._empty_rows = None if keep is None or self.sees_itself else ~keep.any(-1, keepdim=True)
        return self._empty_rows

    @property
    def keep_mask(self) -> Optional[torch.Tensor]:
        """The boolean SDPA mask (True = attend), ``[batch or 1, 1 or heads, q_len, k_len]``; None masks nothing."""
        if not self._keep_built:
            self._keep_mask, self._keep_built = self._dense_keep(), True
        return self._keep_mask

    def dense_bias(self, table: Optional[torch.Tensor], buckets: Optional[torch.Tensor], dtype) -> torch.Tensor:
        """This mask and ``table``'s relative bias through ``buckets`` ``[q + k - 1]`` as one additive SDPA
        mask ``[batch or 1, heads, q, k]``. Masked scores get ``finfo.min``, so an empty row is not NaN.

        Not kept between layers: activation checkpointing must recompute the same saved tensors.
        """
        return self.additive(None if table is None else dense_bias(table, buckets, self.q_len), dtype)

    def additive(self, bias: Optional[torch.Tensor], dtype) -> torch.Tensor:
        """This mask and ``bias`` (broadcastable to ``[batch, heads, q, k]``, or None) as one additive SDPA mask."""
        device = self.device if bias is None else bias.device
        out = torch.zeros((), dtype=dtype, device=device)
        if bias is not None:
            out = out + bias.to(dtype)
        keep = self.keep_mask
        if keep is not None:
            out = torch.where(keep, out, torch.finfo(dtype).min)
        return out

    def signature(self) -> tuple:
        """What a kernel compiled for this mask depends on: lengths, conditions and the masks' shapes."""
        return (self.q_len, self.k_len, self.causal, self.window, self.batch, self.heads,
                signature_of(self.document_ids, self.key_padding, self.keep)[1])

    def _dense_keep(self) -> Optional[torch.Tensor]:
        q, k, dev = self.q_len, self.k_len, self.device
        keep = None

        def both(a, b):
            return b if a is None else a & b

        if self.causal:
            keep = torch.ones(q, k, dtype=torch.bool, device=dev).tril(k - q)
        if self.window is not None:
            keep = both(keep, torch.ones(q, k, dtype=torch.bool, device=dev).triu(k - q - self.window + 1))
        if keep is not None:
            keep = keep[None, None]
        if self.document_ids is not None:
            docs = self.document_ids
            keep = both(keep, (docs[:, :, None] == docs[:, None, :])[:, None])
        if self.key_padding is not None:
            keep = both(keep, self.key_padding[:, None, None, :])
        if self.keep is not None:
            keep = both(keep, self.keep)
        return keep


_last_shared: list = [None]


def shared_mask(q_len: int, k_len: int, *, causal: bool, window: Optional[int], document_ids: Optional[torch.Tensor],
                device, flex: bool) -> AttentionMask:
    """The ``AttentionMask`` every layer of one step asks for, built by the first and handed to the others.

    Only the last batch's mask is kept; a call with the same unmodified ``document_ids`` tensor and shape
    reuses it. Under tracing each call builds its own, since a kept traced tensor would be invalid.
    """
    def build():
        return AttentionMask(q_len, k_len, causal=causal, window=window, document_ids=document_ids, device=device)

    if _tracing():
        return build().prepare(flex)
    key = (int(q_len), int(k_len), bool(causal), window, str(device),
           None if document_ids is None else document_ids._version)
    entry = _last_shared[0]
    if entry is None or entry[0] != key or entry[1] is not document_ids:
        entry = _last_shared[0] = (key, document_ids, build())
    return entry[2].prepare(flex)


def flex_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[AttentionMask] = None,
                table: Optional[torch.Tensor] = None, buckets: Optional[torch.Tensor] = None,
                scale: Optional[float] = None) -> torch.Tensor:
    """FlexAttention over ``[batch, heads, seq, head_size]`` with ``mask`` and, given ``table``
    ``[num_buckets, heads]`` and ``buckets`` ``[q_len + k_len - 1]``, the score bias
    ``table[buckets[k - q + q_len - 1], h]``. A kernel that fails at first use falls back to ``dense_attend``."""
    if (table is None) != (buckets is None):
        raise ValueError("a table bias needs both table and buckets")
    q_len, k_len = query.shape[-2], key.shape[-2]
    rows = None
    if table is not None:
        if table.shape[-1] != query.shape[1]:
            raise ValueError(f"the bias table holds {table.shape[-1]} heads, the attention {query.shape[1]}")
        check_buckets(buckets, q_len, k_len)
        # One row per diagonal, gathered here so the kernel reads no captured [query, key] map.
        rows = table[buckets].to(query.dtype)
    return _flex_or_dense(query, key, value, rows, mask, scale)


def dense_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: Optional[torch.Tensor],
                 mask: Optional[AttentionMask], scale: Optional[float]) -> torch.Tensor:
    """What ``flex_attend`` computes, through SDPA with the mask and ``rows`` ``[q + k - 1, heads]``
    materialised. A query that sees no key gets zeros, as from flex."""
    keep = None if mask is None else mask.keep_mask
    if rows is None and (keep is None or mask.sees_itself):
        attn_mask = keep  # boolean: no row is empty
    else:
        bias = None if rows is None else diagonal_bias(rows, query.shape[-2])
        attn_mask = bias.to(query.dtype) if mask is None else mask.additive(bias, query.dtype)
    gqa = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale, **gqa)
    empty = None if mask is None else mask.empty_rows
    return out if empty is None else out.masked_fill(empty, 0.0)


def _padded_rows(rows: torch.Tensor, q_len: int, k_len: int, q_pad: int, k_pad: int) -> torch.Tensor:
    """``rows`` for the diagonals of ``q_pad x k_pad`` positions (these padded at the end): a real pair
    reads its own row, a padded one the nearest."""
    index = (torch.arange(q_pad + k_pad - 1, device=rows.device) - (q_pad - q_len)).clamp(0, q_len + k_len - 2)
    return rows[index]


@functools.lru_cache(maxsize=8)
def _no_mask(q_len: int, k_len: int, device: torch.device) -> AttentionMask:
    with torch.inference_mode(False):
        return AttentionMask(q_len, k_len, device=device)


def _flex(query, key, value, rows, mask, scale):
    q_len, k_len = query.shape[-2], key.shape[-2]
    q_pad, k_pad = -(-q_len // FLEX_TILE) * FLEX_TILE, -(-k_len // FLEX_TILE) * FLEX_TILE
    padded = rows is not None and (q_pad, k_pad) != (q_len, k_len)
    if padded:
        if mask is None:
            mask = AttentionMask(q_len, k_len, device=query.device) if _tracing() else _no_mask(
                q_len, k_len, query.device)
        block_mask = mask.padded_block_mask(q_pad, k_pad)
        query = F.pad(query, (0, 0, 0, q_pad - q_len))
        key, value = (F.pad(t, (0, 0, 0, k_pad - k_len)) for t in (key, value))
        rows = _padded_rows(rows, q_len, k_len, q_pad, k_pad)
    else:
        block_mask = None if mask is None or not mask.masks_anything else mask.block_mask
    score_mod = None if rows is None else relative_bias(rows, query.shape[-2])
    run = _compiled_flex() if query.device.type == "cuda" else flex_attention
    gqa = {"enable_gqa": True} if key.shape[1] != query.shape[1] else {}
    out = run(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale, **gqa)
    return out[..., :q_len, :] if padded else out


def _flex_signature(query, key, value, rows, mask, scale):
    return signature_of(query, key, value, rows, None if mask is None else mask.signature(), scale)


def _flex_describe(query, key, value, rows, mask, scale):
    bias = ", relative bias" if rows is not None else ""
    return (f"{query.shape[-2]} queries x {key.shape[-2]} keys, {query.shape[1]} heads of {query.shape[-1]}, "
            f"{str(query.dtype).replace('torch.', '')}{bias}")


_flex_or_dense = FastPath("FlexAttention", _flex, dense_attend, signature=_flex_signature,
                          plain_name="dense SDPA attention", describe=_flex_describe, compare=True)
