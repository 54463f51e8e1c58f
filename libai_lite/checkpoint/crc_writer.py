"""Checkpoint files whose CRC-32 is computed from the bytes as they are written, never by reading them back.

``CrcFileSystemWriter`` is DCP's ``FileSystemWriter`` whose write streams feed every buffer to
``zlib.crc32`` (which releases the GIL, so writer threads checksum in parallel). After the save,
``records`` holds the manifest entry (``{"bytes": n, "crc32": "8 hex digits"}``) of every file this rank
wrote, the renamed DCP ``.metadata`` included. A stream that is seeked, or left by an exception, records
nothing, and the manifest then reads that file back.
"""
from __future__ import annotations

import io
import os
import threading
import zlib
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

__all__ = ["CrcFileSystemWriter", "record_of", "writer_threads"]


def record_of(data) -> dict:
    """The manifest entry of a file holding exactly ``data`` (bytes or any contiguous buffer)."""
    view = memoryview(data).cast("B")
    return {"bytes": view.nbytes, "crc32": f"{zlib.crc32(view):08x}"}


def writer_threads(cuda: bool) -> int:
    """DCP writer threads per rank: one on a CPU-only machine, where training needs the few cores and the
    files keep their one-per-rank layout; four beside a GPU, whose host has cores to spare for the
    serialization, checksums and writes of a multi-GB state."""
    return min(4, os.cpu_count() or 1) if cuda else 1


class _CrcStream(io.RawIOBase):
    """A binary file opened for writing that keeps the CRC-32 and count of the bytes written so far."""

    def __init__(self, raw):
        super().__init__()
        self._raw = raw
        self.crc, self.nbytes, self.sequential = 0, 0, True

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = self._raw.write(view)
        n = view.nbytes if n is None else n
        self.crc = zlib.crc32(view[:n], self.crc)
        self.nbytes += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        # Bytes written after a seek may overwrite earlier ones: the running CRC no longer describes
        # the file (DCP does not seek while writing; this keeps any future writer honest).
        pos = self._raw.seek(offset, whence)
        if pos != self.nbytes:
            self.sequential = False
        return pos

    def seekable(self) -> bool:
        return self._raw.seekable()

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        # IOBase.close flushes (the file's buffer) before marking this stream closed.
        super().close()
        self._raw.close()


class _CrcFileSystem(FileSystem):
    """DCP's local file system, recording each file written through ``create_stream(path, "wb")``."""

    def __init__(self):
        self.records: dict[str, dict] = {}
        self._lock = threading.Lock()  # DCP's writer threads finish files concurrently

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with self._lock:
            self.records.pop(str(path), None)
        with Path(path).open(mode) as raw:
            stream = _CrcStream(raw)
            yield stream
            stream.close()
        if stream.sequential:
            with self._lock:
                self.records[str(path)] = {"bytes": stream.nbytes, "crc32": f"{stream.crc:08x}"}

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            record = self.records.pop(str(path), None)
            if record is not None:
                self.records[str(new_path)] = record

    def rm_file(self, path) -> None:
        super().rm_file(path)
        with self._lock:
            self.records.pop(str(path), None)


class CrcFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` that checksums each file while writing it; ``records`` after the save."""

    def __init__(self, path, thread_count: int = 1, **kwargs):
        super().__init__(path, thread_count=thread_count, **kwargs)
        self.fs = _CrcFileSystem()
        self.path = self.fs.init_path(path)

    @property
    def records(self) -> dict:
        """``{file name: {"bytes", "crc32"}}`` of the files written so far under this writer's directory."""
        with self.fs._lock:
            items = list(self.fs.records.items())
        return {os.path.basename(p): r for p, r in items if os.path.dirname(p) == str(self.path)}
