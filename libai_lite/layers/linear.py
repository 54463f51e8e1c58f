"""Linear1D: an ``nn.Linear`` that declares the SBP of its weights and activations for tensor parallelism."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..sbp import Shorthand, broadcast, declare, hidden, partial_sum, split
from .init_methods import InitMethod

# "col" splits output features and "row" input features, giving partial sums; the row bias is whole
# because it is added once after the sum. "vocab" is a column split fed by the residual stream, an LM head.
SBP_SHORTHAND = {
    "col": declare(weight=split(0), bias=split(0), input=broadcast, output=split(-1)),
    "row": declare(weight=split(1), bias=broadcast, input=split(-1), output=partial_sum),
    "vocab": declare(weight=split(0), bias=split(0), input=hidden, output=split(-1), counts="vocab_size"),
    "data": declare(weight=broadcast, bias=broadcast, input=broadcast, output=broadcast),
}


class Linear1D(Shorthand, nn.Linear):
    """``nn.Linear`` that declares its tensor-parallel SBP (``self.sbp``) instead of acting on it.

    ``parallel`` is a key of ``SBP_SHORTHAND``. ``split_unit`` cuts the split features in whole blocks and
    ``split_counts`` names the constructor size they count. ``layer_idx`` places it on a pipeline stage.
    With ``skip_bias_add=True`` the forward returns ``(output_without_bias, bias)`` for a later fusion.
    """

    SBP_SHORTHAND = SBP_SHORTHAND

    def __init__(self, in_features: int, out_features: int, bias: bool = True, parallel: str = "data",
                 init_method: Optional[InitMethod] = None, skip_bias_add: bool = False, layer_idx: int = 0,
                 split_unit: int = 1, split_counts: Optional[str] = None, device=None, dtype=None):
        self.split_unit, self.split_counts = split_unit, split_counts
        self.parallel = parallel
        # nn.Linear.__init__ calls reset_parameters(), which needs init_method already set.
        self.init_method = init_method
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.layer_idx = layer_idx
        self.skip_bias_add = skip_bias_add

    def reset_parameters(self) -> None:
        """(Re)initialise weights; also the hook for materialising a meta-device model."""
        if self.init_method is None:
            return super().reset_parameters()
        self.init_method(self.weight)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x: torch.Tensor):
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        return super().forward(x)
