"""Plugins that installed packages declare under an entry-point group, so the core can use them without naming them.

``libai_lite.config_dialects`` (config files of other frameworks, ``config/dialects.py``) and
``libai_lite.checkpoint_formats`` (checkpoints of other frameworks, ``checkpoint/integrity.py``) are read here.
"""
from __future__ import annotations

import functools
from importlib.metadata import entry_points

__all__ = ["plugins"]


@functools.lru_cache(maxsize=None)
def plugins(group: str) -> tuple:
    """The loaded objects of every entry point of ``group``, in the order the installed metadata lists them."""
    return tuple(entry.load() for entry in entry_points(group=group))
