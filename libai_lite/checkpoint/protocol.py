"""The directory protocol: a checkpoint directory ``model_XXXXXXX/`` is either complete or absent.

A save writes everything under `NAME.tmp/` (`manifest.json` last), renames an existing `NAME/` to
`NAME.old/`, renames `NAME.tmp/` to `NAME/`, atomically replaces `last_checkpoint`, then deletes
`NAME.old/`. So `last_checkpoint` never names a directory that is gone for good. After a crash,
``recover_interrupted`` publishes a `NAME.tmp/` that has its manifest, puts back a `NAME.old/` whose
`NAME/` is missing, and deletes only a `NAME.tmp/` without a manifest. ``checkpoint_to_resume`` finds the
checkpoint to continue from, and ``prune`` keeps the newest ``max_to_keep`` periodic ones.
"""
from __future__ import annotations

import logging
import os
import re
import shutil

from ..utils.distributed import broadcast_object, get_rank
from ..utils.errors import UsageError
from ..utils.files import atomic_write
from .integrity import MANIFEST, describe
from .trainer_state import TRAINER_STATE, read_trainer_state

logger = logging.getLogger("libai_lite")

LAST_CHECKPOINT = "last_checkpoint"
_ASIDE = ".old"
_PERIODIC = re.compile(r"^model_(\d{7})$")


def _write_text_atomic(path: str, text: str) -> None:
    atomic_write(path, lambda f: f.write(text), mode="w")


