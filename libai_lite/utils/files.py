"""Files that are either whole or absent: write to a unique temporary beside the target, then rename."""
from __future__ import annotations

import os
import uuid
from typing import Callable


def atomic_write(path: str, write: Callable, mode: str = "wb", fsync: bool = True) -> None:
    """Call ``write(f)`` on a temporary file beside ``path`` and rename it over ``path``.

    Readers see the old file or the new one, never a part; the temporary's name is unique, so two
    processes writing the same path do not clobber each other's half-written file; a failure (a full
    disk) removes the temporary and leaves the previous file as it was. ``fsync`` makes the content
    durable before the rename, for files a crash must not leave empty (caches, checkpoint markers).
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
