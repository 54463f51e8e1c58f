"""Distributed checkpoints (DCP) that are complete or absent: the directory protocol (``protocol``), integrity
(``integrity``), DCP I/O (``dcp_io``), the trainer's state (``trainer_state``), composed by ``Checkpointer``."""
from .checkpointer import Checkpointer
from .protocol import checkpoint_to_resume, is_complete

__all__ = ["Checkpointer", "checkpoint_to_resume", "is_complete"]
