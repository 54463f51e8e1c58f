"""Checkpoints of other frameworks, recognised so that loading one names its format and the way in.

A Megatron-LM checkpoint handed to ``train.load_weight`` or ``--resume`` was called "missing or incomplete (no
.metadata)", a Megatron core ``torch_dist`` one opened and failed on its key names, a LiBai (OneFlow) one was
"corrupt". :func:`checkpoint_format` tells them apart by their files; :func:`foreign_checkpoint_error` is the
one-line refusal.
"""
from __future__ import annotations

import glob
import json
import os

__all__ = ["checkpoint_format", "foreign_checkpoint_error"]


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
    if "latest_checkpointed_iteration.txt" in names or steps:
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
