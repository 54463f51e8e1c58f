"""Checkpoints through `torch.distributed.checkpoint` that are either complete or absent.

A checkpoint is a directory `model_XXXXXXX/` holding
  - DCP files (`.metadata`, `*.distcp`) with the model and optimizer state keyed by parameter
    name, so a later run can load them under another parallel layout;
  - `trainer_state.json`: iteration, consumed samples, scheduler and loss-scaler state;
  - `rng_state_{rank}.pt`: each rank's RNG states (tensors and ints only, loaded with weights_only).
  - `manifest.json`: the size and CRC-32 of every other file, written last, so a complete
    checkpoint can be told from a partial one and flipped or truncated bytes are refused at load.

Replacing a checkpoint (`model_best`, `model_final`, a periodic one saved again) never leaves
`last_checkpoint` naming a directory that is gone for good:
  1. everything is written under `NAME.tmp/`, `manifest.json` last;
  2. an existing `NAME/` is renamed `NAME.old/`;
  3. `NAME.tmp/` is renamed `NAME/`;
  4. `last_checkpoint` (a one-line text file) is replaced, atomically;
  5. `NAME.old/` is deleted.
A crash at any point is repaired at the next start (`recover_interrupted`): a `NAME.tmp/` with
its manifest is complete and is published, a `NAME.old/` whose `NAME/` is missing is put back,
and only a `NAME.tmp/` without a manifest (never published) is deleted.

Each file's CRC-32 is computed from its bytes as they are written (``crc_writer``), so the manifest
costs no second read of the checkpoint.

With ``async_save``, step 1 runs in the background: the state is staged to CPU memory by DCP's
``async_save`` and written (its manifest then assembled) by a background thread whose
collectives use a gloo group of their own, while training goes on. Steps 2-5 run on the main
thread only once that write is complete (``Checkpointer.poll``/``wait``), so until then the
previous checkpoint is the one ``last_checkpoint`` names.
Nothing here unpickles arbitrary objects.
"""
from __future__ import annotations

import errno
import io
import json
import logging
import os
import random
import re
import shutil
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
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

from ..optim.container import optimizer_parts
from ..utils.distributed import barrier, broadcast_object, get_rank
from ..utils.errors import UsageError
from ..utils.events import format_bytes
from ..utils.files import atomic_write
from . import gate_up
from .vocab_rows import fit_vocab_rows, shape_refusal, vocab_padding_differs
from .crc_writer import CrcFileSystemWriter, record_of, writer_threads

logger = logging.getLogger("libai_lite")

LAST_CHECKPOINT = "last_checkpoint"
TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"
_ASIDE = ".old"
_PERIODIC = re.compile(r"^model_(\d{7})$")
# Optimizer state flattened to one key per parameter name ("state.<fqn>.exp_avg"), so the
# state of several model parts (pipeline stages) merges and splits by name, whatever the layout.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


# Checksums are checked at load unless the user turned that off for this process (--no-verify).
_VERIFY = {"enabled": True}
# (real path, its files' sizes and mtimes) of the checkpoints verified in this process: the engine
# checks a checkpoint before building the model and loads it after, and the files are read once.
_VERIFIED: set = set()
_CORRUPT_FIX = ("restore the directory from a copy, or resume from an earlier checkpoint (write its name into "
                "last_checkpoint); --no-verify loads it unchecked")


def set_verification(enabled: bool) -> None:
    """Check (default) or skip checking loaded checkpoints against their manifest, for this process (--no-verify)."""
    _VERIFY["enabled"] = bool(enabled)


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


def _crc32(path: str) -> str:
    """CRC-32 of a file's bytes as 8 hex digits (zlib: about 3 GB/s, so a check costs little beside the load)."""
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def resolve_async_save(value, device) -> bool:
    """``train.checkpointer.async_save``: True or False as set; None (the default) turns it on for a run on a GPU,
    where a synchronous save idles the device for the whole write, and off on the CPU, where the background
    write competes with training for the same cores."""
    return bool(value) if value is not None else torch.device(device).type == "cuda"


