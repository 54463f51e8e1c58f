"""Where a tool may write: never over, into or around what it reads, and only the kind of path it writes."""
from __future__ import annotations

import os
from typing import Iterable

from .errors import UsageError


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _same(a: str, b: str) -> bool:
    if _real(a) == _real(b):
        return True
    try:
        return os.path.samefile(a, b)  # hard links: two names, one file
    except OSError:
        return False


def _inside(inner: str, outer: str) -> bool:
    inner, outer = _real(inner), _real(outer)
    return inner != outer and os.path.commonpath([inner, outer]) == outer


def _existing_ancestor(path: str) -> str:
    path = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def check_outputs(outputs: Iterable[str], inputs: Iterable[str | None] = (), *, option: str,
                  directory: bool = False) -> None:
    """Refuse, before a tool does any work, outputs that would destroy or change what it reads.

    ``outputs`` are the paths the tool writes (files, or directories when ``directory``), all given by
    the command-line ``option``; ``inputs`` the files and directories it reads (None entries are skipped).
    Raises ``UsageError`` naming both paths and the fix when an output is an input (a symbolic or hard
    link included), lies inside an input directory or holds an input, or when a directory stands where a
    file is written or a file where a directory is.
    """
    inputs = [os.fspath(p) for p in inputs if p is not None and str(p) != ""]
    for out in map(os.fspath, outputs):
        for inp in inputs:
            if _same(out, inp):
                where = "outside" if os.path.isdir(inp) else "other than"
                raise UsageError(f"{option} would write {out}, which is the input {inp}; give {option} a path "
                                 f"{where} {inp}")
        if os.path.isdir(out) and not directory:
            raise UsageError(f"{option} would write the file {out}, but that is a directory; give {option} the "
                             f"path of a file, not of a directory")
        if os.path.lexists(out) and not os.path.isdir(out) and directory:
            raise UsageError(f"{option} would write the directory {out}, but that is a file; give {option} a "
                             f"new or existing directory instead")
        parent = _existing_ancestor(out)
        if not os.path.isdir(parent):
            raise UsageError(f"{option} would write {out}, but {parent} is a file, not a directory; give {option} a "
                             f"path outside {parent}")
        for inp in inputs:
            if _inside(out, inp):
                raise UsageError(f"{option} would write {out}, inside the input {inp}; give {option} a path "
                                 f"outside {inp}")
            if _inside(inp, out):
                raise UsageError(f"{option} would write {out}, which holds the input {inp}; give {option} a path "
                                 f"that does not hold {inp}")
