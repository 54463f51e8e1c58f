"""What the translating tools (tools/from_megatron.py, tools/from_fairseq.py) share: their own command line, and
the config file they make, printed, written to ``--output`` or to a temporary file for tools/train_net.py."""
from __future__ import annotations

import os
import shlex
import sys
import tempfile
from typing import List, Optional, Tuple

__all__ = ["emit_config", "parse_tool_argv", "temporary_config"]


def parse_tool_argv(argv: List[str], doc: str, wanted: str) -> Tuple[Optional[int], Optional[str], str]:
    """``(exit status to return now or None, --output or None, the command line to translate as one string)``;
    ``wanted`` names what the tool reads, for the line a bare call gets."""
    if argv[:1] in (["--help"], ["-h"]):
        print(doc.strip())
        return 0, None, ""
    output = None
    if argv[:1] == ["--output"]:
        if len(argv) < 2:
            print("error: --output needs a file name", file=sys.stderr)
            return 1, None, ""
        output, argv = argv[1], argv[2:]
    if not argv:
        print(f"error: pass {wanted}", file=sys.stderr)
        return 1, None, ""
    return None, output, shlex.join(argv)


def emit_config(text: str, output: Optional[str], default_name: str) -> str:
    """Write the config to ``output``, or print it headed by ``default_name``; the name the run command gives."""
    if output:
        with open(output, "w") as f:
            f.write(text)
        return output
    print(f"# {default_name}\n{text}")
    return default_name


def temporary_config(text: str, prefix: str) -> str:
    """The config in a temporary ``.py`` file (tools/train_net.py removes it once the run has read it)."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".py")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path
