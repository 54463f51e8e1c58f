"""Learning-rate schedules: linear or constant warmup, then a decay to a minimum lr."""
from .lr_scheduler import (MegatronLR, WarmupConstantLR, WarmupCosineLR, WarmupDecayLR, WarmupExponentialLR,
                           WarmupLinearLR, WarmupPolynomialLR)

__all__ = ["WarmupDecayLR", "WarmupCosineLR", "WarmupLinearLR", "WarmupPolynomialLR", "WarmupExponentialLR",
           "WarmupConstantLR", "MegatronLR"]
