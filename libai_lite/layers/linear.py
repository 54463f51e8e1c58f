"""Linear1D: an ``nn.Linear`` that records how it should be split for tensor parallelism."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .init_methods import InitMethod

# SBP of the weight ([out_features, in_features]) for each kind of parallelism.
_WEIGHT_SBP = {"data": "broadcast", "col": "split(0)", "row": "split(1)"}


class Linear1D(nn.Linear):
    """``nn.Linear`` that declares its tensor-parallel intent instead of acting on it.

    ``parallel="col"`` splits output features across tensor-parallel ranks (weight SBP
    ``split(0)``, bias ``split(0)``), ``"row"`` splits input features (weight ``split(1)``,
    bias ``broadcast``, output ``partial_sum`` until reduced), ``"data"`` replicates.
    The module itself never communicates: the parallel step reads ``self.parallel``
    and applies ``ColwiseParallel``/``RowwiseParallel``, which act on ``nn.Linear``
    subclasses directly. ``layer_idx`` tells the pipeline splitter which stage owns it.

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
        device=None,
        dtype=None,
    ):
        if parallel not in _WEIGHT_SBP:
            raise ValueError(f"Linear1D parallel must be one of {sorted(_WEIGHT_SBP)}, got {parallel!r}")
        # nn.Linear.__init__ calls reset_parameters(), which needs init_method already set.
        self.init_method = init_method
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.parallel = parallel
        self.layer_idx = layer_idx
        self.skip_bias_add = skip_bias_add

    def reset_parameters(self) -> None:
        """(Re)initialise weights; also the hook for materialising a meta-device model."""
        if self.init_method is None:
            super().reset_parameters()
            return
        self.init_method(self.weight)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    @property
    def weight_sbp(self) -> str:
        """The LiBai SBP name of the weight's placement along the tensor-parallel mesh dim."""
        return _WEIGHT_SBP[self.parallel]

    def forward(self, x: torch.Tensor):
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        return super().forward(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parallel={self.parallel}, layer_idx={self.layer_idx}"
