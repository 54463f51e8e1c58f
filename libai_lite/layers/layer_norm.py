"""Normalisation layers, replicated under tensor parallelism (parameters ``broadcast``). They act on each
position alone, so they take and give hidden states in whatever layout those have (SBP ``hidden``)."""
import torch
from torch import nn

from ..parallel.sbp import broadcast, declare, hidden

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
    """T5-style RMS norm: scale only, no mean subtraction, no bias.

    The variance is computed in fp32 whatever the input dtype, because squaring
    half-precision activations overflows; the result is cast back to the weight's
    dtype when that is half precision, matching Hugging Face's ``T5LayerNorm``.
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
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, layer_idx={self.layer_idx}"
