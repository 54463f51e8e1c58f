"""Normalisation layers, replicated under tensor parallelism (parameters ``broadcast``). They act on each
position alone, so they take and give hidden states in whatever layout those have (SBP ``hidden``)."""
import torch
import torch.nn.functional as F
from torch import nn

from ..sbp import broadcast, declare, hidden

_NORM_SBP = declare(weight=broadcast, bias=broadcast, input=hidden, output=hidden)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that carries ``layer_idx`` for pipeline placement."""

    parallel = "data"
    sbp = _NORM_SBP

    def __init__(self, normalized_shape, eps: float = 1e-5, bias: bool = True, layer_idx: int = 0, device=None,
                 dtype=None):
        super().__init__(normalized_shape, eps=eps, bias=bias, device=device, dtype=dtype)
        self.layer_idx = layer_idx


class RMSLayerNorm(nn.Module):
    """T5-style RMS norm: scale only, no mean subtraction, no bias; ``F.rms_norm`` underneath.

    Computed in the wider of the input's and the weight's dtypes (``F.rms_norm`` squares half-precision
    inputs in fp32, where they would overflow). The result is in the weight's dtype
    when that is half precision, else in fp32, as Hugging Face's ``T5LayerNorm`` gives it.
    """

    parallel = "data"
    sbp = _NORM_SBP

    def __init__(self, hidden_size: int, eps: float = 1e-6, layer_idx: int = 0, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.layer_idx = layer_idx

    def reset_parameters(self) -> None:
        """Reset the scale to ones."""
        nn.init.ones_(self.weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if hidden_states.dtype != weight.dtype:
            # bf16 activations with fp32 weights (or the reverse): in the wider dtype, as T5 does.
            dtype = torch.promote_types(hidden_states.dtype, weight.dtype)
            hidden_states, weight = hidden_states.to(dtype), weight.to(dtype)
        out = F.rms_norm(hidden_states, weight.shape, weight, self.eps)
        return out.to(self.weight.dtype) if self.weight.dtype in (torch.float16, torch.bfloat16) else out

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, layer_idx={self.layer_idx}"
