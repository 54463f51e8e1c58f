"""The trainer's state in a checkpoint, as ``Stateful`` objects the ``Checkpointer`` is given.

``TrainerState`` writes ``trainer_state.json`` on rank 0 (iteration, consumed samples, scheduler and
loss-scaler state); ``RngState`` writes each rank's RNG streams to ``rng_state_{rank}.pt``, tensors and
ints only, loaded with ``weights_only``. Each has ``save(directory)`` and ``load(directory)``.
"""
from __future__ import annotations

import io
import json
import logging
import os
import random
from typing import Callable

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.stateful import Stateful

from ..utils.distributed import get_rank
from ..utils.errors import UsageError
from ..utils.files import atomic_write
from .crc_writer import record_of
from .integrity import CORRUPT_FIX, RNG_STATE, TRAINER_STATE, describe

logger = logging.getLogger("libai_lite")


def read_trainer_state(path: str, fix: str = "resume from an earlier checkpoint") -> dict:
    """``path/trainer_state.json`` as a dict; a one-line UsageError naming the file when it is missing or garbled."""
    file = os.path.join(path, TRAINER_STATE)
    try:
        with open(file) as f:
            state = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"checkpoint {path} has no {TRAINER_STATE}: it is incomplete; {fix}") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{file} is truncated or garbled ({type(e).__name__}: {e}): the checkpoint is "
                         f"corrupt; {fix}") from None
    if not isinstance(state, dict):
        raise UsageError(f"{file} holds a {type(state).__name__}, not a trainer state: the checkpoint is corrupt; "
                         f"{fix}")
    return state


class RunAlreadyFinished(UsageError):
    """A resume of a run that has trained all of its ``train.train_iter`` iterations."""


def check_resume_has_work(checkpoint: str, done: int, train_iter: int) -> None:
    """Refuse a resume that would train nothing: it would only rewrite the finished run's checkpoints and config
    (``RunAlreadyFinished`` when ``train_iter`` is the run's own count, which a torchrun restart takes as done)."""
    if train_iter <= done:
        refusal = RunAlreadyFinished if train_iter == done else UsageError
        raise refusal(f"--resume: {checkpoint} has already trained {done} iterations and train.train_iter={train_iter} "
                      f"asks for no more: nothing to train, nothing written; set train.train_iter above {done} to "
                      f"train on (or evaluate it with --eval-only)")


def resume_position(path: str | None, train_iter: int | None = None) -> tuple[int, int]:
    """``(consumed samples, first iteration)`` of a run continuing from checkpoint ``path`` ((0, 0) for None);
    with ``train_iter`` (a run that trains), a resume with nothing left to train is refused."""
    state = read_trainer_state(path) if path is not None else {}
    consumed, start = int(state.get("consumed_samples", 0)), int(state.get("iteration", -1)) + 1
    if path is not None and train_iter is not None:
        check_resume_has_work(path, start, train_iter)
    return consumed, start


# model.cfg keys that choose a layout or a kernel, not the model: a resume may change them.
LAYOUT_KEYS = frozenset({"moe.ep_size", "moe.grouped_gemm", "fused_cross_entropy"})


def plain_model_config(model_config) -> dict:
    """``model.cfg`` as the JSON a checkpoint records: nested keys flattened with dots, values JSON's own types
    (anything else by its text), so a recorded and a current config compare key by key."""
    if model_config is None:
        return {}
    if OmegaConf.is_config(model_config):
        model_config = OmegaConf.to_container(model_config, resolve=True)
    flat: dict = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}{k}.", v)
        else:
            flat[prefix[:-1]] = value

    walk("", dict(model_config))
    return json.loads(json.dumps(flat, default=str))


