"""Checkpoints through `torch.distributed.checkpoint` that are either complete or absent.

A checkpoint is a directory `model_XXXXXXX/` holding
  - DCP files (`.metadata`, `*.distcp`) with the model and optimizer state keyed by parameter
    name, so a later run can load them under another parallel layout;
  - `trainer_state.json`: iteration, consumed samples, scheduler and loss-scaler state;
  - `rng_state_{rank}.pt`: each rank's RNG states (tensors and ints only, loaded with weights_only).
It is written under `model_XXXXXXX.tmp/` and renamed when every rank has finished; only then is
`last_checkpoint` (a one-line text file) replaced. Nothing here unpickles arbitrary objects.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..optim.container import optimizer_parts
from ..utils.distributed import all_reduce_max, barrier, broadcast_object, get_rank
from ..utils.errors import UsageError

logger = logging.getLogger("libai_lite")

LAST_CHECKPOINT = "last_checkpoint"
TRAINER_STATE = "trainer_state.json"
_PERIODIC = re.compile(r"^model_(\d{7})$")
# Optimizer state flattened to one key per parameter name ("state.<fqn>.exp_avg"), so the
# state of several model parts (pipeline stages) merges and splits by name, whatever the layout.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _write_text_atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


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


def is_complete(path: str) -> bool:
    """A checkpoint directory is usable when its DCP metadata and trainer state are both there."""
    return os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, TRAINER_STATE))


def _read_marker(save_dir: str) -> str | None:
    """The checkpoint name written in ``save_dir/last_checkpoint``; None when there is no such file."""
    marker = os.path.join(save_dir, LAST_CHECKPOINT)
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        return f.read().strip()


def read_metadata(path: str) -> dict:
    """The DCP metadata of checkpoint ``path`` by key; a one-line UsageError when it is missing or unreadable."""
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, ".metadata")):
        raise UsageError(f"checkpoint {path} is missing or incomplete (no .metadata): point to a complete "
                         f"checkpoint directory (model_XXXXXXX or model_final)")
    try:
        return dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - any unreadable metadata means a corrupt checkpoint
        raise UsageError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); "
                         f"point to a complete checkpoint directory") from e


def stored_rows(path: str, names: Sequence[str], hint: str) -> int:
    """First dimension of the first of ``names`` (model parameter names) stored in checkpoint ``path``.

    For the token embedding: the vocabulary the run padded to (a tp=2 run pads to a multiple of 256).
    """
    meta = read_metadata(path)
    for name in names:
        if f"model.{name}" in meta:
            return int(meta[f"model.{name}"].size[0])
    raise UsageError(f"checkpoint {path} has no '{names[0] if names else 'token embedding'}': {hint}")


def build_empty(build: Callable[[], nn.Module], device="cpu") -> nn.Module:
    """``build()`` on ``device`` without drawing the random init a checkpoint overwrites anyway.

    Built on the meta device, then given empty storage; a module with buffers (which checkpoints
    do not hold) is built for real instead.
    """
    with torch.device("meta"):
        model = build()
    if any(True for _ in model.buffers()):
        return build().to(device)
    model.to_empty(device=device)
    # to_empty swaps parameters one module at a time, which unties a shared LM head.
    for m in model.modules():
        if callable(getattr(m, "tie_weights", None)):
            m.tie_weights()
    return model


def check_checkpoint_shapes(path: str, model_state: dict, aliases: dict | None = None) -> None:
    """Refuse (UsageError) a checkpoint that is unreadable or lacks a tensor of ``model_state`` at its global shape.

    ``model_state`` maps FQNs to tensors, DTensors or meta tensors (a model built on the meta
    device checks a checkpoint before any data or weights are touched).
    """
    meta = read_metadata(path)
    for key, tensor in model_state.items():
        stored = meta.get(f"model.{(aliases or {}).get(key, key)}")
        if stored is None:
            raise UsageError(f"checkpoint {path} has no parameter '{key}': it was saved from another model; "
                             f"check train.load_weight and model.cfg")
        # A DTensor's shape is the global one.
        shape, full = tuple(getattr(stored, "size", ())), tuple(tensor.shape)
        if shape != full:
            raise UsageError(
                f"checkpoint {path} holds '{key}' with shape {list(shape)} but this config builds {list(full)}: "
                f"the checkpoint is of another model shape; make model.cfg match it"
            )


class Checkpointer:
    """Saves and loads model, optimizer and trainer state under `save_dir`.

    `model` is a module or a list of model parts (the pipeline stages this rank holds);
    `optimizer` is one optimizer or an `OptimizersContainer` with one optimizer per part.
    """

    def __init__(self, model, optimizer=None, save_dir: str = "", max_to_keep: int | None = None,
                 aliases: dict | None = None):
        self.parts = list(model) if isinstance(model, (list, tuple)) else [model]
        self.optimizer = optimizer
        self.save_dir = save_dir
        self.max_to_keep = max_to_keep
        # {name this rank holds: name to read it from}: a last pipeline stage's copy of a tied
        # weight reads the embedding's entries, which every layout saves.
        self.aliases = dict(aliases or {})

    def _part_states(self, with_optim: bool) -> list:
        """``(part, optimizer or None, model state, optimizer state or None)`` for each part."""
        optims = optimizer_parts(self.optimizer) if with_optim else []
        if not optims:
            return [(part, None, get_model_state_dict(part), None) for part in self.parts]
        return [(part, optim, *get_state_dict(part, optim, options=_FLAT)) for part, optim in zip(self.parts, optims)]

    @staticmethod
    def _merged(part_states: list) -> dict:
        """``{"model": ..., "optim": ...}`` of all parts, merged by name (no "optim" without an optimizer)."""
        state = {"model": {k: v for s in part_states for k, v in s[2].items()}}
        if part_states and part_states[0][3] is not None:
            state["optim"] = {k: v for s in part_states for k, v in s[3].items()}
        return state

    def save(self, name: str, trainer_state: dict) -> str:
        """Write checkpoint `name` with the given trainer state; returns its final path."""
        final = os.path.join(self.save_dir, name)
        tmp = final + ".tmp"
        rank = get_rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        barrier()
        error = ""
        try:
            dcp.save(self._merged(self._part_states(with_optim=True)), checkpoint_id=tmp)
            torch.save(rng_state(), os.path.join(tmp, f"rng_state_{rank}.pt"))
            if rank == 0:
                text = json.dumps(trainer_state, indent=1, sort_keys=True)
                _write_text_atomic(os.path.join(tmp, TRAINER_STATE), text)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
        if all_reduce_max([float(bool(error))])[0]:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            barrier()
            previous = self.last_checkpoint()
            kept = f"the previous checkpoint {previous} is kept" if previous else "no earlier checkpoint exists"
            raise UsageError(
                f"saving checkpoint {final} failed ({error or 'on another rank'}); the partial files were removed "
                f"and {kept}: free disk space in {self.save_dir} or point train.output_dir elsewhere, then --resume"
            )
        if rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _write_text_atomic(os.path.join(self.save_dir, LAST_CHECKPOINT), name)
            self._prune(keep=name)
        barrier()
        return final

    def _prune(self, keep: str) -> None:
        if not self.max_to_keep or self.max_to_keep <= 0:
            return
        periodic = sorted(
            d for d in os.listdir(self.save_dir)
            if _PERIODIC.match(d) and is_complete(os.path.join(self.save_dir, d))
        )
        # The checkpoint just written is never deleted, whatever max_to_keep says.
        doomed = [d for d in periodic[: max(len(periodic) - self.max_to_keep, 0)] if d != keep]
        for d in doomed:
            shutil.rmtree(os.path.join(self.save_dir, d), ignore_errors=True)
            logger.info(f"Removed old checkpoint {d} (train.checkpointer.max_to_keep={self.max_to_keep})")

    def last_checkpoint(self) -> str | None:
        """Path of the checkpoint named in `last_checkpoint`, or None."""
        name = _read_marker(self.save_dir)
        return os.path.join(self.save_dir, name) if name else None

    def remove_partial(self) -> None:
        """Delete `*.tmp` checkpoint directories left by a run killed while saving (rank 0 only)."""
        if get_rank() != 0 or not os.path.isdir(self.save_dir):
            return
        for d in sorted(os.listdir(self.save_dir)):
            path = os.path.join(self.save_dir, d)
            if d.endswith(".tmp") and os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
                logger.warning(f"Removed partial checkpoint {path} left by an interrupted save")

    def load(self, path: str, weights_only: bool = False) -> dict:
        """Load a checkpoint into the model (and optimizer, RNG unless `weights_only`); returns trainer state."""
        from ..parallel.pipeline_split import alias_state_dict_keys

        full = not weights_only and self.optimizer is not None
        part_states = self._part_states(with_optim=full)
        check_checkpoint_shapes(path, self._merged(part_states)["model"], self.aliases)
        trainer_state = {}
        if full:
            if not os.path.isfile(os.path.join(path, TRAINER_STATE)):
                raise UsageError(f"checkpoint {path} has no {TRAINER_STATE}: it is incomplete; "
                                 f"remove it to resume from an earlier one")
            with open(os.path.join(path, TRAINER_STATE)) as f:
                trainer_state = json.load(f)
        state = alias_state_dict_keys(self._merged(part_states), self.aliases)
        dcp.load(state, checkpoint_id=path)
        # Non-tensor entries are replaced, not loaded in place: take every part's keys from the loaded dict.
        state = alias_state_dict_keys(state, {v: k for k, v in self.aliases.items()})
        strict = StateDictOptions(strict=True, flatten_optimizer_state_dict=True)
        for part, optim, own_model, own_optim in part_states:
            model_sd = {k: state["model"][k] for k in own_model}
            if own_optim is None:
                set_model_state_dict(part, model_sd, options=strict)
            else:
                set_state_dict(part, optim, model_state_dict=model_sd,
                               optim_state_dict={k: state["optim"][k] for k in own_optim}, options=strict)
        if full:
            rng_path = os.path.join(path, f"rng_state_{get_rank()}.pt")
            if os.path.isfile(rng_path):
                set_rng_state(torch.load(rng_path, weights_only=True))
            else:
                logger.warning(f"{rng_path} not found (the checkpoint was saved with fewer ranks): "
                               f"RNG streams start fresh")
        return trainer_state


def resolve_resume(save_dir: str) -> str | None:
    """The checkpoint `--resume` should continue from, agreed by all ranks (None: start fresh).

    Rank 0 reads the directory and every rank gets its verdict, so a corrupt checkpoint stops
    all ranks with the same message instead of leaving the others waiting.
    """
    verdict: tuple[str | None, str | None] = (None, None)
    name = _read_marker(save_dir) if get_rank() == 0 else None
    if name is not None:
        marker, path = os.path.join(save_dir, LAST_CHECKPOINT), os.path.join(save_dir, name)
        verdict = (path, None) if is_complete(path) else (None, (
            f"{marker} names {path}, which is missing or incomplete: the checkpoint is corrupt; "
            f"write the name of an earlier complete model_XXXXXXX directory into {marker}, "
            f"or start without --resume"
        ))
    path, error = broadcast_object(verdict)
    if error:
        raise UsageError(error)
    return path
