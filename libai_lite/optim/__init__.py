"""Optimizer parameter groups, LiBai style."""
from .build import get_default_optimizer_params

__all__ = ["get_default_optimizer_params"]
