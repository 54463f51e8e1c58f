"""Optimizer parameter groups, LiBai style, and Muon beside AdamW."""
from .build import build_optimizer, get_default_optimizer_params
from .muon import MuonAdamW

__all__ = ["MuonAdamW", "build_optimizer", "get_default_optimizer_params"]
