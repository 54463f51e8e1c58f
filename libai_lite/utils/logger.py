"""Logging: console on every rank's stdout (rank 0 by default), `log.txt` per rank once the output dir exists.

Records emitted before the output directory is created are buffered and flushed into `log.txt`
when `attach_log_file` runs, so a run refused for bad input writes nothing to disk, and a run
that starts keeps its setup lines in the log.
"""
from __future__ import annotations

import logging
import logging.handlers
import os
import sys

_FORMAT = "[%(asctime)s %(name)s]: %(message)s"
_DATEFMT = "%m/%d %H:%M:%S"
_buffer: logging.handlers.MemoryHandler | None = None


def setup_logger(rank: int = 0, name: str = "libai_lite", verbose_all_ranks: bool = False) -> logging.Logger:
    """Console logging (rank 0, or all ranks with `verbose_all_ranks`) plus an in-memory buffer for log.txt."""
    global _buffer
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    if rank == 0 or verbose_all_ranks:
        console = logging.StreamHandler(sys.stdout)
        prefix = "" if rank == 0 else f"[rank {rank}] "
        console.setFormatter(logging.Formatter(prefix + _FORMAT, datefmt=_DATEFMT))
        logger.addHandler(console)
    # flushLevel above CRITICAL: nothing leaves the buffer until a file target is attached.
    _buffer = logging.handlers.MemoryHandler(capacity=100000, flushLevel=logging.CRITICAL + 1, target=None)
    _buffer.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATEFMT))
    logger.addHandler(_buffer)
    return logger


def attach_log_file(output_dir: str, rank: int = 0, name: str = "libai_lite") -> str:
    """Start writing `log.txt` (rank 0) or `log.txt.rank{r}` and flush everything logged so far into it."""
    global _buffer
    logger = logging.getLogger(name)
    path = os.path.join(output_dir, "log.txt" if rank == 0 else f"log.txt.rank{rank}")
    fh = logging.FileHandler(path, mode="a")
    fh.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATEFMT))
    if _buffer is not None:
        _buffer.setTarget(fh)
        _buffer.flush()
        logger.removeHandler(_buffer)
        _buffer.close()
        _buffer = None
    logger.addHandler(fh)
    return path
