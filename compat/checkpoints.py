"""Checkpoints of other frameworks, recognised so that loading one names its format and the way in.

Handed to ``train.load_weight`` or ``--resume``, a Megatron-LM checkpoint has no ``.metadata``, a Megatron core
``torch_dist`` one has other key names and a LiBai (OneFlow) one no DCP files at all: none is incomplete or
corrupt. :func:`checkpoint_format` tells them apart by their files; :func:`foreign_checkpoint_error` is the
one-line refusal, which the core asks for through the ``libai_lite.checkpoint_formats`` entry point.
"""
from __future__ import annotations

import glob
import json
import os

from libai_lite.utils.errors import UsageError

__all__ = ["checkpoint_format", "foreign_checkpoint_error", "megatron_iteration_dir"]

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"


def _is_torch_dist(folder: str) -> bool:
    meta = os.path.join(folder, "metadata.json")
    if not os.path.isfile(meta):
        return False
    try:
        with open(meta) as f:
            return "sharded_backend" in json.load(f)
    except (OSError, ValueError):
        return False


def checkpoint_format(path: str) -> str:
    """``megatron-legacy``, ``megatron-torch_dist``, ``libai``, ``ours`` or ``""`` (not a checkpoint directory)."""
    if not os.path.isdir(path):
        return ""
    names = set(os.listdir(path))
    steps = sorted(n for n in names if n.startswith("iter_") or n == "release")
    if MEGATRON_TRACKER in names or steps:
        inner = os.path.join(path, steps[-1]) if steps else path
        return "megatron-torch_dist" if _is_torch_dist(inner) else "megatron-legacy"
    if any(n.startswith("mp_rank_") for n in names):
        return "megatron-legacy"
    if _is_torch_dist(path):
        return "megatron-torch_dist"
    if ".metadata" in names or "last_checkpoint" in names or "trainer_state.json" in names:
        return "ours"
    # LiBai's Checkpointer saves OneFlow state dicts: a folder per tensor holding 'meta' and 'out'.
    if glob.glob(os.path.join(path, "**", "meta"), recursive=True) and glob.glob(
            os.path.join(path, "**", "out"), recursive=True):
        return "libai"
    return ""


def foreign_checkpoint_error(path: str) -> str | None:
    """The refusal for a checkpoint of another framework at ``path``, or None."""
    kind = checkpoint_format(path)
    if kind.startswith("megatron"):
        name = "a Megatron-LM legacy" if kind == "megatron-legacy" else "a Megatron core torch_dist"
        return (f"{path} is {name} checkpoint: convert it with python tools/convert_checkpoint.py --from megatron "
                f"--input {path} --output DIR, then set train.load_weight=DIR")
    if kind == "libai":
        return (f"{path} is a LiBai (OneFlow) checkpoint, which needs OneFlow to read: export it to Hugging Face with "
                f"LiBai, then python tools/hf_convert.py import --hf-dir HF_DIR --output DIR")
    return None


def megatron_iteration_dir(path: str, iteration=None) -> str:
    """The folder of one iteration of a Megatron-LM checkpoint ``path``: ``iteration`` (a number or ``release``),
    else the one its tracker file names, else its last ``iter_*`` folder (or ``path`` itself without any).

    A tracker or an ``iteration`` that is not an iteration number is one UsageError naming it, as Megatron
    writes only the last saved iteration or ``release`` there.
    """
    tracker = os.path.join(path, MEGATRON_TRACKER)
    source = "--iteration"
    if iteration is None:
        if not os.path.isfile(tracker):
            found = sorted(n for n in os.listdir(path) if n.startswith("iter_"))
            return os.path.join(path, found[-1]) if found else path
        source = tracker
        with open(tracker, "rb") as f:
            iteration = f.read(64).decode("utf-8", errors="replace").strip()
    text = str(iteration).strip()
    if text == "release":
        return os.path.join(path, "release")
    if not text.isdigit():
        found = sorted(n for n in os.listdir(path) if n.startswith("iter_") or n == "release")
        raise UsageError(f"{source} holds {text[:40]!r}, not an iteration number (Megatron-LM's is the last saved "
                         f"iteration or 'release'); pass --iteration with one of the checkpoint's folders "
                         f"({', '.join(found) or 'none found'})")
    return os.path.join(path, f"iter_{int(text):07d}")
