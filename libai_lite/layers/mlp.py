"""Transformer feed-forward block: column-parallel up projection, row-parallel down projection."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.sbp import broadcast, declare, hidden
from .init_methods import InitMethod
from .linear import Linear1D

_ACTIVATIONS = {
    "gelu": F.gelu,
    # GPT-2's and T5 v1.1's "gelu_new".
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


class MLP(nn.Module):
    """``dense_4h_to_h(act(dense_h_to_4h(x)))`` followed by dropout; column- then row-parallel, so the
    activation runs on each rank's slice with no communication in between. ``gated=True`` (T5 v1.1,
    mT5) multiplies in a second column-parallel ``dense_h_to_4h_linear(x)``. The block needs
    ``hidden_states`` whole (``broadcast``) and gives hidden states.
    """

    sbp = declare(input=broadcast, output=hidden, args=("hidden_states",))

    def __init__(self, hidden_size: int, ffn_hidden_size: int, output_dropout_prob: float = 0.0,
                 init_method: Optional[InitMethod] = None, output_layer_init_method: Optional[InitMethod] = None,
                 bias: bool = True, activation: str = "gelu", gated: bool = False, layer_idx: int = 0):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        self.layer_idx = layer_idx

        def linear(n_in, n_out, parallel, init):
            return Linear1D(n_in, n_out, bias=bias, parallel=parallel, init_method=init, layer_idx=layer_idx,
                            split_counts="ffn_hidden_size")

        self.dense_h_to_4h = linear(hidden_size, ffn_hidden_size, "col", init_method)
        self.dense_h_to_4h_linear = linear(hidden_size, ffn_hidden_size, "col", init_method) if gated else None
        self.dense_4h_to_h = linear(ffn_hidden_size, hidden_size, "row", output_layer_init_method or init_method)
        self.dropout = nn.Dropout(output_dropout_prob)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        intermediate = _ACTIVATIONS[self.activation](self.dense_h_to_4h(hidden_states))
        if self.dense_h_to_4h_linear is not None:
            intermediate = intermediate * self.dense_h_to_4h_linear(hidden_states)
        return self.dropout(self.dense_4h_to_h(intermediate))

    def extra_repr(self) -> str:
        gated = ", gated" if self.dense_h_to_4h_linear is not None else ""
        return f"activation={self.activation}{gated}, layer_idx={self.layer_idx}"
