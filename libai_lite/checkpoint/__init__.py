"""Distributed checkpoints (DCP) that are complete or absent."""
from .checkpointer import Checkpointer, is_complete, resolve_resume

__all__ = ["Checkpointer", "is_complete", "resolve_resume"]
