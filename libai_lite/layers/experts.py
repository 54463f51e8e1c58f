"""A mixture-of-experts layer's experts: each an ``MLP`` on its rows, run one by one or, on CUDA in bf16, as two
grouped GEMMs (``torch._grouped_mm``) behind a ``FastPath`` whose plain path is the per-expert loop."""
from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..utils.fallback import FastPath
from .mlp import activate


class Experts(nn.ModuleDict):
    """This rank's experts, keyed by global expert index; ``forward`` runs each on its slice of tokens.

    A module with a forward of its own, so FSDP can shard the experts as one group and gather them
    around this call. Every expert runs even on zero tokens: data-parallel gradient reduction
    expects a gradient for each. With ``grouped_gemm`` on CUDA in bf16 the experts run as two grouped
    GEMMs (``GROUPED_EXPERTS``) on their weights stacked at call time; the parameters stay per expert.
    """

    grouped_gemm = False

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list[int] | int) -> torch.Tensor:
        """``tokens`` sorted by local expert, ``tokens_per_expert[i]`` rows for the i-th local expert (an int:
        as many for each)."""
        # No rows (an expert-parallel rank sent nothing) is left to the loop: a kernel failing there is no reason to
        # give the grouped path up for every later call.
        if (self.grouped_gemm and tokens.shape[0] and not GROUPED_EXPERTS.fell_back
                and _grouped_eligible(self, tokens)):
            return self._grouped(tokens, tokens_per_expert)
        pieces = tokens.split(tokens_per_expert, dim=0)
        return torch.cat([expert(piece) for expert, piece in zip(self.values(), pieces)], dim=0)

    def _grouped(self, tokens: torch.Tensor, tokens_per_expert: list[int] | int) -> torch.Tensor:
        sizes = [tokens_per_expert] * len(self) if isinstance(tokens_per_expert, int) else list(tokens_per_expert)
        # The sizes are on the host already (the split needs them); one small copy gives the kernel its offsets.
        offsets = torch.tensor(list(itertools.accumulate(sizes)), dtype=torch.int32).to(tokens.device,
                                                                                          non_blocking=True)
        first = next(iter(self.values()))
        out = GROUPED_EXPERTS(tokens, offsets, *expert_weights(self), activation=first.activation,
                              gated=first.gated)
        return first.dropout(out)

    def run_fixed(self, slots: torch.Tensor, capacity: int) -> torch.Tensor:
        """Every expert on its ``capacity`` rows of ``slots`` (``[experts * capacity, hidden]``), through
        ``forward`` so that FSDP's hooks on this module gather the experts around it."""
        return self(slots, capacity)


def expert_weights(experts: Experts) -> list:
    """``[w1, b1, w2, b2]`` of every expert in order (a bias None where the MLP has none)."""
    out = []
    for e in experts.values():
        out += [e.dense_h_to_4h.weight, e.dense_h_to_4h.bias, e.dense_4h_to_h.weight, e.dense_4h_to_h.bias]
    return out


def _grouped_eligible(experts: Experts, tokens: torch.Tensor) -> bool:
    """CUDA, bf16 compute, plain tensors (no DTensor: tensor parallelism keeps the loop) and a torch with
    ``_grouped_mm``."""
    if not tokens.is_cuda or not hasattr(torch, "_grouped_mm"):
        return False
    if _compute_dtype(tokens) != torch.bfloat16:
        return False
    from torch.distributed.tensor import DTensor

    return not any(isinstance(w, DTensor) for w in expert_weights(experts))


def _compute_dtype(tokens: torch.Tensor) -> torch.dtype:
    device = tokens.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else tokens.dtype


def _stacked_bias(biases: tuple, rows: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if biases[0] is None else torch.stack(biases).to(dtype).index_select(0, rows)


def grouped_experts(tokens: torch.Tensor, offsets: torch.Tensor, *weights: Optional[torch.Tensor],
                    activation: str, gated: bool) -> torch.Tensor:
    """The experts' MLPs (without dropout) on ``tokens`` grouped by expert, ``offsets`` ``[E]`` int32 the
    cumulative row counts, as two ``torch._grouped_mm`` on the ``expert_weights`` stacked here (a copy of
    the experts' weights, kept for backward). Computes in bf16 (the autocast dtype)."""
    dtype = _compute_dtype(tokens)
    w1, b1, w2, b2 = (weights[i::4] for i in range(4))
    x = tokens.to(dtype)
    rows = None
    if b1[0] is not None or b2[0] is not None:
        # Each row's expert, for the biases: offsets are row ends, so searchsorted(right) counts ends <= row.
        rows = torch.searchsorted(offsets, torch.arange(x.shape[0], device=x.device, dtype=torch.int32), right=True)
        rows = rows.clamp(max=len(w1) - 1)
    h = torch._grouped_mm(x, torch.stack(w1).to(dtype).transpose(-2, -1), offs=offsets)
    bias = _stacked_bias(b1, rows, dtype)
    h = activate(h if bias is None else h + bias, activation, gated)
    out = torch._grouped_mm(h, torch.stack(w2).to(dtype).transpose(-2, -1), offs=offsets)
    bias = _stacked_bias(b2, rows, dtype)
    return out if bias is None else out + bias


def looped_experts(tokens: torch.Tensor, offsets: torch.Tensor, *weights: Optional[torch.Tensor],
                   activation: str, gated: bool) -> torch.Tensor:
    """``grouped_experts``' plain path: each expert's MLP on its rows, one after another."""
    ends = offsets.tolist()
    sizes = [b - a for a, b in zip([0] + ends[:-1], ends)]
    pieces = tokens.split(sizes, dim=0)
    outs = []
    for i, piece in enumerate(pieces):
        w1, b1, w2, b2 = weights[4 * i:4 * i + 4]
        outs.append(F.linear(activate(F.linear(piece, w1, b1), activation, gated), w2, b2))
    return torch.cat(outs, dim=0)


def _grouped_signature(tokens, offsets, *weights, activation, gated):
    # Keyed by shapes, not by the token counts (they change every step): one probe per layer shape.
    return (torch.is_grad_enabled(), tokens.dtype, tokens.shape[-1], tokens.requires_grad,
            _compute_dtype(tokens), len(weights), tuple(None if w is None else tuple(w.shape) for w in weights[:4]),
            any(w is not None and w.requires_grad for w in weights), activation, gated)


# The experts' grouped GEMMs, checked against the loop forward and backward at first use.
GROUPED_EXPERTS = FastPath("MoE grouped GEMM (torch._grouped_mm)", grouped_experts, looped_experts,
                           signature=_grouped_signature, compare=True, plain_name="the per-expert loop")
