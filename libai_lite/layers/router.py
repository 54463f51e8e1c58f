"""The mixture-of-experts router: fp32 logits, top-k choice with capacity (softmax or DeepSeek-V3's sigmoid
scores steered by a bias) and the Switch/GShard load-balancing loss."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .init_methods import InitMethod
from .linear import Linear1D


class Routing(NamedTuple):
    """What the router decided for ``T`` tokens (``k`` = top_k, ``E`` = num_experts)."""

    expert_index: torch.Tensor  # [T, k] long: the chosen experts, best first
    gates: torch.Tensor  # [T, k] fp32: the weight of each chosen expert's output
    keep: torch.Tensor  # [T, k] bool: False where the assignment exceeded its expert's capacity
    probs: torch.Tensor  # [T, E] fp32 router probabilities
    load: torch.Tensor  # [E] long: assignments per expert before capacity
    capacity: int  # assignments each expert accepts (T * k when unlimited)
    position: torch.Tensor  # [T, k] long: each assignment's place in its expert's queue


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: Optional[float]) -> int:
    """Assignments one expert accepts from ``num_tokens`` tokens: ``ceil(cf * T * k / E)``, or all with cf None."""
    if capacity_factor is None:
        return num_tokens * top_k
    return max(int(math.ceil(float(capacity_factor) * num_tokens * top_k / num_experts)), 1)


def route(logits: torch.Tensor, top_k: int, capacity_factor: Optional[float], router: str = "softmax",
          bias: Optional[torch.Tensor] = None) -> Routing:
    """Top-k routing with capacity from router ``logits`` ``[T, E]``; GShard's priority: every token's
    first choice before any second choice, and within one choice, tokens in order.

    ``router="sigmoid_bias"`` (DeepSeek-V3): scores ``sigmoid(logits)``, the top k of ``scores + bias``
    chosen (``bias`` ``[E]`` steers the choice only: no gradient, no share in the gates), gated by their
    scores (renormalised over the k for k > 1); ``probs`` are the scores normalised per token."""
    num_tokens, num_experts = logits.shape
    if router == "sigmoid_bias":
        scores = torch.sigmoid(logits.float())
        choice = scores.detach() if bias is None else scores.detach() + bias.detach().float()
        expert_index = choice.topk(top_k, dim=-1).indices
        top_probs = scores.gather(1, expert_index)
        probs = scores / scores.sum(dim=-1, keepdim=True)
    else:
        probs = torch.softmax(logits.float(), dim=-1)
        top_probs, expert_index = probs.topk(top_k, dim=-1)
    gates = top_probs if top_k == 1 else top_probs / top_probs.sum(dim=-1, keepdim=True)
    capacity = expert_capacity(num_tokens, num_experts, top_k, capacity_factor)
    # Position of each assignment in its expert's queue, in priority order (choice-major).
    by_priority = expert_index.t().reshape(-1)
    # Counted on the device (bincount sizes its output by the data: a host read on a GPU).
    load = torch.zeros(num_experts, dtype=torch.long, device=logits.device).index_add_(
        0, by_priority, torch.ones_like(by_priority))
    order = torch.argsort(by_priority, stable=True)
    starts = torch.cumsum(load, 0) - load
    position = torch.empty_like(by_priority)
    position[order] = torch.arange(by_priority.numel(), device=logits.device) - starts[by_priority[order]]
    position = position.view(top_k, num_tokens).t()
    return Routing(expert_index, gates, position < capacity, probs, load, capacity, position)


def load_balancing_loss(probs: torch.Tensor, load: torch.Tensor) -> torch.Tensor:
    """Switch/GShard auxiliary loss ``E * sum_e f_e * P_e`` from router ``probs`` ``[T, E]`` and ``load``
    ``[E]`` (assignments per expert: the gradient flows through the mean probabilities only)."""
    num_experts = probs.shape[-1]
    fraction = load.to(probs.dtype) / load.sum().clamp(min=1)
    return num_experts * torch.sum(fraction * probs.mean(dim=0))


class Router(Linear1D):
    """``hidden -> num_experts`` logits, replicated under tensor parallelism; in fp32 whatever the
    autocast, since routing decisions are discrete (Switch's selective precision)."""

    def __init__(self, hidden_size: int, num_experts: int, init_method: Optional[InitMethod] = None,
                 jitter_noise: float = 0.0, layer_idx: int = 0):
        super().__init__(hidden_size, num_experts, bias=False, parallel="data", init_method=init_method,
                         layer_idx=layer_idx)
        self.jitter_noise = float(jitter_noise)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.training and self.jitter_noise > 0:
            noise = torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            x = x * noise
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x, self.weight.float())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, jitter_noise={self.jitter_noise}"