def _default_writer_threads() -> int:
    return writer_threads(torch.cuda.is_available())


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _gather(obj, group=None) -> list:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` without a process group).

    ``group`` spans every rank (the default group, or the background writer's copy of it).
    """
    if _world_size() == 1:
        return [obj]
    out = [None] * _world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def _spread(fn: Callable, items: list, group=None) -> list:
    """``[fn(item) for item in items]`` on every rank, each rank computing every world-size-th item.

    ``fn`` must not raise: a rank that left the collective would leave the others waiting.
    """
    world, rank = _world_size(), get_rank()
    done = {}
    for part in _gather({i: fn(items[i]) for i in range(rank, len(items), world)}, group):
        done.update(part)
    return [done[i] for i in range(len(items))]


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _file_record(path: str) -> dict:
    try:
        return {"bytes": os.path.getsize(path), "crc32": _crc32(path)}
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _write_manifest(directory: str, group=None, known: dict | None = None) -> str:
    """Write ``directory/manifest.json`` with every file's size and CRC-32 (collective over ``group``,
    all ranks); returns an error or "".

    ``known`` is this rank's ``{file name: record}`` of the files it wrote and checksummed while
    writing; only a file no rank knows, or whose size on disk differs from its record, is read back.
    """
    known = {n: r for part in _gather(dict(known or {}), group) for n, r in part.items()}
    listing = None
    if get_rank() == 0:
        names = sorted(n for n in os.listdir(directory) if n != MANIFEST and os.path.isfile(os.path.join(directory, n)))
        unknown = [n for n in names if n not in known or _size(os.path.join(directory, n)) != known[n]["bytes"]]
        listing = (names, unknown)
    if group is None:
        listing = broadcast_object(listing)
    elif _world_size() > 1:
        box = [listing]
        dist.broadcast_object_list(box, src=0, group=group)
        listing = box[0]
    names, unknown = listing
    read = dict(zip(unknown, _spread(lambda n: _file_record(os.path.join(directory, n)), unknown, group)))
    records = [read.get(n) or known[n] for n in names]
    error = next((r["error"] for r in records if "error" in r), "")
    if get_rank() == 0 and not error:
        text = json.dumps({"checksum": "crc32", "files": dict(zip(names, records))}, indent=1, sort_keys=True)
        try:
            _write_text_atomic(os.path.join(directory, MANIFEST), text)
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    return error


def _file_problem(path: str, name: str, record) -> str:
    """Why ``path/name`` differs from its manifest ``record`` ("" when it matches)."""
    full = os.path.join(path, name)
    try:
        expected_bytes, expected_crc = int(record["bytes"]), str(record["crc32"])
    except (TypeError, KeyError, ValueError):
        return f"checkpoint {path} is corrupt: its {MANIFEST} entry for {name} is garbled; {_CORRUPT_FIX}"
    try:
        size = os.path.getsize(full)
        if size != expected_bytes:
            return (f"checkpoint {path} is corrupt: {full} has {size} bytes but {expected_bytes} were saved "
                    f"(truncated or overwritten); {_CORRUPT_FIX}")
        if _crc32(full) != expected_crc:
            return (f"checkpoint {path} is corrupt: the bytes of {full} differ from those saved (CRC-32 "
                    f"mismatch); {_CORRUPT_FIX}")
    except FileNotFoundError:
        return f"checkpoint {path} is corrupt: {full}, listed in its {MANIFEST}, is missing; {_CORRUPT_FIX}"
    except OSError as e:
        return f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); {_CORRUPT_FIX}"
    return ""


def _stat_key(path: str) -> tuple:
    try:
        st = os.stat(path)
        return (st.st_size, st.st_mtime_ns, st.st_ino)
    except OSError:
        return ()


def verify_checkpoint(path: str) -> None:
    """Refuse (UsageError naming the file) a checkpoint whose files differ from its ``manifest.json``.

    Collective when distributed: each rank checks a share of the files and every rank raises the
    same first mismatch. A checkpoint saved before manifests were written loads with a warning;
    ``set_verification(False)`` (--no-verify) skips the check.
    """
    manifest = os.path.join(path, MANIFEST)
    if not _VERIFY["enabled"] or not os.path.isfile(os.path.join(path, ".metadata")):
        return  # a missing checkpoint is read_metadata's to report
    if not os.path.isfile(manifest):
        if (os.path.realpath(path), None) not in _VERIFIED:
            _VERIFIED.add((os.path.realpath(path), None))
            logger.warning(f"checkpoint {path} has no {MANIFEST} (saved by an older version): its files cannot "
                           f"be checked for corruption and are loaded as they are")
        return
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
        names = sorted(files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"checkpoint {path} is corrupt: {manifest} is unreadable ({type(e).__name__}: {e}); "
                         f"{_CORRUPT_FIX}") from None
    key = (os.path.realpath(path), tuple(_stat_key(os.path.join(path, n)) for n in [MANIFEST, *names]))
    if key in _VERIFIED:
        return
    t = time.perf_counter()
    problem = next((p for p in _spread(lambda n: _file_problem(path, n, files[n]), names) if p), "")
    if problem:
        raise UsageError(problem)
    _VERIFIED.add(key)
    total = sum(int(files[n]["bytes"]) for n in names)
    logger.info(f"Checked the {len(names)} files ({format_bytes(total)}) of {path} against its {MANIFEST} "
                f"in {time.perf_counter() - t:.2f}s")


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


def _pause_for_test(name: str, step: str) -> None:
    """Test hook: with LIBAI_LITE_TEST_PAUSE_SAVE="NAME:STEP:FLAG_FILE", rank 0 creates FLAG_FILE and waits
    forever at ``step`` of saving checkpoint NAME, so a test can kill the process exactly there."""
    spec = os.environ.get("LIBAI_LITE_TEST_PAUSE_SAVE")
    if not spec:
        return
    want_name, want_step, flag = spec.split(":", 2)
    if (want_name, want_step) == (name, step):
        open(flag, "w").close()
        while True:
            time.sleep(1)


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


def _interrupted(save_dir: str, name: str, marker: str | None) -> str | None:
    """What a killed save left for checkpoint ``name``: "publish" (``NAME.tmp`` is complete),
    "restore" (``NAME.old`` is the only complete copy) or None."""
    final, tmp, aside = (os.path.join(save_dir, name + suffix) for suffix in ("", ".tmp", _ASIDE))
    if is_complete(tmp) and (
        os.path.isfile(os.path.join(tmp, MANIFEST))
        # Saved by a version without manifests, killed between deleting NAME and renaming NAME.tmp.
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
    """Repair what a save killed part-way left in ``save_dir`` (rank 0, holding the directory's lock).

    A ``NAME.tmp/`` holding its manifest was completely written: it is published as the save would
    have done. A ``NAME.old/`` whose ``NAME/`` is gone is put back; one beside a complete ``NAME/``
    was replaced and is deleted. With ``remove_partial``, a ``NAME.tmp/`` without a manifest (never
    published, so nothing names it) is deleted. ``last_checkpoint`` is left alone: it names a
    complete checkpoint, or one this repair puts back, at every step of the save. Raises OSError
    when the disk refuses a rename.
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


def read_metadata(path: str) -> dict:
    """The DCP metadata of checkpoint ``path`` by key; a one-line UsageError when it is missing or unreadable."""
    from .foreign import foreign_checkpoint_error

    foreign = foreign_checkpoint_error(path)
    if foreign:  # another framework's checkpoint is named, not called incomplete or corrupt
        raise UsageError(foreign)
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


def check_checkpoint_shapes(path: str, model_state: dict, aliases: dict | None = None,
                            all_keys: set | None = None, vocab_ids: int | None = None,
                            model_config=None) -> None:
    """Refuse (UsageError naming the first mismatch) a checkpoint that does not fit the model exactly.

    Its files must match its manifest (``verify_checkpoint``, collective when distributed), every
    tensor of ``model_state`` must be stored at its global shape, and no model tensor may be stored
    that the model lacks. ``model_state`` maps FQNs to tensors, DTensors or meta tensors (a model
    built on the meta device checks a checkpoint before any data or weights are touched);
    ``all_keys`` (the names read, over all ranks) replaces its keys in the last check when this
    rank holds only part of the model (a pipeline stage). With ``vocab_ids`` (the tokenizer's ids)
    and ``model_config`` (``model.cfg``), vocabulary rows that differ only in padding are accepted
    (``Checkpointer.load`` cuts or adds them) and a refusal names the ``model.cfg`` key that differs.
    """
    aliases = aliases or {}
    verify_checkpoint(path)
    meta = read_metadata(path)
    vocab_rows = (model_config or {}).get("vocab_size")
    for key, tensor in model_state.items():
        stored = meta.get(f"model.{aliases.get(key, key)}")
        if stored is None:
            raise UsageError(f"checkpoint {path} has no parameter '{key}': it was saved from another model or model "
                             f"size; check train.load_weight and model.cfg")
        # A DTensor's shape is the global one.
        shape, full = tuple(getattr(stored, "size", ())), tuple(tensor.shape)
        if shape != full and not vocab_padding_differs(shape, full, vocab_ids, vocab_rows):
            raise UsageError(f"checkpoint {path} {shape_refusal(key, shape, full, vocab_ids, model_config)}")
    # A tied copy (a pipeline stage's LM head) reads its source's entry, but a checkpoint saved
    # under pipeline parallelism stores the copy under its own name too: both are the model's.
    expected = all_keys if all_keys is not None else {aliases.get(k, k) for k in model_state} | set(model_state)
    stored_model = [k[len("model."):] for k in meta if k.startswith("model.")]
    extra = next((k for k in stored_model if k not in expected), None)
    if extra is not None:
        raise UsageError(f"checkpoint {path} holds '{extra}', which this config does not build: the checkpoint is of "
                         f"a larger or another model; make model.cfg match it (e.g. model.cfg.hidden_layers)")


def _state_bytes(tree) -> int:
    """Bytes of the tensors in a (nested) state dict at their global size: about what a save writes."""
    if isinstance(tree, dict):
        return sum(_state_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_state_bytes(v) for v in tree)
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


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _write_failure(exc: BaseException, directory: str, needed: int | None) -> str:
    """The one-line reason writing a checkpoint under ``directory`` failed; "" when ``exc`` is no write failure.

    torch.save's zip writer reports a full disk as a RuntimeError ("unexpected pos"), not an
    OSError, so a write that failed on a filesystem with less room left than the checkpoint
    needs is reported as the full disk it is.
    """
    os_error = _os_error_in(exc)
    if os_error is not None:
        return _describe(os_error)
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return ""
    if needed is not None and free < needed:
        return _describe(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    return ""


def _first_error(errors: list) -> str:
    """The first non-empty error of a per-rank list, naming its rank when there are several ranks."""
    return next((f"{e} on rank {r}" if len(errors) > 1 else e for r, e in enumerate(errors) if e), "")


@dataclass
class _InFlight:
    """A checkpoint whose files a background thread is writing into ``NAME.tmp``."""

    name: str
    replacing: bool
    # Resolves to (the first rank's error line or "", this rank's exception behind it or None),
    # the same line on every rank: the background thread agrees on it before resolving.
    future: Future
    needed: int
    started: float


class Checkpointer:
    """Saves and loads model, optimizer and trainer state under `save_dir`.

    `model` is a module or a list of model parts (the pipeline stages this rank holds);
    `optimizer` is one optimizer or an `OptimizersContainer` with one optimizer per part.
    With `async_save`, `save` returns once the state is copied to CPU memory and the files are
    written in the background; `poll` (each step) or `wait` publishes the checkpoint when they are.
    """

    def __init__(self, model, optimizer=None, save_dir: str = "", max_to_keep: int | None = None,
                 aliases: dict | None = None, async_save: bool = False, tied_copies: dict | None = None,
                 vocab_ids: int | None = None, model_config=None, writer_threads: int | None = None):
        self.parts = list(model) if isinstance(model, (list, tuple)) else [model]
        self.optimizer = optimizer
        self.save_dir = save_dir
        self.max_to_keep = max_to_keep
        # {name this rank holds: name to read it from}: a last pipeline stage's copy of a tied
        # weight reads the embedding's entries, which every layout saves.
        self.aliases = dict(aliases or {})
        # {copy: source} of a tied weight this rank holds twice (a V-shaped pipeline schedule): a
        # checkpoint saved with one parameter there has the optimizer state under the source only.
        self.tied_copies = dict(tied_copies or {})
        self.async_save = bool(async_save)
        # DCP's writer threads per rank (each writes its own file): see crc_writer.writer_threads.
        self.writer_threads = int(writer_threads or _default_writer_threads())
        # The tokenizer's ids and model.cfg: vocabulary padding rows of another size are cut or
        # added at load, and a shape refusal names the model.cfg key that differs.
        self.vocab_ids, self.model_config = vocab_ids, model_config
        self._in_flight: _InFlight | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._writer_group = None
        self._stager: DefaultStager | None = None
        self._last_cause: BaseException | None = None

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

    def _storage_writer(self, tmp: str) -> CrcFileSystemWriter:
        """DCP's file writer for ``tmp`` with this run's threads, checksumming as it writes."""
        return CrcFileSystemWriter(tmp, thread_count=self.writer_threads)

    @staticmethod
    def _write_own_files(tmp: str, trainer_state: dict) -> dict:
        """Write this rank's RNG state and (rank 0) the trainer state into ``tmp``; returns their manifest records."""
        buffer = io.BytesIO()
        torch.save(rng_state(), buffer)
        rng, name = buffer.getvalue(), f"rng_state_{get_rank()}.pt"
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(rng)
        out = {name: record_of(rng)}
        if get_rank() == 0:
            text = json.dumps(trainer_state, indent=1, sort_keys=True).encode("utf-8")
            atomic_write(os.path.join(tmp, TRAINER_STATE), lambda f: f.write(text))
            out[TRAINER_STATE] = record_of(text)
        return out

    def save(self, name: str, trainer_state: dict, blocking: bool = False) -> str:
        """Write checkpoint `name` with the given trainer state; returns its final path.

        Collective. A failure to write (full disk, read-only or over-quota filesystem) on any rank
        removes the partial files and raises a UsageError on every rank; the previous checkpoints
        and ``last_checkpoint`` are untouched. With ``async_save`` and not ``blocking``, returns
        once the state is staged in CPU memory: the checkpoint is published, or its failure raised,
        by a later ``poll``, ``wait`` or ``save``. A save still in flight is finished first.
        """
        if self.async_save:
            self.wait()
        final = os.path.join(self.save_dir, name)
        tmp = final + ".tmp"
        rank = get_rank()
        # Test hooks pause only a save that replaces an existing checkpoint (the dangerous case).
        replacing = os.path.isdir(final)
        error = ""
        if rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            except OSError as e:
                error = _describe(e)
        self._raise_if_failed(error, final, None)
        if self.async_save and not blocking:
            self._start_background_save(name, trainer_state, replacing)
            return final
        state, known = None, {}
        try:
            state = self._merged(self._part_states(with_optim=True))
            storage = self._storage_writer(tmp)
            dcp.save(state, checkpoint_id=tmp, storage_writer=storage)
            known = {**storage.records, **self._write_own_files(tmp, trainer_state)}
        except (OSError, RuntimeError, CheckpointException) as e:
            # DCP reports a rank's failed write as a CheckpointException (a BaseException) on every rank.
            error = _write_failure(e, tmp, _state_bytes(state) if state is not None else None)
            if not error:
                if rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
        # Also the barrier before the manifest: every rank has written all its files.
        self._raise_if_failed(error, final, state)
        if replacing and rank == 0:
            _pause_for_test(name, "partial")
        # Written last: its presence is what makes the directory a complete checkpoint.
        self._raise_if_failed(_write_manifest(tmp, known=known), final, state)
        if rank == 0:
            error = self._publish(name, replacing)
        self._raise_if_failed(error, final, state)
        return final

    def _publish(self, name: str, replacing: bool) -> str:
        """Rank 0: move the complete ``NAME.tmp`` into place (steps 2-5 of the module docstring).

        Returns the error that stopped it, or "".
        """
        final = os.path.join(self.save_dir, name)
        tmp, aside = final + ".tmp", final + _ASIDE
        pause = _pause_for_test if replacing else (lambda *_: None)
        try:
            pause(name, "written")
            shutil.rmtree(aside, ignore_errors=True)
            if os.path.isdir(final):
                os.replace(final, aside)
                pause(name, "aside")
            os.replace(tmp, final)
            _fsync_dir(self.save_dir)
            pause(name, "published")
            _write_text_atomic(os.path.join(self.save_dir, LAST_CHECKPOINT), name)
            pause(name, "marked")
            shutil.rmtree(aside, ignore_errors=True)
            self._prune(keep=name)
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
            return _describe(e)

    def _raise_if_failed(self, error: str, final: str, state, cause: BaseException | None = None) -> None:
        """Collective: when any rank reports ``error``, remove the partial save and raise the first one everywhere."""
        first = _first_error(_gather(error))
        if not first:
            return
        if get_rank() == 0:
            shutil.rmtree(final + ".tmp", ignore_errors=True)
        barrier()
        raise self._save_failed(first, final, _state_bytes(state) if state is not None else None) from cause

    def _save_failed(self, first: str, final: str, needed: int | None) -> UsageError:
        """The one-line error of a failed save of ``final`` whose partial files are already removed."""
        space = ""
        try:
            space = f"{format_bytes(shutil.disk_usage(self.save_dir).free)} are free there; "
            if needed is not None:
                space = f"it needs about {format_bytes(needed)} and {space}"
        except OSError:
            pass
        previous = self.last_checkpoint()
        kept = f"the previous checkpoint {previous} is kept" if previous else "no earlier checkpoint exists"
        return UsageError(
            f"saving checkpoint {final} failed ({first}); {space}the partial files were removed and {kept}: "
            f"free disk space in {self.save_dir} or point train.output_dir elsewhere, then --resume"
        )

    # ------------------------------------------------------------------ background saves
    def _background_group(self):
        """A gloo group over every rank for the background write's collectives (DCP's plan exchange, the
        manifest): on the training's own group, two threads' collectives would interleave differently on
        each rank. Created at the first background save, which every rank makes."""
        if self._writer_group is None and dist.is_initialized():
            self._writer_group = dist.new_group(backend="gloo")
        return self._writer_group

    def _start_background_save(self, name: str, trainer_state: dict, replacing: bool) -> None:
        """Stage the state in CPU memory and hand the writing of ``NAME.tmp`` to a background thread."""
        final = os.path.join(self.save_dir, name)
        tmp, rank = final + ".tmp", get_rank()
        group = self._background_group()
        state, error, cause = None, "", None
        known = {}
        try:
            state = self._merged(self._part_states(with_optim=True))
            # The small files now, while the RNG and trainer state are those of this step.
            known = self._write_own_files(tmp, trainer_state)
        except (OSError, RuntimeError) as e:
            # As in the synchronous save: what is no write failure is a bug, raised as it is.
            error = _write_failure(e, tmp, _state_bytes(state) if state is not None else None)
            if not error:
                if rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
            cause = e
        # Agreed before any rank starts the background write, whose collectives would otherwise
        # wait for a rank that gave up here.
        self._raise_if_failed(error, final, state, cause)
        if self._stager is None:
            # Kept for the run: it caches its CPU copy of every tensor, so later saves copy into
            # the same memory instead of allocating (and page-faulting in) a new copy each time.
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(),
                                                        use_shared_memory=False, use_async_staging=False,
                                                        use_non_blocking_copy=False))
        # Copies every tensor to CPU memory before returning, so training may change them; the
        # copy is reused only after this write is done (one save in flight at most).
        storage = self._storage_writer(tmp)
        upload = dcp.async_save(state, checkpoint_id=tmp, storage_writer=storage, process_group=group,
                                async_stager=self._stager)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="libai_lite_checkpoint")
        needed = _state_bytes(state)
        future = self._writer.submit(self._finish_writing, upload, name, tmp, needed, group,
                                     lambda: {**known, **storage.records})
        self._in_flight = _InFlight(name, replacing, future, needed, time.perf_counter())

    def _finish_writing(self, upload: Future, name: str, tmp: str, needed: int, group,
                        known: Callable[[], dict]) -> tuple:
        """Background thread: wait for DCP's write, agree on its outcome over ``group``, write the manifest
        (from ``known()``, the records of this rank's files checksummed as they were written).

        Returns (the first rank's error line or "", this rank's exception or None); renames nothing,
        that is the main thread's (``_publish``). A failed save's ``NAME.tmp`` is removed here.
        """
        error, cause, first = "", None, ""
        try:
            upload.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported on the main thread
            error, cause = _write_failure(e, tmp, needed) or _describe(e), e
        try:
            first = _first_error(_gather(error, group))
            if not first:
                if get_rank() == 0:
                    _pause_for_test(name, "background")
                first = _first_error(_gather(_write_manifest(tmp, group, known()), group))
            if first and get_rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
        except Exception as e:  # noqa: BLE001 - a collective that failed (a rank died) ends this save
            first, cause = first or _describe(e), cause or e
        return first, cause

    def _finish(self) -> str:
        """Take the save in flight (its write done) off the books; rank 0 publishes it. Returns an error or ""."""
        job, self._in_flight = self._in_flight, None
        error, self._last_cause = job.future.result()
        if not error and get_rank() == 0:
            error = self._publish(job.name, job.replacing)
            if error:
                shutil.rmtree(os.path.join(self.save_dir, job.name + ".tmp"), ignore_errors=True)
                error += " on rank 0" if _world_size() > 1 else ""
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

        Does not block and is not collective: the save's outcome is the same on every rank, but
        ranks may observe it at different steps. A failed write raises the UsageError ``save``
        would have raised, on this rank only; the trainer stops every rank with it at the step
        boundary (``libai_lite.utils.process.fail_at_step_boundary``).
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

        Collective unless ``collective`` is False (a rank leaving on an exception, alone): a
        failure raises the same UsageError on every rank, also on one whose ``poll`` already
        took the save off its books.
        """
        job = self._in_flight
        outcome = ("", None, None)
        if job is not None:
            outcome = (self._finish(), os.path.join(self.save_dir, job.name), job.needed)
        outcomes = _gather(outcome) if collective else [outcome]
        # The background write's error already names its rank, and a failed publish names rank 0.
        error, final, needed = next((o for o in outcomes if o[0]), outcome)
        if error:
            raise self._save_failed(error, final, needed) from (self._last_cause if job is not None else None)
        return outcome[1]

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
        """Rank 0 at start-up: finish or undo a save a killed run left half done, and delete never-published
        ``*.tmp`` directories (``recover_interrupted``); no complete checkpoint is deleted."""
        if get_rank() != 0:
            return
        try:
            recover_interrupted(self.save_dir, remove_partial=True)
        except OSError as e:
            raise UsageError(f"cannot repair the checkpoints an interrupted save left in {self.save_dir} "
                             f"({_describe(e)}): check the permissions and free space there") from None

    def _model_keys_read(self, own: dict) -> set:
        """The checkpoint names the model reads, over every rank (a pipeline stage holds only its own)."""
        mine = sorted({self.aliases.get(k, k) for k in own} | set(own))
        return {k for keys in _gather(mine) for k in keys}

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

    def load(self, path: str, weights_only: bool = False) -> dict:
        """Load a checkpoint into the model (and optimizer, RNG unless `weights_only`); returns trainer state.

        Collective when distributed. The checkpoint is verified first (``check_checkpoint_shapes``):
        corrupt files or tensors that do not fit the model are refused in one line.
        """
        from ..parallel.pipeline_split import alias_state_dict_keys

        full = not weights_only and self.optimizer is not None
        part_states = self._part_states(with_optim=full)
        own = self._merged(part_states)["model"]
        try:
            meta = read_metadata(path)
        except UsageError:
            meta = {}  # check_checkpoint_shapes names the problem
        own = gate_up.model_view(meta, own)  # a checkpoint from before gated MLPs fused gate and up
        check_checkpoint_shapes(path, own, self.aliases, all_keys=self._model_keys_read(own),
                                vocab_ids=self.vocab_ids, model_config=self.model_config)
        trainer_state = read_trainer_state(path) if full else {}
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
            raise UsageError(f"checkpoint {path} cannot be loaded ({_describe(cause)}): it is corrupt; "
                             f"{_CORRUPT_FIX}") from e
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
        if full:
            rng_path = os.path.join(path, f"rng_state_{get_rank()}.pt")
            if os.path.isfile(rng_path):
                try:
                    rng = torch.load(rng_path, weights_only=True)
                except Exception as e:  # noqa: BLE001 - any unreadable file here means corrupt bytes
                    raise UsageError(f"{rng_path} cannot be read ({_describe(e)}): the checkpoint is corrupt; "
                                     f"{_CORRUPT_FIX}") from e
                set_rng_state(rng)
            else:
                logger.warning(f"{rng_path} not found (the checkpoint was saved with fewer ranks): "
                               f"RNG streams start fresh")
        return trainer_state


def _resume_verdict(save_dir: str) -> tuple[str | None, str | None]:
    """Rank 0: ``(checkpoint to resume from or None, error or None)``, reading only.

    After a save killed part-way, the checkpoint ``last_checkpoint`` names may still be in
    ``NAME.tmp/`` or ``NAME.old/``: that directory is loaded, and renamed to ``NAME/`` only once this
    run holds the output directory (``Checkpointer.remove_partial``), so a run refused as a second
    one in the directory changes nothing.
    """
    name = _read_marker(save_dir)
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


def resolve_resume(save_dir: str) -> str | None:
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
