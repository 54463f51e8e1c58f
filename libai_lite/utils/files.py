"""Files that are either whole or absent: write to a unique temporary beside the target, then rename."""
from __future__ import annotations

import os
import uuid
from typing import Callable


def atomic_write(path: str, write: Callable, mode: str = "wb", fsync: bool = True) -> None:
    """Call ``write(f)`` on a uniquely named temporary file beside ``path`` and rename it over ``path``.

    Readers see the old file or the new one, never a part, and concurrent writers do not clobber each other.
    A failure removes the temporary and leaves the previous file. ``fsync`` makes the content durable before
    the rename, for files a crash must not leave empty.
    """
    tmp = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            write(f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
