"""Weight initialisers in Megatron's style: a factory returns a function that fills a tensor in place."""
import functools
import math
from typing import Callable

import torch
from torch import nn

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def init_method_normal(std: float) -> InitMethod:
    """Return an initialiser drawing from N(0, std**2)."""
    return functools.partial(nn.init.normal_, mean=0.0, std=std)


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """Return N(0, (std / sqrt(2 * num_layers))**2), Megatron's init for projections that feed a residual:
    each layer adds two to the residual stream, so shrinking them keeps its variance from growing with depth."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))
