"""Linear1D: an ``nn.Linear`` that declares the SBP of its weights and activations for tensor parallelism."""
import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.sbp import LayerSBP, broadcast, declare, partial_sum, shorthand, split
from .init_methods import InitMethod

# LiBai's Linear1D: the weight is [out_features, in_features], so "col" splits outputs
# (dim 0) and hands each rank a slice of the output features, and "row" splits inputs
# (dim 1) so that each rank's product is a partial sum. The row bias is whole because it is
# added once, after the partial outputs are summed.
SBP_SHORTHAND = {
    "col": declare(weight=split(0), bias=split(0), input=broadcast, output=split(-1)),
    "row": declare(weight=split(1), bias=broadcast, input=split(-1), output=partial_sum),
    "data": declare(weight=broadcast, bias=broadcast, input=broadcast, output=broadcast),
}


class Linear1D(nn.Linear):
    """``nn.Linear`` that declares its tensor-parallel SBP instead of acting on it.

    ``parallel`` is LiBai's shorthand for the declaration in ``self.sbp``:
    ``"col"`` (weight and bias ``split(0)``, input ``broadcast``, output ``split(-1)``),
    ``"row"`` (weight ``split(1)``, bias ``broadcast``, input ``split(-1)``, output
    ``partial_sum``) or ``"data"`` (everything ``broadcast``). ``split_unit`` cuts the split
    features in whole blocks (an attention head's q/k/v). The module never communicates:
    ``libai_lite.parallel.tensor_parallel`` reads ``sbp``. ``layer_idx`` tells the pipeline
    splitter which stage owns it.

    With ``skip_bias_add=True`` the forward returns ``(output_without_bias, bias)`` so a
    caller can fuse the bias into a later op, as Megatron does.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        parallel: str = "data",
        init_method: Optional[InitMethod] = None,
        skip_bias_add: bool = False,
        layer_idx: int = 0,
        split_unit: int = 1,
        device=None,
        dtype=None,
    ):
        shorthand(SBP_SHORTHAND, parallel, "Linear1D")
        # nn.Linear.__init__ calls reset_parameters(), which needs init_method already set.
        self.init_method = init_method
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.split_unit = split_unit
        self.parallel = parallel
        self.layer_idx = layer_idx
        self.skip_bias_add = skip_bias_add

    @property
    def parallel(self) -> str:
        """The shorthand ("col", "row" or "data"); assigning it re-declares ``sbp``."""
        return self._parallel

    @parallel.setter
    def parallel(self, value: str) -> None:
        self.sbp: LayerSBP = dataclasses.replace(shorthand(SBP_SHORTHAND, value, "Linear1D"), unit=self.split_unit)
        self._parallel = value

    def reset_parameters(self) -> None:
        """(Re)initialise weights; also the hook for materialising a meta-device model."""
        if self.init_method is None:
            super().reset_parameters()
            return
        self.init_method(self.weight)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x: torch.Tensor):
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        return super().forward(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parallel={self.parallel}, layer_idx={self.layer_idx}"
