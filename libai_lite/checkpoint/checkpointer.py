"""Checkpoints through `torch.distributed.checkpoint` that are either complete or absent.

A checkpoint `model_XXXXXXX/` holds DCP files with model and optimizer state keyed by parameter name,
loadable under another parallel layout (``dcp_io``); `trainer_state.json` and per-rank
`rng_state_{rank}.pt` (``trainer_state``); and `manifest.json`, written last, with each other file's
size and CRC-32, so partial or corrupt checkpoints are refused at load (``integrity``). It is written
under `NAME.tmp/` and published by crash-safe renames (``protocol``). With ``async_save`` the files are
written in the background and published only once complete (``Checkpointer.poll``/``wait``); until then
``last_checkpoint`` still names the previous checkpoint.
"""
from __future__ import annotations

import logging
import os
import shutil
import time

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..utils.distributed import barrier, get_rank
from ..utils.errors import UsageError
from ..utils.events import format_bytes
from . import protocol
from .collectives import gather, world_size
from .crc_writer import CrcFileSystemWriter
from .dcp_io import (BackgroundWriter, InFlight, ModelState, default_writer_threads, first_error, state_bytes,
                     write_failure)
from .finite import first_nonfinite_weight
from .integrity import describe, write_manifest
from .trainer_state import RngState, TrainerState, read_trainer_state

logger = logging.getLogger("libai_lite")