def _fsync_dir(path: str) -> None:
    """Make the renames inside ``path`` durable: a power cut after a rename must not undo it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the rename itself is still atomic
    finally:
        os.close(fd)


def is_complete(path: str) -> bool:
    """A checkpoint directory is usable when its DCP metadata and trainer state are both there."""
    return os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, TRAINER_STATE))


def _read_marker(save_dir: str) -> str | None:
    """The checkpoint name written in ``save_dir/last_checkpoint``; None when there is no such file."""
    marker = os.path.join(save_dir, LAST_CHECKPOINT)
    if not os.path.isfile(marker):
        return None
    with open(marker, "rb") as f:
        raw = f.read()
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = None
    if name is None or any(c in name for c in "\x00\n/" + os.sep):
        raise UsageError(f"{marker} holds {raw[:40]!r}, not the name of a checkpoint directory (it was overwritten); "
                         f"write the name of a complete one (model_final, model_XXXXXXX) into it, or delete it to "
                         f"start afresh")
    return name


def last_checkpoint(save_dir: str) -> str | None:
    """Path of the checkpoint named in ``save_dir/last_checkpoint``, or None."""
    name = _read_marker(save_dir)
    return os.path.join(save_dir, name) if name else None


def _interrupted(save_dir: str, name: str, marker: str | None) -> str | None:
    """What a killed save left for checkpoint ``name``: "publish" (``NAME.tmp`` is complete),
    "restore" (``NAME.old`` is the only complete copy) or None."""
    final, tmp, aside = (os.path.join(save_dir, name + suffix) for suffix in ("", ".tmp", _ASIDE))
    if is_complete(tmp) and (
        os.path.isfile(os.path.join(tmp, MANIFEST))
        # A checkpoint without a manifest, killed between deleting NAME and renaming NAME.tmp.
        or (name == marker and not os.path.isdir(final) and not os.path.isdir(aside))
    ):
        return "publish"
    if os.path.isdir(aside) and not os.path.isdir(final) and is_complete(aside):
        return "restore"
    return None


def _current_location(save_dir: str, name: str) -> str:
    """Where checkpoint ``name`` is now: the directory ``recover_interrupted`` will rename to ``name``, if any."""
    action = _interrupted(save_dir, name, _read_marker(save_dir))
    return os.path.join(save_dir, name + {"publish": ".tmp", "restore": _ASIDE}.get(action, ""))


def recover_interrupted(save_dir: str, remove_partial: bool = True) -> None:
    """Repair what an interrupted save left in ``save_dir`` (rank 0, holding the directory's lock).

    A ``NAME.tmp/`` with its manifest is published as the save would have. A ``NAME.old/`` whose ``NAME/`` is
    gone is put back; one beside a complete ``NAME/`` is deleted. With ``remove_partial``, a ``NAME.tmp/``
    without a manifest is deleted. ``last_checkpoint`` is left alone, since at every step of a save it names
    a complete checkpoint or one this repair puts back. Raises OSError when the disk refuses a rename.
    """
    if not os.path.isdir(save_dir):
        return
    marker = _read_marker(save_dir)
    entries = os.listdir(save_dir)
    names = sorted({e[: -len(suffix)] for e in entries for suffix in (".tmp", _ASIDE)
                    if e.endswith(suffix) and os.path.isdir(os.path.join(save_dir, e))})
    for name in names:
        final, tmp, aside = (os.path.join(save_dir, name + suffix) for suffix in ("", ".tmp", _ASIDE))
        action = _interrupted(save_dir, name, marker)
        if action == "publish":
            if os.path.isdir(final):
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(final, aside)
            os.replace(tmp, final)
            logger.warning(f"Published {final}: its save was interrupted after every file had been written")
        elif action == "restore":
            os.replace(aside, final)
            logger.warning(f"Restored {final} from {aside}: a save replacing it was interrupted")
        if os.path.isdir(aside) and is_complete(final):
            shutil.rmtree(aside)
            logger.info(f"Removed {aside}, the checkpoint {final} replaced")
        if remove_partial and os.path.isdir(tmp):
            shutil.rmtree(tmp)
            logger.warning(f"Removed partial checkpoint {tmp} left by an interrupted save")
    _fsync_dir(save_dir)


def _rename(src: str, dst: str) -> None:
    """One rename of the protocol, made durable: a power cut after it must not undo it."""
    os.replace(src, dst)
    _fsync_dir(os.path.dirname(dst))


def publish(save_dir: str, name: str, max_to_keep: int | None = None) -> str:
    """Rank 0: move the complete ``NAME.tmp`` into place (steps 2-5 of the module docstring), then ``prune``.

    Returns the error that stopped it, or "".
    """
    final = os.path.join(save_dir, name)
    tmp, aside = final + ".tmp", final + _ASIDE
    try:
        shutil.rmtree(aside, ignore_errors=True)
        if os.path.isdir(final):
            _rename(final, aside)
        _rename(tmp, final)
        _write_text_atomic(os.path.join(save_dir, LAST_CHECKPOINT), name)
        shutil.rmtree(aside, ignore_errors=True)
        prune(save_dir, max_to_keep, keep=name)
        return ""
    except OSError as e:
        # Back to one complete NAME and no aside copy (the caller removes NAME.tmp): the old NAME
        # when the new one could not be moved in, else the new one, which only the marker missed.
        try:
            if os.path.isdir(aside) and not os.path.isdir(final):
                os.replace(aside, final)
            else:
                shutil.rmtree(aside, ignore_errors=True)
        except OSError:
            pass  # the next start repairs it (recover_interrupted)
        return describe(e)


def prune(save_dir: str, max_to_keep: int | None, keep: str) -> None:
    """Delete the oldest complete periodic checkpoints beyond the newest ``max_to_keep``, never ``keep``."""
    if not max_to_keep or max_to_keep <= 0:
        return
    periodic = sorted(
        d for d in os.listdir(save_dir)
        if _PERIODIC.match(d) and is_complete(os.path.join(save_dir, d))
    )
    # The checkpoint just written is never deleted, whatever max_to_keep says.
    doomed = [d for d in periodic[: max(len(periodic) - max_to_keep, 0)] if d != keep]
    for d in doomed:
        shutil.rmtree(os.path.join(save_dir, d), ignore_errors=True)
        logger.info(f"Removed old checkpoint {d} (train.checkpointer.max_to_keep={max_to_keep})")


def _resume_verdict(save_dir: str) -> tuple[str | None, str | None]:
    """Rank 0: ``(checkpoint to resume from or None, error or None)``, reading only.

    After an interrupted save the checkpoint ``last_checkpoint`` names may still be in ``NAME.tmp/`` or
    ``NAME.old/``; it is loaded from there and renamed only once this run holds the output directory
    (``Checkpointer.remove_partial``), so a run refused as a second one changes nothing.
    """
    try:
        name = _read_marker(save_dir)
    except UsageError as e:  # the verdict every rank gets, not rank 0's alone
        return None, str(e)
    if name is None:
        return None, None
    marker, path = os.path.join(save_dir, LAST_CHECKPOINT), _current_location(save_dir, name)
    fix = (f"write the name of an earlier complete model_XXXXXXX directory into {marker}, "
           f"or start without --resume")
    if not is_complete(path):
        return None, f"{marker} names {path}, which is missing or incomplete: the checkpoint is corrupt; {fix}"
    try:
        read_trainer_state(path, fix)
    except UsageError as e:
        return None, str(e)
    return path, None


def checkpoint_to_resume(save_dir: str) -> str | None:
    """The checkpoint `--resume` should continue from, agreed by all ranks (None: start fresh).

    Rank 0 reads the directory (the checkpoint may be in ``NAME.tmp/`` or ``NAME.old/`` after a
    killed save: see ``_resume_verdict``) and every rank gets its verdict, so a corrupt checkpoint
    stops all ranks with the same message instead of leaving the others waiting.
    """
    verdict = _resume_verdict(save_dir) if get_rank() == 0 else (None, None)
    path, error = broadcast_object(verdict)
    if error:
        raise UsageError(error)
    return path
