"""What a Megatron-style command line asks for, in this project's terms: the record the readers fill in."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .models import MegatronModel

__all__ = ["MegatronRun"]


@dataclass
class MegatronRun:
    """What a Megatron command line asks for, in this project's terms."""

    assignments: Dict[str, Any] = field(default_factory=dict)
    scheduler: Optional[Dict[str, Any]] = None
    resume: bool = False
    no_effect: List[str] = field(default_factory=list)
    parallel_sizes: Dict[str, int] = field(default_factory=dict)
    model: Optional[MegatronModel] = None