class Checkpointer:
    """Saves and loads model, optimizer and trainer state under `save_dir`.

    `model` is a module or the list of pipeline stages this rank holds; `optimizer` is one optimizer or an
    `OptimizersContainer` with one per part. `states` are ``Stateful`` objects with ``save(directory)`` and
    ``load(directory)``, kept in files of their own; by default ``RngState``, and the trainer adds its
    ``TrainerState``. With `async_save`, `save` returns once the state is in CPU memory and `poll` or `wait`
    publishes it. `verify` (False with --no-verify) checks files against the manifest before loading.
    """

    def __init__(self, model, optimizer=None, save_dir: str = "", *, max_to_keep: int | None = None,
                 aliases: dict | None = None, async_save: bool = False, tied_copies: dict | None = None,
                 vocab_ids: int | None = None, model_config=None, writer_threads: int | None = None,
                 states: dict | None = None, verify: bool = True,
                 retry: str = "point train.output_dir elsewhere, then --resume"):
        # How a failed save's line ends: a training run's fix by default, a tool's own (its --output) otherwise.
        self.retry = retry
        self.parts = list(model) if isinstance(model, (list, tuple)) else [model]
        self.optimizer = optimizer
        self.save_dir = save_dir
        self.max_to_keep = max_to_keep
        self.model_state = ModelState(self.parts, optimizer, aliases=aliases, tied_copies=tied_copies,
                                      vocab_ids=vocab_ids, model_config=model_config)
        self.states = dict(states) if states is not None else {"rng": RngState()}
        self.verify = bool(verify)
        self.async_save = bool(async_save)
        # DCP's writer threads per rank (each writes its own file): see crc_writer.writer_threads.
        self.writer_threads = int(writer_threads or default_writer_threads())
        self._background = BackgroundWriter(self.writer_threads)
        self._in_flight: InFlight | None = None
        self._last_cause: BaseException | None = None

    def _write_own_files(self, tmp: str, trainer_state: dict | None) -> dict:
        """Write this rank's ``states`` into ``tmp`` (``trainer_state``, when given, as the trainer's); returns their
        manifest records."""
        states = dict(self.states)
        if trainer_state is not None:
            states["trainer"] = TrainerState.fixed(trainer_state)
        if not any(isinstance(state, TrainerState) for state in states.values()):
            raise ValueError("a checkpoint needs the trainer's state: give Checkpointer(states={'trainer': "
                             "TrainerState(...)}) or save(name, trainer_state)")
        out = {}
        for state in states.values():
            out.update(state.save(tmp))
        return out

    def save(self, name: str, trainer_state: dict | None = None, blocking: bool = False) -> str:
        """Write checkpoint `name` with the checkpointer's ``states`` (or `trainer_state` as the trainer's);
        returns its final path.

        Collective. A write failure on any rank removes the partial files and raises a UsageError on every
        rank, leaving earlier checkpoints and ``last_checkpoint`` untouched. With ``async_save`` and not
        ``blocking``, returns once the state is in CPU memory; a later ``poll``, ``wait`` or ``save`` publishes
        it or raises its failure. A save still in flight is finished first. Weights holding a NaN or inf are
        never saved: a FloatingPointError names the last good checkpoint.
        """
        if self.async_save:
            self.wait()
        final = os.path.join(self.save_dir, name)
        self._refuse_nonfinite(final)
        tmp = final + ".tmp"
        rank = get_rank()
        error = ""
        if rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            except OSError as e:
                error = describe(e)
        self._raise_if_failed(error, final, None)
        if self.async_save and not blocking:
            self._start_background_save(name, trainer_state)
            return final
        state, known = None, {}
        try:
            state = self.model_state.state()
            storage = CrcFileSystemWriter(tmp, thread_count=self.writer_threads)
            dcp.save(state, checkpoint_id=tmp, storage_writer=storage)
            known = {**storage.records, **self._write_own_files(tmp, trainer_state)}
        except (OSError, RuntimeError, CheckpointException) as e:
            # DCP reports a rank's failed write as a CheckpointException (a BaseException) on every rank.
            error = write_failure(e, tmp, state_bytes(state) if state is not None else None)
            if not error:
                if rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
        # Also the barrier before the manifest: every rank has written all its files.
        self._raise_if_failed(error, final, state)
        # Written last: its presence is what makes the directory a complete checkpoint.
        self._raise_if_failed(write_manifest(tmp, known=known), final, state)
        if rank == 0:
            error = self._publish(name)
        self._raise_if_failed(error, final, state)
        return final

    def _refuse_nonfinite(self, final: str) -> None:
        """Collective: raise on every rank when a weight is NaN or inf, before any file of ``final`` is made."""
        bad = first_nonfinite_weight(self.parts)
        if not bad:
            return
        previous = self.last_checkpoint()
        kept, then = (f"the last good checkpoint is {previous}", "--resume from it") if previous else \
            ("no earlier checkpoint was saved", "train again")
        raise FloatingPointError(
            f"weight {bad} is NaN or inf: training diverged, so checkpoint {final} was not saved and {kept}; lower "
            f"optim.lr, raise train.warmup_ratio or enable clipping (optim.params.clip_grad_max_norm), then {then}")

    def _publish(self, name: str) -> str:
        """Rank 0: move the complete ``NAME.tmp`` into place (``protocol.publish``); returns an error or ""."""
        return protocol.publish(self.save_dir, name, self.max_to_keep)

    def _raise_if_failed(self, error: str, final: str, state, cause: BaseException | None = None) -> None:
        """Collective: when any rank reports ``error``, remove the partial save and raise the first one everywhere."""
        first = first_error(gather(error))
        if not first:
            return
        if get_rank() == 0:
            shutil.rmtree(final + ".tmp", ignore_errors=True)
        barrier()
        raise self._save_failed(first, final, state_bytes(state) if state is not None else None) from cause

    def _save_failed(self, first: str, final: str, needed: int | None) -> UsageError:
        """The one-line error of a failed save of ``final`` whose partial files are already removed."""
        space, free = "", None
        try:
            free = shutil.disk_usage(self.save_dir).free
            space = f"{format_bytes(free)} are free there; "
            if needed is not None:
                space = f"it needs about {format_bytes(needed)} and {space}"
        except OSError:
            pass
        previous = self.last_checkpoint()
        kept = f"the previous checkpoint {previous} is kept" if previous else "no earlier checkpoint exists"
        # Space is the fix only where the disk is what failed: a rename refused with 63 GB free is not.
        full = any(s in first for s in ("No space left", "Disk quota", "too large")) or (
            needed is not None and free is not None and free < needed)
        fix = f"free disk space in {self.save_dir}" if full else \
            f"make {self.save_dir} writable (and its checkpoints movable)"
        return UsageError(
            f"saving checkpoint {final} failed ({first}); {space if full else ''}the partial files were removed and "
            f"{kept}: {fix} or {self.retry}"
        )

    # ------------------------------------------------------------------ background saves
    def _start_background_save(self, name: str, trainer_state: dict | None) -> None:
        """Stage the state in CPU memory and hand the writing of ``NAME.tmp`` to a background thread."""
        final = os.path.join(self.save_dir, name)
        tmp, rank = final + ".tmp", get_rank()
        state, error, cause = None, "", None
        known = {}
        try:
            state = self.model_state.state()
            # The small files now, while the RNG and trainer state are those of this step.
            known = self._write_own_files(tmp, trainer_state)
        except (OSError, RuntimeError) as e:
            # As in the synchronous save: what is no write failure is a bug, raised as it is.
            error = write_failure(e, tmp, state_bytes(state) if state is not None else None)
            if not error:
                if rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
            cause = e
        # Agreed before any rank starts the background write, whose collectives would otherwise
        # wait for a rank that gave up here.
        self._raise_if_failed(error, final, state, cause)
        future, needed = self._background.start(state, name, tmp, known)
        self._in_flight = InFlight(name, future, needed, time.perf_counter())

    def _finish(self) -> str:
        """Take the save in flight (its write done) off the books; rank 0 publishes it. Returns an error or ""."""
        job, self._in_flight = self._in_flight, None
        error, self._last_cause = job.future.result()
        if not error and get_rank() == 0:
            error = self._publish(job.name)
            if error:
                shutil.rmtree(os.path.join(self.save_dir, job.name + ".tmp"), ignore_errors=True)
                error += " on rank 0" if world_size() > 1 else ""
        if not error and get_rank() == 0:
            logger.info(f"Saved checkpoint {os.path.join(self.save_dir, job.name)}, written in the background "
                        f"in {time.perf_counter() - job.started:.2f}s")
        return error

    @property
    def in_flight(self) -> str | None:
        """The name of the checkpoint being written in the background, or None."""
        return self._in_flight.name if self._in_flight is not None else None

    def poll(self) -> str | None:
        """Publish the background save if its files are written; returns its path, or None (nothing done).

        Not blocking and not collective, so ranks may observe the outcome at different steps. A failed write
        raises ``save``'s UsageError on this rank only; the trainer stops every rank with it at the step boundary.
        """
        if self._in_flight is None or not self._in_flight.future.done():
            return None
        job = self._in_flight
        error = self._finish()
        if error:
            raise self._save_failed(error, os.path.join(self.save_dir, job.name), job.needed) from self._last_cause
        return os.path.join(self.save_dir, job.name)

    def wait(self, collective: bool = True) -> str | None:
        """Block until the background save is written and publish it; returns its path, or None (none in flight).

        Collective unless ``collective`` is False (a rank leaving alone on an exception); a failure raises the
        same UsageError on every rank, even one whose ``poll`` already saw it.
        """
        job = self._in_flight
        outcome = ("", None, None)
        if job is not None:
            outcome = (self._finish(), os.path.join(self.save_dir, job.name), job.needed)
        outcomes = gather(outcome) if collective else [outcome]
        # The background write's error already names its rank, and a failed publish names rank 0.
        error, final, needed = next((o for o in outcomes if o[0]), outcome)
        if error:
            raise self._save_failed(error, final, needed) from (self._last_cause if job is not None else None)
        return outcome[1]

    def last_checkpoint(self) -> str | None:
        """Path of the checkpoint named in `last_checkpoint`, or None."""
        return protocol.last_checkpoint(self.save_dir)

    def remove_partial(self) -> None:
        """Rank 0 at start-up: finish or undo a save a killed run left half done, and delete never-published
        ``*.tmp`` directories (``recover_interrupted``); no complete checkpoint is deleted."""
        if get_rank() != 0:
            return
        try:
            protocol.recover_interrupted(self.save_dir, remove_partial=True)
        except OSError as e:
            raise UsageError(f"cannot repair the checkpoints an interrupted save left in {self.save_dir} "
                             f"({describe(e)}): check the permissions and free space there") from None

    def load(self, path: str, weights_only: bool = False) -> dict:
        """Load a checkpoint into the model, and unless `weights_only` into the optimizer and ``states``; returns
        the trainer state saved with it (``{}`` with `weights_only` or without an optimizer).

        Collective when distributed. Corrupt files (unless ``verify`` is False) or tensors that do not fit the
        model are refused in one line before anything is loaded.
        """
        full = not weights_only and self.optimizer is not None
        part_states, meta = self.model_state.check(path, with_optim=full, verify=self.verify)
        trainer_state = read_trainer_state(path) if full else {}
        self.model_state.load(path, part_states, meta)
        if full:
            for state in self.states.values():
                state.load(path)
        return trainer_state
