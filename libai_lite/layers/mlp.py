"""Transformer feed-forward block: column-parallel up projection, row-parallel down projection.

A gated MLP computes gate and up projections as one GEMM. ``dense_h_to_4h`` holds both with rows
interleaved, row ``2i`` gate feature ``i`` and row ``2i + 1`` up feature ``i``, so a contiguous column
split gives every rank matching pairs and checkpoints hold one layout whatever the tensor-parallel size.
``join_gate_up`` and ``split_gate_up`` convert to and from separate weights.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..sbp import broadcast, declare, hidden
from .init_methods import InitMethod
from .linear import Linear1D

_ACTIVATIONS = {
    "gelu": F.gelu,
    # GPT-2's and T5 v1.1's "gelu_new".
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def join_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Separate gate and up weights (or biases) ``[ffn, ...]`` -> the gated MLP's interleaved ``[2 * ffn, ...]``."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {list(gate.shape)} and up {list(up.shape)} projections differ in shape")
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def split_gate_up(fused: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated MLP's interleaved ``[2 * ffn, ...]`` weight (or bias) -> ``(gate, up)``, each ``[ffn, ...]``."""
    pairs = fused.reshape(fused.shape[0] // 2, 2, *fused.shape[1:])
    return pairs[:, 0], pairs[:, 1]


def activate(intermediate: torch.Tensor, activation: str, gated: bool) -> torch.Tensor:
    """The MLP's activation on its first projection's output: ``act(gate) * up`` of the interleaved pairs when
    ``gated``, else ``act(intermediate)``."""
    if gated:
        gate, up = intermediate.unflatten(-1, (-1, 2)).unbind(-1)
        return _ACTIVATIONS[activation](gate) * up
    return _ACTIVATIONS[activation](intermediate)


class GateUpLinear(Linear1D):
    """A column-parallel ``Linear1D`` of ``2 * ffn`` outputs, gate and up rows interleaved; split in whole pairs.

    Initialised as two ``ffn``-row linears would be (gate, then up, each with the same initialiser), so a
    model draws the same weights as with separate projections.
    """

    def __init__(self, in_features: int, ffn_features: int, bias: bool = True,
                 init_method: Optional[InitMethod] = None, layer_idx: int = 0):
        super().__init__(in_features, 2 * ffn_features, bias=bias, parallel="col", init_method=init_method,
                         layer_idx=layer_idx, split_unit=2, split_counts="ffn_hidden_size")

    def reset_parameters(self) -> None:
        """Draw the gate, then the up projection, as separate ``[ffn, in]`` linears, and interleave them."""
        ffn = self.out_features // 2
        halves = []
        for _ in range(2):
            half = Linear1D(self.in_features, ffn, bias=self.bias is not None, init_method=self.init_method,
                            device=self.weight.device, dtype=self.weight.dtype)
            halves.append(half)
        with torch.no_grad():
            self.weight.copy_(join_gate_up(halves[0].weight, halves[1].weight))
            if self.bias is not None:
                self.bias.copy_(join_gate_up(halves[0].bias, halves[1].bias))


class MLP(nn.Module):
    """``dense_4h_to_h(act(dense_h_to_4h(x)))`` followed by dropout, column- then row-parallel so the
    activation needs no communication. ``gated=True`` computes ``act(gate) * up`` with a ``GateUpLinear``.
    """

    sbp = declare(input=broadcast, output=hidden, args=("hidden_states",))

    def __init__(self, hidden_size: int, ffn_hidden_size: int, output_dropout_prob: float = 0.0,
                 init_method: Optional[InitMethod] = None, output_layer_init_method: Optional[InitMethod] = None,
                 bias: bool = True, activation: str = "gelu", gated: bool = False, layer_idx: int = 0):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        self.gated = bool(gated)
        self.layer_idx = layer_idx
        if gated:
            self.dense_h_to_4h = GateUpLinear(hidden_size, ffn_hidden_size, bias=bias, init_method=init_method,
                                              layer_idx=layer_idx)
        else:
            self.dense_h_to_4h = Linear1D(hidden_size, ffn_hidden_size, bias=bias, parallel="col",
                                          init_method=init_method, layer_idx=layer_idx, split_counts="ffn_hidden_size")
        self.dense_4h_to_h = Linear1D(ffn_hidden_size, hidden_size, bias=bias, parallel="row",
                                      init_method=output_layer_init_method or init_method, layer_idx=layer_idx,
                                      split_counts="ffn_hidden_size")
        self.dropout = nn.Dropout(output_dropout_prob)
        # Checkpoints written before gate and up were one weight hold them apart.
        self.register_load_state_dict_pre_hook(_join_legacy_gate_up)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        intermediate = activate(self.dense_h_to_4h(hidden_states), self.activation, self.gated)
        return self.dropout(self.dense_4h_to_h(intermediate))

    def extra_repr(self) -> str:
        gated = ", gated" if self.gated else ""
        return f"activation={self.activation}{gated}, layer_idx={self.layer_idx}"


# The second projection's name in checkpoints written before the gated MLP fused it into dense_h_to_4h.
LEGACY_UP = "dense_h_to_4h_linear"


def _join_legacy_gate_up(module, state_dict, prefix, *args) -> None:
    """``load_state_dict`` pre-hook: an old state dict's separate ``dense_h_to_4h`` (gate) and
    ``dense_h_to_4h_linear`` (up) become the fused interleaved ``dense_h_to_4h``."""
    if not module.gated:
        return
    for kind in ("weight", "bias"):
        up_key = f"{prefix}{LEGACY_UP}.{kind}"
        if up_key in state_dict:
            gate_key = f"{prefix}dense_h_to_4h.{kind}"
            state_dict[gate_key] = join_gate_up(state_dict[gate_key], state_dict.pop(up_key))
