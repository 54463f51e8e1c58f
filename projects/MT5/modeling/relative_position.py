"""T5's bucketed relative position bias, a per-head additive term on the attention scores."""
import functools
import math
from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from libai_lite.layers import Embedding
from libai_lite.layers.init_methods import InitMethod


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """Map ``key_position - query_position`` to a bucket in ``[0, num_buckets)`` (Mesh TensorFlow's scheme).

    Half of the buckets (per direction when ``bidirectional``) hold exact distances
    0..max_exact-1; the rest grow logarithmically up to ``max_distance``, beyond which
    every distance shares the last bucket. A causal decoder never sees keys after the
    query, so with ``bidirectional=False`` positive offsets fold into bucket 0.
    The arithmetic follows Mesh TensorFlow op for op (float32 log, truncation by
    ``.to(long)``) so trained checkpoints see exactly the buckets they were trained with.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.long) * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # clamp(min=1) only avoids log(0) on entries that is_small selects away anyway.
    large = max_exact + (
        torch.log(distance.clamp(min=1).float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


@functools.lru_cache(maxsize=64)
def _cached_buckets(query_length, key_length, query_offset, bidirectional, num_buckets, max_distance, device):
    # Built outside inference mode: the training step's backward saves these indices.
    with torch.inference_mode(False):
        return _buckets(query_length, key_length, query_offset, bidirectional, num_buckets, max_distance, device)


def _buckets(query_length, key_length, query_offset, bidirectional, num_buckets, max_distance, device):
    query_position = torch.arange(query_offset, query_offset + query_length, dtype=torch.long, device=device)
    key_position = torch.arange(key_length, dtype=torch.long, device=device)
    relative = key_position[None, :] - query_position[:, None]
    return relative_position_bucket(relative, bidirectional, num_buckets, max_distance)


def bucket_map(query_length: int, key_length: int, query_offset: int = 0, *, bidirectional: bool = True,
               num_buckets: int = 32, max_distance: int = 128, device=None) -> torch.Tensor:
    """Bucket ``[query_length, key_length]`` of each (query, key) pair, queries at ``query_offset ..``.

    It depends on the shape only, so it is computed once per shape and device and kept (recomputed,
    cheaply, inside a compiled region, where a kept tensor would be a tracing artifact).
    """
    args = (int(query_length), int(key_length), int(query_offset), bool(bidirectional), int(num_buckets),
            int(max_distance), torch.device(device if device is not None else "cpu"))
    # Under a tracing mode (the memory planner's FakeTensorMode, a dispatch-mode counter) the result would be a
    # fake or traced tensor: keeping it would hand a FakeTensor to the first real step.
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return _buckets(*args)
    return _cached_buckets(*args)


@functools.lru_cache(maxsize=64)
def _cached_diagonals(query_length, key_length, query_offset, bidirectional, num_buckets, max_distance, device):
    with torch.inference_mode(False):
        return _diagonals(query_length, key_length, query_offset, bidirectional, num_buckets, max_distance, device)


def _diagonals(query_length, key_length, query_offset, bidirectional, num_buckets, max_distance, device):
    relative = torch.arange(query_length + key_length - 1, dtype=torch.long, device=device) - (
        query_length - 1 + query_offset)
    return relative_position_bucket(relative, bidirectional, num_buckets, max_distance)


def diagonal_buckets(query_length: int, key_length: int, query_offset: int = 0, *, bidirectional: bool = True,
                     num_buckets: int = 32, max_distance: int = 128, device=None) -> torch.Tensor:
    """Bucket ``[query_length + key_length - 1]`` of each key-minus-query diagonal, queries at ``query_offset ..``.

    T5's bias depends on ``key - query`` only, so ``bucket_map(...)[q, k]`` is
    ``diagonal_buckets(...)[k - q + query_length - 1]``: attention reads the bias of a (query, key) pair at
    that offset (``libai_lite.layers.flex_attention.relative_index``). Kept per shape, as ``bucket_map``.
    """
    args = (int(query_length), int(key_length), int(query_offset), bool(bidirectional), int(num_buckets),
            int(max_distance), torch.device(device if device is not None else "cpu"))
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return _diagonals(*args)
    return _cached_diagonals(*args)


class RelativePositionBias(Embedding):
    """The ``[num_buckets, num_heads]`` table of one T5 stack and the score bias it yields.

    It lives in the first layer of the encoder and of the decoder (as in Hugging Face);
    that layer computes ``compute_bias`` once and every later layer of the same stack
    reuses the result. Under tensor parallelism the table is split over heads
    (``parallel="col"``: weight SBP ``split(1)``, output ``split(-1)``), so each rank looks up
    the bias of its own heads, which is what ``MultiheadAttention`` expects.
    """

    def __init__(
        self,
        num_buckets: int,
        num_heads: int,
        bidirectional: bool,
        max_distance: int = 128,
        init_method: Optional[InitMethod] = None,
        layer_idx: int = 0,
        device=None,
        dtype=None,
    ):
        super().__init__(
            num_buckets, num_heads, init_method=init_method, layer_idx=layer_idx, parallel="col", device=device,
            dtype=dtype,
        )
        self.bidirectional = bidirectional
        self.max_distance = max_distance

    def compute_bias(self, query_length: int, key_length: int, query_offset: int = 0) -> torch.Tensor:
        """Score bias ``[1, heads, query_length, key_length]`` (this rank's heads under tensor parallelism).

        The queries sit at positions ``query_offset ..``: a cached decoding step has one query at
        position ``t`` against keys ``0..t``, and gets the last row of the full ``[t+1, t+1]`` bias.
        """
        buckets = self.buckets(query_length, key_length, query_offset)
        # Called through the module (not F.embedding) so a tensor-parallel plan's hooks apply.
        values = self(buckets)  # [query, key, heads]
        return values.permute(2, 0, 1).unsqueeze(0)

    def buckets(self, query_length: int, key_length: int, query_offset: int = 0) -> torch.Tensor:
        """This table's ``bucket_map`` ``[query_length, key_length]`` (kept per shape, not recomputed)."""
        return bucket_map(query_length, key_length, query_offset, bidirectional=self.bidirectional,
                          num_buckets=self.num_embeddings, max_distance=self.max_distance, device=self.weight.device)

    def diagonal_buckets(self, query_length: int, key_length: int, query_offset: int = 0) -> torch.Tensor:
        """This table's ``diagonal_buckets`` ``[query_length + key_length - 1]`` (kept per shape)."""
        return diagonal_buckets(query_length, key_length, query_offset, bidirectional=self.bidirectional,
                                num_buckets=self.num_embeddings, max_distance=self.max_distance,
                                device=self.weight.device)

    def table(self) -> torch.Tensor:
        """The table ``[num_buckets, heads]`` (this rank's heads under tensor parallelism) as attention
        reads it: ``table()[buckets(q, k)]`` (or ``table()[diagonal_buckets(q, k)]`` at ``relative_index(q, k)``)
        is ``compute_bias``'s bias, and its gradient reaches the weight."""
        ids = torch.arange(self.num_embeddings, device=self.weight.device)
        # Through the module, as compute_bias, so a tensor-parallel plan's hooks apply.
        return self(ids)

    def extra_repr(self) -> str:
        direction = "bidirectional" if self.bidirectional else "causal"
        return f"{super().extra_repr()}, {direction}, max_distance={self.max_distance}"
