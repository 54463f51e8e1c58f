"""The warnings LiBai's names give when built: once per process, as a model is built twice (on meta, then for real)."""
import logging

__all__ = ["warn_once"]

logger = logging.getLogger("libai_lite")
_warned: set = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time it is given in this process."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
