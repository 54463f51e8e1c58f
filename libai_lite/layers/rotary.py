"""Rotary position embeddings (RoPE) as the Llama family uses them, in Hugging Face's convention.

Feature ``i`` of a head pairs with feature ``i + head_size/2``, the layout of Hugging Face Llama, Mistral
and Qwen2 checkpoints, so their q/k weights load unpermuted. ``scaling`` is a ``config.json``
``rope_scaling`` dict; ``rope_type`` ``"llama3"`` selects Llama 3.1's frequency scaling.
"""
import math
import weakref
from typing import Mapping, Optional, Tuple

import torch
from torch import nn


def rope_inv_freq(head_size: int, theta: float = 10000.0, scaling: Optional[Mapping] = None,
                  device=None) -> torch.Tensor:
    """The ``head_size // 2`` inverse frequencies ``theta ** (-2i / head_size)`` in fp32, scaled as ``scaling`` says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.int64, device=device).float() / head_size))
    kind = None if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported; use 'default' or 'llama3'")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    # Llama 3.1: long wavelengths (low frequencies) are slowed by `factor`, short ones kept, and the
    # band between is interpolated smoothly in 1/wavelength.
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension's two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _LastAngles:
    """The last ``(cos, sin)`` any ``RotaryEmbedding`` computed, with ``sin``'s first half negated.

    Every layer rotates by the same angles, so one forward computes them once. The cache matches
    ``position_ids`` by identity, since comparing values would read the device. Compiled code computes its own.
    """

    def __init__(self):
        self.key = None
        self.positions = None  # a weak reference: the cache never keeps a step's tensors alive
        self.cos = self.sin = self.signed_sin = None

    def get(self, position_ids: torch.Tensor, key: tuple):
        if self.key == key and self.positions is not None and self.positions() is position_ids:
            return self.cos, self.sin
        return None

    def put(self, position_ids: torch.Tensor, key: tuple, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.key, self.positions = key, weakref.ref(position_ids)
        self.cos, self.sin, self.signed_sin = cos, sin, _signed(sin)

    def signed(self, sin: torch.Tensor) -> torch.Tensor:
        if _compiling():
            return _signed(sin)
        return self.signed_sin if sin is self.sin else _signed(sin)


def _signed(sin: torch.Tensor) -> torch.Tensor:
    """``[s, s] -> [-s, s]``: ``rotate_half(x) * sin == x.roll(half) * _signed(sin)``, exactly."""
    s1, s2 = sin.chunk(2, dim=-1)
    return torch.cat((-s1, s2), dim=-1)


def _compiling() -> bool:
    return torch.compiler.is_compiling()


_ANGLES = _LastAngles()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, heads, seq, head_size]`` by ``cos``/``sin`` ``[batch or 1, seq, head_size]``.

    Computes ``x * cos + rotate_half(x) * sin`` with one roll and the negation folded into ``sin``.
    """
    cos, sin = cos.unsqueeze(1), _ANGLES.signed(sin).unsqueeze(1)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class RotaryEmbedding(nn.Module):
    """``forward(position_ids, dtype) -> (cos, sin)``, each ``[batch, seq, head_size]``, for ``apply_rotary``.

    It holds no parameters or buffers, so meta builds need no re-initialisation, checkpoints do not hold
    it, and every pipeline stage keeps it. Angles are computed in fp32 and then cast, since positions in
    the thousands need fp32 to stay exact.
    """

    def __init__(self, head_size: int, theta: float = 10000.0, scaling: Optional[Mapping] = None):
        super().__init__()
        if head_size % 2:
            raise ValueError(f"rotary embeddings need an even head_size, got {head_size}")
        self.head_size = head_size
        self.theta = float(theta)
        self.scaling = dict(scaling) if scaling else None
        rope_inv_freq(head_size, self.theta, self.scaling)  # refuse a bad scaling at construction
        self._key = (head_size, self.theta, repr(sorted((self.scaling or {}).items())))

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, ...]:
        """``position_ids`` ``[batch, seq]`` (or ``[seq]``) -> ``(cos, sin)`` in ``dtype``."""
        compiling = _compiling()
        # Inference tensors cannot be saved for a backward: angles from inference mode stay there.
        key = (*self._key, dtype, position_ids._version, torch.is_inference_mode_enabled()) if not compiling else None
        cached = None if compiling else _ANGLES.get(position_ids, key)
        if cached is not None:
            return cached
        cos, sin = self._angles(position_ids, dtype)
        if not compiling:
            _ANGLES.put(position_ids, key, cos, sin)
        return cos, sin

    def _angles(self, position_ids: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        inv_freq = rope_inv_freq(self.head_size, self.theta, self.scaling, device=position_ids.device)
        with torch.autocast(device_type=position_ids.device.type, enabled=False):
            freqs = position_ids[..., None].float() * inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            return emb.cos().to(dtype), emb.sin().to(dtype)

    def extra_repr(self) -> str:
        scaling = f", scaling={self.scaling}" if self.scaling else ""
        return f"head_size={self.head_size}, theta={self.theta}{scaling}"
