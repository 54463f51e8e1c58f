"""DCP I/O: the model and optimizer state read and written through `torch.distributed.checkpoint`.

The state is keyed by parameter name (``model.<fqn>``, ``optim.state.<fqn>.exp_avg``), so a later run can
load it under another parallel layout. ``ModelState`` gathers it from the model parts and optimizer and
loads a checkpoint into them, handling tied weights, vocabulary padding and gate/up halves.
``BackgroundWriter`` stages the state to CPU memory and writes it from a background thread whose
collectives use their own gloo group, while training goes on. Nothing here unpickles arbitrary objects.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..model import tie_weights
from ..optim.container import optimizer_parts
from ..utils.distributed import get_rank
from ..utils.errors import UsageError
from . import gate_up
from .collectives import gather
from .crc_writer import CrcFileSystemWriter, writer_threads
from .integrity import CORRUPT_FIX, check_checkpoint_shapes, describe, read_metadata, write_manifest
from .vocab_rows import fit_vocab_rows, vocab_padding_differs

logger = logging.getLogger("libai_lite")

# Optimizer state flattened to one key per parameter name ("state.<fqn>.exp_avg"), so the
# state of several model parts (pipeline stages) merges and splits by name, whatever the layout.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def async_save_wanted(value, device) -> bool:
    """``train.checkpointer.async_save``: True or False as set; None (the default) turns it on for a run on a GPU,
    where a synchronous save idles the device for the whole write, and off on the CPU, where the background
    write competes with training for the same cores."""
    return bool(value) if value is not None else torch.device(device).type == "cuda"


def default_writer_threads() -> int:
    """DCP's writer threads per rank when the config does not say (``crc_writer.writer_threads``)."""
    return writer_threads(torch.cuda.is_available())


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
        tie_weights(m)
    return model


def state_bytes(tree, local: bool = False) -> int:
    """Bytes of the tensors in a (nested) state dict at their global size, about what a save writes; with
    ``local``, of this rank's own parts, what staging copies."""
    if isinstance(tree, dict):
        return sum(state_bytes(v, local) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(state_bytes(v, local) for v in tree)
    if local and isinstance(tree, DTensor):
        tree = tree.to_local()
    return tree.numel() * tree.element_size() if isinstance(tree, torch.Tensor) else 0


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: itself, or the first one a rank reported in DCP's CheckpointException."""
    if isinstance(exc, OSError):
        return exc
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, OSError):
            return inner
    return None


