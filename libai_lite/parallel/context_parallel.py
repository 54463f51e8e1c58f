"""Context parallelism: each sample's sequence split over the ``cp`` ranks, attention over the whole sequence.

The sequence is cut into ``2 * cp`` chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, which
balances causal work. Attention all-gathers keys and values over the cp group and masks with global
positions. torch's ring attention is not used because it takes no mask and covers only CUDA kernels.
Only training steps run sharded; evaluation and generation see whole sequences.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..utils.errors import UsageError


def check_context_parallel_chunks(seq_length: int, cp: int, what: str = "the sequence") -> None:
    """Refuse a sequence length the load-balanced sharding cannot cut into ``2 * cp`` equal chunks."""
    if seq_length % (2 * cp):
        raise UsageError(f"{what} ({seq_length} tokens) is not divisible by 2 x train.dist.context_parallel_size "
                         f"= {2 * cp}; use a sequence length that is a multiple of {2 * cp} or a smaller "
                         f"context_parallel_size")


def shard_positions(seq_length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global positions cp rank ``rank`` holds, in its local order: chunks ``rank`` and ``2*cp-1-rank``."""
    check_context_parallel_chunks(seq_length, cp)
    chunk = seq_length // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t, op=op, group=group)
    return t


class ContextParallel:
    """The cp group of one run and what the trainer and the attention layers ask of it."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.group = mesh.get_group()
        self.enabled = False
        # One score mask per micro-batch shared by every layer, since SDPA keeps its mask for backward.
        self._masks: dict = {}

    @contextmanager
    def sharded(self):
        """Within: attention layers given this object gather keys and values over cp (training steps)."""
        previous, self.enabled = self.enabled, True
        self._masks.clear()
        try:
            yield
        finally:
            self.enabled = previous
            self._masks.clear()

    def positions(self, seq_length: int, device=None) -> torch.Tensor:
        """Global positions of this rank's part of a ``seq_length`` sequence."""
        return shard_positions(seq_length, self.size, self.rank, device)

    def shard_batch(self, batch: Mapping[str, torch.Tensor]) -> dict:
        """This rank's chunks of every ``[batch, seq, ...]`` tensor; ``position_ids`` (global) added when absent."""
        seqs = {k: v.shape[1] for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 2}
        if len(set(seqs.values())) > 1:
            raise UsageError(f"context parallelism splits every [batch, seq] tensor of a batch on one sequence, but "
                             f"they differ: {seqs}; set train.dist.context_parallel_size=1 for this data")
        if not seqs:
            raise UsageError("context parallelism found no [batch, seq] tensor in the batch to split; "
                             "set train.dist.context_parallel_size=1")
        seq_length = next(iter(seqs.values()))
        device = next(v.device for v in batch.values() if torch.is_tensor(v))
        index = self.positions(seq_length, device)
        out = {k: v.index_select(1, index) if k in seqs else v for k, v in batch.items()}
        if out.get("position_ids") is None:
            bsz = next(v.shape[0] for k, v in batch.items() if k in seqs)
            out["position_ids"] = index[None].expand(bsz, -1)
        return out

    def gather_kv(self, key: torch.Tensor, value: torch.Tensor, document_ids: torch.Tensor | None = None):
        """``(keys, values, mask)``: the whole sequence's keys and values ``[batch, heads, seq, head_size]`` in
        cp-rank order, and the additive SDPA mask of the local queries, causal on global positions and,
        with ``document_ids`` ``[batch, local_seq]``, within each document."""
        total = key.shape[-2] * self.size
        docs = None if document_ids is None else (document_ids.data_ptr(), tuple(document_ids.shape))
        cache_key = (total, key.dtype, key.device, docs)
        if cache_key not in self._masks:
            self._masks[cache_key] = self._score_mask(total, key.dtype, key.device, document_ids)
        key, value = (self._gather(t, 2) for t in (key, value))
        return key, value, self._masks[cache_key]

    def _score_mask(self, total: int, dtype, device, document_ids) -> torch.Tensor:
        q_pos = self.positions(total, device)
        k_pos = torch.cat([shard_positions(total, self.size, r, device) for r in range(self.size)])
        keep = q_pos[:, None] >= k_pos[None, :]  # every query sees itself: no empty row, no NaN
        if document_ids is not None:
            docs = DTensor.from_local(document_ids, self.mesh, [Shard(1)], run_check=False).full_tensor()
            keep = (keep & (document_ids[:, :, None] == docs[:, None, :]))[:, None]
        # Additive rather than boolean: SDPA would turn a boolean mask into a float copy per layer.
        return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, torch.finfo(dtype).min)

    def _gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        # Backward turns each rank's partial gradient of the whole sequence into its own slice (reduce-scatter).
        full = DTensor.from_local(t.contiguous(), self.mesh, [Shard(dim)], run_check=False)
        return full.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])

    def reduce_outputs(self, outputs: dict, metrics: Mapping) -> dict:
        """The outputs of one sharded forward as over the whole sequence, the same value on every cp rank.

        A loss declaring ``tokens`` becomes the token-weighted mean over ranks, with this rank's share of
        the gradient times cp because gradients are averaged over dp x cp. Other losses take their mean
        over cp; logged-only metrics reduce as they do over data-parallel ranks.
        """
        out = dict(outputs)
        for name, metric in metrics.items():
            if name not in outputs:
                continue
            value = outputs[name]
            if metric.backward and metric.tokens is not None:
                if metric.tokens not in outputs:
                    raise UsageError(f"output {name!r} declares its tokens as {metric.tokens!r}, which the model's "
                                     f"forward does not return; context parallelism needs that count")
                tokens = outputs[metric.tokens].detach().to(value.dtype)
                weighted = value * tokens
                sums = _all_reduce(torch.stack([weighted.detach(), tokens]), self.group)
                denominator = sums[1].clamp(min=torch.finfo(value.dtype).tiny)
                whole, scaled = sums[0] / denominator, weighted * self.size / denominator
            elif metric.backward:
                whole, scaled = _all_reduce(value, self.group) / self.size, value
            else:
                op = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[metric.reduce]
                reduced = _all_reduce(value.float(), self.group, op)
                out[name] = reduced / self.size if metric.reduce == "mean" else reduced
                continue
            # The value the whole sequence gives, the gradient of this rank's part.
            out[name] = scaled + (whole - scaled).detach()
        return out


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> ContextParallel:
    """Give every causal self-attention of ``model`` the run's ``ContextParallel``; returns it."""
    from ..layers.attention import MultiheadAttention

    cp = ContextParallel(cp_mesh)
    found = 0
    for module in model.modules():
        if isinstance(module, MultiheadAttention) and not module.is_cross_attention \
                and module.attn_mask_type == "causal":
            module.context_parallel = cp
            found += 1
    if not found:
        raise UsageError(f"{type(model).__name__} has no causal self-attention for context parallelism to split; "
                         f"set train.dist.context_parallel_size=1")
    return cp


def check_context_parallel(model: nn.Module, cp: int, pipeline_parallel_size: int, has_moe: bool) -> None:
    """Refuse, in one line and before any work, what context parallelism does not run with."""
    if cp == 1:
        return
    import inspect

    from ..model import is_encoder_decoder, unwrap

    name = type(unwrap(model)).__name__
    fix = "set train.dist.context_parallel_size=1"
    if is_encoder_decoder(model):
        raise UsageError(f"context parallelism splits decoder-only models' sequences; {name} is an encoder-decoder: "
                         f"{fix}")
    if pipeline_parallel_size > 1:
        raise UsageError(f"context parallelism does not run with pipeline parallelism yet; {fix} or "
                         f"train.dist.pipeline_parallel_size=1")
    if has_moe:
        raise UsageError(f"context parallelism does not run with MoE layers yet; {fix}")
    if "position_ids" not in inspect.signature(unwrap(model).forward).parameters:
        raise UsageError(f"context parallelism gives each rank global position_ids, but {name}.forward takes no "
                         f"position_ids; {fix}")
