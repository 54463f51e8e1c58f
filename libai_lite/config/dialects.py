"""Config files written for another framework, loaded unchanged through installed plugins.

A package declares a dialect under the ``libai_lite.config_dialects`` entry-point group: a callable that
makes one :class:`ConfigDialect` per config load. While the file runs, the imports a dialect ``handles``
are answered by its ``load``; afterwards a dialect that was ``seen`` translates the namespace into this
project's meaning. The core names no framework itself.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Protocol, Sequence

from ..utils.plugins import plugins

__all__ = ["DIALECTS_GROUP", "ConfigDialect", "new_dialects"]

DIALECTS_GROUP = "libai_lite.config_dialects"


class ConfigDialect(Protocol):
    """What the config loader asks of a dialect during one load."""

    seen: bool  # whether the file imported one of its modules, i.e. is written in the dialect

    def handles(self, name: str) -> bool:
        """Whether an absolute import of ``name`` in a config file is answered by the dialect."""

    def load(self, name: str, fromlist: Optional[Sequence[str]]) -> Any:
        """The module (or, for ``import a.b``, the top of a chain reaching it) that import statement gets."""

    def code_error(self, name: str, fromlist: Optional[Sequence[str]], importer: Path,
                   missing: str) -> Optional[ImportError]:
        """The refusal of the dialect's own code that a config imports and that failed to import module
        ``missing``, or None when that failure is not the dialect's."""

    def translate(self, namespace: dict) -> Any:
        """Rewrite the loaded namespace's keys whose meaning differs here (in place)."""


def new_dialects() -> List[ConfigDialect]:
    """A fresh dialect of every installed plugin, for one config load."""
    return [make() for make in plugins(DIALECTS_GROUP)]