def write_failure(exc: BaseException, directory: str, needed: int | None) -> str:
    """The one-line reason writing a checkpoint under ``directory`` failed; "" when ``exc`` is no write failure.

    torch.save's zip writer reports a full disk as a RuntimeError ("unexpected pos"), not an
    OSError, so a write that failed on a filesystem with less room left than the checkpoint
    needs is reported as the full disk it is.
    """
    os_error = _os_error_in(exc)
    if os_error is not None:
        return describe(os_error)
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return ""
    if needed is not None and free < needed:
        return describe(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    return ""


def first_error(errors: list) -> str:
    """The first non-empty error of a per-rank list, naming its rank when there are several ranks."""
    return next((f"{e} on rank {r}" if len(errors) > 1 else e for r, e in enumerate(errors) if e), "")


@dataclass
class InFlight:
    """A checkpoint whose files a background thread is writing into ``NAME.tmp``."""

    name: str
    # Resolves to (the first rank's error line or "", this rank's exception behind it or None),
    # the same line on every rank: the background thread agrees on it before resolving.
    future: Future
    needed: int
    started: float


class ModelState:
    """The model parts' and optimizer's state by checkpoint key: gathered for a save, loaded into in place.

    `parts` are the model parts this rank holds (pipeline stages); `optimizer` is one optimizer or an
    `OptimizersContainer` with one optimizer per part. `aliases`, `tied_copies`, `vocab_ids` and
    `model_config` are ``Checkpointer``'s arguments of those names.
    """

    def __init__(self, parts: list, optimizer=None, *, aliases: dict | None = None, tied_copies: dict | None = None,
                 vocab_ids: int | None = None, model_config=None):
        self.parts, self.optimizer = parts, optimizer
        # {name this rank holds: name to read it from}: a last pipeline stage's copy of a tied
        # weight reads the embedding's entries, which every layout saves.
        self.aliases = dict(aliases or {})
        # {copy: source} of a tied weight this rank holds twice (a V-shaped pipeline schedule): a
        # checkpoint saved with one parameter there has the optimizer state under the source only.
        self.tied_copies = dict(tied_copies or {})
        # The tokenizer's ids and model.cfg: vocabulary padding rows of another size are cut or
        # added at load, and a shape refusal names the model.cfg key that differs.
        self.vocab_ids, self.model_config = vocab_ids, model_config

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

    def state(self) -> dict:
        """``{"model": ..., "optim": ...}`` of every part, as a save writes it."""
        return self._merged(self._part_states(with_optim=True))

    def _model_keys_read(self, own: dict) -> set:
        """The checkpoint names the model reads, over every rank (a pipeline stage holds only its own)."""
        mine = sorted({self.aliases.get(k, k) for k in own} | set(own))
        return {k for keys in gather(mine) for k in keys}

    def _tied_state_to_fill(self, path: str, optim_state: dict | None) -> dict:
        """``{optimizer key of a tied copy: (its tensor or value, the source's key)}`` for the copies whose
        state the checkpoint at ``path`` lacks but holds for their source (it was saved with the two as
        one parameter): they are not read, but set from the source's loaded state, which is theirs too."""
        if not optim_state or not self.tied_copies:
            return {}
        stored = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        out = {}
        for copy, source in self.tied_copies.items():
            for prefix in ("state.", "param_groups."):
                for key in [k for k in optim_state if k.startswith(f"{prefix}{copy}.")]:
                    source_key = f"{prefix}{source}.{key[len(prefix) + len(copy) + 1:]}"
                    if f"optim.{key}" not in stored and f"optim.{source_key}" in stored and source_key in optim_state:
                        out[key] = (optim_state[key], source_key)
        return out

    def _stand_ins_for_vocab_rows(self, path: str, state: dict) -> dict:
        """Replace in ``state`` each tensor whose vocabulary padding differs from the checkpoint's
        (``vocab_padding_differs``) by a full tensor of the stored shape that DCP loads into; returns
        ``{(section, key): the replaced tensor}``, which ``fit_vocab_rows`` fills after the load."""
        rows = (self.model_config or {}).get("vocab_size")
        if self.vocab_ids is None or rows is None:
            return {}
        meta, out = read_metadata(path), {}
        for section in ("model", "optim"):
            for key, target in list(state.get(section, {}).items()):
                stored = meta.get(f"{section}.{key}")
                if (not isinstance(target, torch.Tensor) or stored is None or not hasattr(stored, "size")
                        or not vocab_padding_differs(stored.size, target.shape, self.vocab_ids, rows)):
                    continue
                local = target.to_local() if isinstance(target, DTensor) else target
                state[section][key] = torch.empty(tuple(stored.size), dtype=stored.properties.dtype,
                                                  device=local.device)
                out[(section, key)] = target
        if out:
            have = int(next(iter(meta[f"{s}.{k}"].size[0] for s, k in out)))
            logger.warning(f"checkpoint {path} has {have} vocabulary rows where this config builds {rows} "
                           f"({self.vocab_ids} tokenizer ids padded to a multiple of "
                           f"tokenization.make_vocab_size_divisible_by): padding rows "
                           f"{'cut' if have > rows else 'added'} at load, the real ids' rows kept")
        return out

    def check(self, path: str, with_optim: bool, verify: bool = True) -> tuple:
        """Refuse a checkpoint at ``path`` that is corrupt (unless not ``verify``) or does not fit the model
        (``check_checkpoint_shapes``); returns ``(part states, its DCP metadata)`` for ``load``."""
        part_states = self._part_states(with_optim=with_optim)
        own = self._merged(part_states)["model"]
        try:
            meta = read_metadata(path)
        except UsageError:
            meta = {}  # check_checkpoint_shapes names the problem
        own = gate_up.model_view(meta, own)  # a checkpoint from before gated MLPs fused gate and up
        check_checkpoint_shapes(path, own, self.aliases, all_keys=self._model_keys_read(own),
                                vocab_ids=self.vocab_ids, model_config=self.model_config, verify=verify)
        return part_states, meta

    def load(self, path: str, part_states: list, meta: dict) -> None:
        """Load the checked checkpoint at ``path`` into the model parts (and optimizers) of ``part_states``.

        Collective when distributed.
        """
        from ..parallel.pipeline_split import alias_state_dict_keys

        state = alias_state_dict_keys(self._merged(part_states), self.aliases)
        filled = self._tied_state_to_fill(path, state.get("optim"))
        for key in filled:
            state["optim"].pop(key)
        resized = self._stand_ins_for_vocab_rows(path, state)
        halves = gate_up.stand_ins(meta, state)
        try:
            dcp.load(state, checkpoint_id=path)
        except CheckpointException as e:
            failures = getattr(e, "failures", {})
            cause = next(iter(failures.values()), (e,))
            cause = cause[0] if isinstance(cause, tuple) else cause
            raise UsageError(f"checkpoint {path} cannot be loaded ({describe(cause)}): it is corrupt; "
                             f"{CORRUPT_FIX}") from e
        gate_up.join_loaded(state, halves)
        for (section, key), target in resized.items():
            state[section][key] = fit_vocab_rows(state[section][key], target, self.vocab_ids, section == "model")
        for key, (target, source_key) in filled.items():
            loaded = state["optim"][source_key]
            if isinstance(target, torch.Tensor):
                target.copy_(loaded)
                loaded = target
            state["optim"][key] = loaded
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


def staging_budget() -> int:
    """Host memory one rank's staging copy may keep between saves: a quarter of the machine's, over its local ranks."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return total // (4 * max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


class BackgroundWriter:
    """Writes one checkpoint at a time into its ``NAME.tmp`` in a background thread (DCP's ``async_save``).

    The CPU copy a save is staged into is kept for the next save while it fits ``staging_budget`` bytes,
    and released once its write is done otherwise.
    """

    def __init__(self, writer_threads: int):
        self.writer_threads = writer_threads
        self.staging_budget = staging_budget()
        self._writer: ThreadPoolExecutor | None = None
        self._writer_group = None
        self._stager: DefaultStager | None = None

    def _background_group(self):
        """A gloo group over every rank for the background write's collectives (DCP's plan exchange, the
        manifest): on the training's own group, two threads' collectives would interleave differently on
        each rank. Created at the first background save, which every rank makes."""
        if self._writer_group is None and dist.is_initialized():
            self._writer_group = dist.new_group(backend="gloo")
        return self._writer_group

    def start(self, state: dict, name: str, tmp: str, known: dict) -> tuple[Future, int]:
        """Stage ``state`` in CPU memory and hand the writing of checkpoint ``name`` into ``tmp`` to the thread.

        ``known`` holds the manifest records of the files already written there. Returns the future of
        ``_finish_writing`` and the bytes the save writes.
        """
        group = self._background_group()
        if self._stager is None:
            # It caches its CPU copy of every tensor, so later saves copy into the same memory instead
            # of allocating (and page-faulting in) a new copy each time; released after a write if too big.
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(),
                                                        use_shared_memory=False, use_async_staging=False,
                                                        use_non_blocking_copy=False))
        # Copies every tensor to CPU memory before returning, so training may change them; the
        # copy is reused only after this write is done (one save in flight at most).
        storage = CrcFileSystemWriter(tmp, thread_count=self.writer_threads)
        upload = dcp.async_save(state, checkpoint_id=tmp, storage_writer=storage, process_group=group,
                                async_stager=self._stager)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="libai_lite_checkpoint")
        needed = state_bytes(state)
        keep = state_bytes(state, local=True) <= self.staging_budget
        future = self._writer.submit(self._finish_writing, upload, tmp, needed, group,
                                     lambda: {**known, **storage.records}, keep)
        return future, needed

    def _finish_writing(self, upload: Future, tmp: str, needed: int, group, known: Callable[[], dict],
                        keep: bool) -> tuple:
        """Background thread: wait for DCP's write, agree on its outcome over ``group``, write the manifest
        (from ``known()``, the records of this rank's files checksummed as they were written).

        Returns (the first rank's error line or "", this rank's exception or None); renames nothing,
        that is the main thread's (``protocol.publish``). A failed save's ``NAME.tmp`` is removed here.
        """
        error, cause, first = "", None, ""
        try:
            upload.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported on the main thread
            error, cause = write_failure(e, tmp, needed) or describe(e), e
        try:
            first = first_error(gather(error, group))
            if not first:
                first = first_error(gather(write_manifest(tmp, group, known()), group))
            if first and get_rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
        except Exception as e:  # noqa: BLE001 - a collective that failed (a rank died) ends this save
            first, cause = first or describe(e), cause or e
        if not keep:
            # The next save waits for this one, so nothing stages into the copy while it is released.
            stager, self._stager = self._stager, None
            stager.close()
        return first, cause
