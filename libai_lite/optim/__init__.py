"""Optimizer parameter groups, LiBai style."""
from .build import build_optimizer, get_default_optimizer_params

__all__ = ["build_optimizer", "get_default_optimizer_params"]
