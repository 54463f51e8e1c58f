"""Logging: console on rank 0's stdout, `log.txt` per rank once the output directory exists.

Records emitted before then are buffered and flushed into `log.txt` by `attach_log_file`, so a
run refused for bad input writes nothing to disk, and a run that starts keeps its setup lines.
"""
from __future__ import annotations

import logging
import logging.handlers
import os
import sys

_FORMAT = logging.Formatter("[%(asctime)s %(name)s]: %(message)s", datefmt="%m/%d %H:%M:%S")
_buffer: logging.handlers.MemoryHandler | None = None


def _reraise_signal_errors() -> None:
    """Raise again an error a signal handler raised inside a handler's write: torch's SIGCHLD handler reports a
    dead DataLoader worker wherever the process is, and that is the run's error, not a failed log line."""
    exc = sys.exc_info()[1]
    if isinstance(exc, RuntimeError) and str(exc).startswith("DataLoader worker"):
        raise exc


class _Console(logging.StreamHandler):
    """A console that writes to whatever sys.stdout is at each record: a stream captured or replaced
    since setup (a redirect, a test's capture, later closed) never turns records into 'Logging error'."""

    def __init__(self):
        super().__init__()

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):
        pass

    def handleError(self, record):
        _reraise_signal_errors()
        super().handleError(record)


def setup_logger(rank: int = 0) -> logging.Logger:
    """The `libai_lite` logger: console on rank 0, plus an in-memory buffer for log.txt."""
    global _buffer
    logger = logging.getLogger("libai_lite")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    if rank == 0:
        console = _Console()
        console.setFormatter(_FORMAT)
        logger.addHandler(console)
    # flushLevel above CRITICAL: nothing leaves the buffer until a file target is attached.
    _buffer = logging.handlers.MemoryHandler(capacity=100000, flushLevel=logging.CRITICAL + 1, target=None)
    logger.addHandler(_buffer)
    return logger


class _LogFile(logging.FileHandler):
    """log.txt that stops writing at its first failed write (a full disk) instead of printing a
    traceback for every record; ``log_file_error`` then holds the error for the trainer to stop on."""

    error = None
    broken = False

    def emit(self, record):
        if not self.broken:
            super().emit(record)

    def handleError(self, record):
        _reraise_signal_errors()
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            return super().handleError(record)
        from .errors import write_error

        self.broken = True
        if _LogFile.error is None:
            _LogFile.error = write_error(self.baseFilename, exc)

    def close(self):
        try:
            super().close()
        except OSError:  # the buffered tail of a full disk's log
            pass


def log_file_error():
    """The UsageError of a failed log.txt write, or None."""
    return _LogFile.error


def attach_log_file(output_dir: str, rank: int = 0) -> str:
    """Start writing `log.txt` (rank 0) or `log.txt.rank{r}` and flush everything logged so far into it."""
    global _buffer
    logger = logging.getLogger("libai_lite")
    path = os.path.join(output_dir, "log.txt" if rank == 0 else f"log.txt.rank{rank}")
    fh = _LogFile(path, mode="a")
    fh.setFormatter(_FORMAT)
    if _buffer is not None:
        _buffer.setTarget(fh)
        _buffer.flush()
        logger.removeHandler(_buffer)
        _buffer.close()
        _buffer = None
    logger.addHandler(fh)
    return path