def check_model_unchanged(path: str, model_config, allowed=()) -> None:
    """Refuse to resume checkpoint ``path`` with a ``model.cfg`` other than the one it records (in one line naming
    the first key that changed), except keys in ``allowed`` (``train.resume_model_changes``); a checkpoint
    recording none (written before the record) passes."""
    recorded = read_trainer_state(path).get("model_config")
    if not isinstance(recorded, dict):
        return
    current = plain_model_config(model_config)
    allowed = {str(k).removeprefix("model.cfg.") for k in (allowed or ())} | LAYOUT_KEYS
    changed = sorted(k for k in set(recorded) | set(current)
                     if k not in allowed and recorded.get(k, "(not set)") != current.get(k, "(not set)"))
    if changed:
        key = changed[0]
        more = f" (and {len(changed) - 1} more: {', '.join(changed[1:4])})" if len(changed) > 1 else ""
        raise UsageError(
            f"--resume: model.cfg.{key}={current.get(key, '(not set)')} differs from the "
            f"{recorded.get(key, '(not set)')} checkpoint {path} was trained with{more}; resume with the run's model "
            f"settings, or train.output_dir elsewhere for a new run, or allow a deliberate change with "
            f"train.resume_model_changes=[{', '.join(changed)}]")


def write_trainer_state(directory: str, trainer_state: dict) -> dict:
    """Rank 0: write ``directory/trainer_state.json``; returns ``{name: manifest record}``."""
    text = json.dumps(trainer_state, indent=1, sort_keys=True).encode("utf-8")
    atomic_write(os.path.join(directory, TRAINER_STATE), lambda f: f.write(text))
    return {TRAINER_STATE: record_of(text)}


def rng_state() -> dict:
    """This rank's RNG states in a form `torch.load(weights_only=True)` accepts."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RngState(Stateful):
    """This rank's Python, NumPy, torch (and CUDA) RNG streams, one file per rank."""

    def state_dict(self) -> dict:
        """What ``rng_state`` captures."""
        return rng_state()

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what ``state_dict`` captured."""
        set_rng_state(state_dict)

    @staticmethod
    def file_name(rank: int) -> str:
        """The file rank ``rank`` keeps its streams in."""
        return RNG_STATE.format(rank=rank)

    def save(self, directory: str) -> dict:
        """Write this rank's file into ``directory``; returns ``{name: manifest record}``."""
        buffer = io.BytesIO()
        torch.save(self.state_dict(), buffer)
        data, name = buffer.getvalue(), self.file_name(get_rank())
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)
        return {name: record_of(data)}

    def load(self, directory: str) -> None:
        """Restore this rank's streams from ``directory`` (fresh streams, with a warning, when the
        checkpoint was saved with fewer ranks); a one-line UsageError when the file is unreadable."""
        path = os.path.join(directory, self.file_name(get_rank()))
        if not os.path.isfile(path):
            logger.warning(f"{path} not found (the checkpoint was saved with fewer ranks): RNG streams start fresh")
            return
        try:
            state = torch.load(path, weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file here means corrupt bytes
            raise UsageError(f"{path} cannot be read ({describe(e)}): the checkpoint is corrupt; {CORRUPT_FIX}") from e
        self.load_state_dict(state)


class TrainerState(Stateful):
    """The trainer's position (iteration, consumed samples: the data position), its batch and layout, the lr
    schedule and loss scale: ``trainer_state.json``, written by rank 0 and read by every rank.

    ``get()`` returns the state to save; ``put(state)`` restores one (None: the state is only written, as by a
    tool writing a checkpoint without a trainer)."""

    def __init__(self, get: Callable[[], dict], put: Callable[[dict], None] | None = None):
        self._get, self._put = get, put

    @classmethod
    def fixed(cls, state: dict) -> TrainerState:
        """A state that saves ``state`` as it is."""
        return cls(lambda: state)

    def state_dict(self) -> dict:
        """The owner's state now."""
        return self._get()

    def load_state_dict(self, state_dict: dict) -> None:
        """Hand ``state_dict`` back to the owner."""
        if self._put is not None:
            self._put(state_dict)

    def save(self, directory: str) -> dict:
        """Rank 0 writes ``directory/trainer_state.json``; returns ``{name: manifest record}`` (``{}`` elsewhere)."""
        return write_trainer_state(directory, self.state_dict()) if get_rank() == 0 else {}

    def load(self, directory: str) -> None:
        """Restore from ``directory/trainer_state.json`` (a one-line UsageError when it is missing or garbled)."""
        self.load_state_dict(read_trainer_state(directory))
