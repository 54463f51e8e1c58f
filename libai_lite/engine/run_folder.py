"""What a training's output folder already holds: a run that a new training must not replace."""
from __future__ import annotations

import os
import re

from ..checkpoint.protocol import LAST_CHECKPOINT, last_checkpoint
from ..utils.distributed import broadcast_object, get_rank
from ..utils.errors import UsageError
from ..utils.process import OutputDirLock

# A checkpoint directory of the protocol (libai_lite.checkpoint.protocol), published or left by a killed save.
_CHECKPOINT_DIR = re.compile(r"^model_(\d{7}|final|best)(\.tmp|\.old)?$")


def existing_run_refusal(output_dir: str) -> str | None:
    """The one-line refusal of a new training in ``output_dir`` where it holds a run, else None; reads only.

    A run is a ``last_checkpoint``, a checkpoint directory, or config.yaml with metrics.json; an empty folder or
    one of unrelated files is trained into. A live run's lock is named first.
    """
    try:
        entries = sorted(os.listdir(output_dir))
    except OSError:  # not there yet, or unreadable: check_output_dir_writable says which
        return None
    checkpoints = [e for e in entries if _CHECKPOINT_DIR.match(e) and os.path.isdir(os.path.join(output_dir, e))]
    logged = [e for e in ("config.yaml", "metrics.json") if e in entries]
    if LAST_CHECKPOINT not in entries and not checkpoints and len(logged) < 2:
        return None
    try:
        OutputDirLock(output_dir).refuse_if_held()
    except UsageError as e:
        return str(e)
    try:
        name = os.path.basename(last_checkpoint(output_dir) or "")
    except (OSError, UsageError):  # unreadable or garbled: the run is named by its files
        name = ""
    if name:
        return (f"train.output_dir={output_dir} already holds a run (last checkpoint {name}); continue it with "
                f"--resume, or give a new train.output_dir=...")
    held = ", ".join(checkpoints[:3] + logged) or f"an empty {LAST_CHECKPOINT}"
    return (f"train.output_dir={output_dir} already holds a run ({held}) with no last_checkpoint to continue from; "
            f"give a new train.output_dir=..., or add --resume to train it again from iteration 0 there")


def refuse_existing_run(output_dir: str) -> None:
    """Refuse a new training in a directory that holds a run (``existing_run_refusal``): it would start at iteration
    0 and replace it. Rank 0 reads, every rank gets its verdict."""
    refusal = broadcast_object(existing_run_refusal(output_dir) if get_rank() == 0 else None)
    if refusal:
        raise UsageError(refusal)


def check_output_dir_writable(output_dir: str) -> None:
    """Refuse an output directory that cannot be created or written, before anything is written anywhere."""
    if not output_dir or not str(output_dir).strip():
        raise UsageError("train.output_dir is empty; set it to the directory for this run's checkpoints and logs")
    path = os.path.abspath(output_dir)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        what = "is a file" if os.path.exists(path) and not os.path.isdir(path) else "is not writable"
        raise UsageError(f"train.output_dir={output_dir} is not writable ({path} {what}); choose another directory")
