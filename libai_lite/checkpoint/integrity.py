"""A checkpoint's integrity: its manifest (size and CRC-32 of every file, written last), the check of
its files against it at load, and the check that its tensors fit the model being loaded.

Each file's CRC-32 is computed from its bytes as they are written (``crc_writer``), so the manifest
costs no second read of the checkpoint. Whether a load checks the files is the caller's argument
(``verify``; the command line's ``--no-verify`` turns it off), not a setting of the process.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
import zlib
from typing import Sequence

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..utils.distributed import broadcast_object, get_rank
from ..utils.errors import UsageError
from ..utils.events import format_bytes
from ..utils.files import atomic_write
from ..utils.plugins import plugins
from .collectives import gather, spread, world_size
from .vocab_rows import shape_refusal, vocab_padding_differs

logger = logging.getLogger("libai_lite")

MANIFEST = "manifest.json"
# The trainer's and each rank's RNG state files (``trainer_state``), which a load needs besides DCP's.
TRAINER_STATE = "trainer_state.json"
RNG_STATE = "rng_state_{rank}.pt"
_RNG_FILE = re.compile(re.escape(RNG_STATE).replace(re.escape("{rank}"), r"\d+"))
# Plugins naming other frameworks' checkpoints: each maps a path to its one-line refusal, or None.
FORMATS_GROUP = "libai_lite.checkpoint_formats"
# (real path, its files' sizes and mtimes, its listing) of the checkpoints verified in this process: the engine
# checks a checkpoint before building the model and loads it after, and the files are read once.
_VERIFIED: set = set()
CORRUPT_FIX = ("restore the directory from a copy, or resume from an earlier checkpoint (write its name into "
               "last_checkpoint); --no-verify loads it unchecked")


def describe(exc: BaseException) -> str:
    """``exc`` as one line: its type and the first line of its message."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _crc32(path: str) -> str:
    """CRC-32 of a file's bytes as 8 hex digits (zlib's: cheap beside reading the file)."""
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


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


def write_manifest(directory: str, group=None, known: dict | None = None) -> str:
    """Write ``directory/manifest.json`` with every file's size and CRC-32 (collective over ``group``,
    all ranks); returns an error or "".

    ``known`` is this rank's ``{file name: record}`` of the files it wrote and checksummed while
    writing; only a file no rank knows, or whose size on disk differs from its record, is read back.
    """
    known = {n: r for part in gather(dict(known or {}), group) for n, r in part.items()}
    listing = None
    if get_rank() == 0:
        names = sorted(n for n in os.listdir(directory) if n != MANIFEST and os.path.isfile(os.path.join(directory, n)))
        unknown = [n for n in names if n not in known or _size(os.path.join(directory, n)) != known[n]["bytes"]]
        listing = (names, unknown)
    if group is None:
        listing = broadcast_object(listing)
    elif world_size() > 1:
        box = [listing]
        dist.broadcast_object_list(box, src=0, group=group)
        listing = box[0]
    names, unknown = listing
    read = dict(zip(unknown, spread(lambda n: _file_record(os.path.join(directory, n)), unknown, group)))
    records = [read.get(n) or known[n] for n in names]
    error = next((r["error"] for r in records if "error" in r), "")
    if get_rank() == 0 and not error:
        text = json.dumps({"checksum": "crc32", "files": dict(zip(names, records))}, indent=1, sort_keys=True)
        try:
            atomic_write(os.path.join(directory, MANIFEST), lambda f: f.write(text), mode="w")
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
    return error


def _file_problem(path: str, name: str, record) -> str:
    """Why ``path/name`` differs from its manifest ``record`` ("" when it matches)."""
    full = os.path.join(path, name)
    try:
        expected_bytes, expected_crc = int(record["bytes"]), str(record["crc32"])
    except (TypeError, KeyError, ValueError):
        return f"checkpoint {path} is corrupt: its {MANIFEST} entry for {name} is garbled; {CORRUPT_FIX}"
    try:
        size = os.path.getsize(full)
        if size != expected_bytes:
            return (f"checkpoint {path} is corrupt: {full} has {size} bytes but {expected_bytes} were saved "
                    f"(truncated or overwritten); {CORRUPT_FIX}")
        if _crc32(full) != expected_crc:
            return (f"checkpoint {path} is corrupt: the bytes of {full} differ from those saved (CRC-32 "
                    f"mismatch); {CORRUPT_FIX}")
    except FileNotFoundError:
        return f"checkpoint {path} is corrupt: {full}, listed in its {MANIFEST}, is missing; {CORRUPT_FIX}"
    except OSError as e:
        return f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); {CORRUPT_FIX}"
    return ""


def _stat_key(path: str) -> tuple:
    try:
        st = os.stat(path)
        return (st.st_size, st.st_mtime_ns, st.st_ino)
    except OSError:
        return ()


def foreign_checkpoint_error(path: str) -> str | None:
    """The refusal of ``path`` by the first installed plugin that knows it as another framework's checkpoint."""
    for recognise in plugins(FORMATS_GROUP):
        refusal = recognise(path)
        if refusal:
            return refusal
    return None


def needed_files(path: str) -> list:
    """The files checkpoint ``path`` cannot be loaded without, found from the checkpoint itself, not from its
    manifest: ``.metadata``, every storage file its DCP metadata names, the trainer state and the RNG files there."""
    try:
        storage = dcp.FileSystemReader(path).read_metadata().storage_data
        shards = {info.relative_path for info in storage.values()}
    except Exception as e:  # noqa: BLE001 - any unreadable metadata means a corrupt checkpoint
        raise UsageError(f"checkpoint {path} cannot be read ({describe(e)}); {CORRUPT_FIX}") from None
    rng = {n for n in os.listdir(path) if _RNG_FILE.fullmatch(n)}
    return sorted({".metadata", TRAINER_STATE, *shards, *rng})


def _unlisted(path: str, name: str) -> str:
    """The refusal of checkpoint ``path`` whose manifest does not list ``name``, a file it needs."""
    full = os.path.join(path, name)
    if not os.path.exists(full):
        return f"checkpoint {path} is corrupt: {full} is missing, and its {MANIFEST} does not list it; {CORRUPT_FIX}"
    return (f"checkpoint {path} is corrupt: {full} is not listed in its {MANIFEST} (the entry was lost), so its "
            f"bytes cannot be checked against those saved; {CORRUPT_FIX}")


def verify_checkpoint(path: str) -> None:
    """Refuse, with a UsageError naming the file, a checkpoint whose files differ from its ``manifest.json``
    or that needs a file (``needed_files``) its manifest does not list.

    Collective when distributed: each rank checks a share of the files and every rank raises the same first
    mismatch. A checkpoint without its manifest is refused, since a deleted manifest cannot be told from an
    intact one (``--no-verify`` loads it unchecked). Another framework's checkpoint is recognised by the
    installed plugins (``foreign_checkpoint_error``).
    """
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(os.path.join(path, ".metadata")) or foreign_checkpoint_error(path):
        return  # a missing or foreign checkpoint is read_metadata's to report
    if not os.path.isfile(manifest):
        raise UsageError(f"checkpoint {path} has no {MANIFEST}, so its files cannot be checked against what was "
                         f"saved (every save writes it last: it was deleted, or the copy left it out); restore the "
                         f"directory from a copy, or load it unchecked with --no-verify")
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
        if not isinstance(files, dict):
            raise TypeError(f"its files are a {type(files).__name__}, not a mapping")
        names = sorted(files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"checkpoint {path} is corrupt: {manifest} is unreadable ({type(e).__name__}: {e}); "
                         f"{CORRUPT_FIX}") from None
    if not names:
        raise UsageError(f"checkpoint {path} is corrupt: its {MANIFEST} lists none of its files, so they cannot be "
                         f"checked against those saved; {CORRUPT_FIX}")
    if ".metadata" not in files:  # refused before its unchecked bytes are unpickled for the files it names
        raise UsageError(_unlisted(path, ".metadata"))
    # The directory's listing too: a file that appears there may be one the checkpoint needs.
    key = (os.path.realpath(path), tuple(_stat_key(os.path.join(path, n)) for n in [MANIFEST, *names]),
           tuple(sorted(os.listdir(path))))
    if key in _VERIFIED:
        return
    t = time.perf_counter()
    problem = next((p for p in spread(lambda n: _file_problem(path, n, files[n]), names) if p), "")
    if problem:
        raise UsageError(problem)
    # The listed files are as saved, .metadata among them: the files it names must all be listed.
    unlisted = next((n for n in needed_files(path) if n not in files), None)
    if unlisted is not None:
        raise UsageError(_unlisted(path, unlisted))
    _VERIFIED.add(key)
    total = sum(int(files[n]["bytes"]) for n in names)
    logger.info(f"Checked the {len(names)} files ({format_bytes(total)}) of {path} against its {MANIFEST} "
                f"in {time.perf_counter() - t:.2f}s")


def read_metadata(path: str) -> dict:
    """The DCP metadata of checkpoint ``path`` by key; a one-line UsageError when it is missing or unreadable."""
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

    For the token embedding this is the padded vocabulary size the saving run used.
    """
    meta = read_metadata(path)
    for name in names:
        if f"model.{name}" in meta:
            return int(meta[f"model.{name}"].size[0])
    raise UsageError(f"checkpoint {path} has no '{names[0] if names else 'token embedding'}': {hint}")


def check_checkpoint_shapes(path: str, model_state: dict, aliases: dict | None = None,
                            all_keys: set | None = None, vocab_ids: int | None = None,
                            model_config=None, verify: bool = True, rebuild=None) -> None:
    """Refuse, with a UsageError naming the first mismatch, a checkpoint that does not fit the model exactly.

    Its files must match its manifest (``verify_checkpoint``; skipped when ``verify`` is False), every tensor
    of ``model_state`` must be stored at its global shape, and no tensor the model lacks may be stored.
    ``model_state`` maps FQNs to tensors, DTensors or meta tensors, so a meta-device model is checked before
    any weights are touched. ``all_keys`` (names over all ranks) replaces its keys in the last check when
    this rank holds one pipeline stage. With ``vocab_ids`` and ``model_config``, vocabulary rows that differ
    only in padding are accepted and a refusal names the differing ``model.cfg`` key.
    """
    aliases = aliases or {}
    if verify:
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
            raise UsageError(f"checkpoint {path} {shape_refusal(key, shape, full, vocab_ids, model_config, rebuild)}")
    # A tied copy (a pipeline stage's LM head) reads its source's entry, but a checkpoint saved
    # under pipeline parallelism stores the copy under its own name too: both are the model's.
    expected = all_keys if all_keys is not None else {aliases.get(k, k) for k in model_state} | set(model_state)
    stored_model = [k[len("model."):] for k in meta if k.startswith("model.")]
    extra = next((k for k in stored_model if k not in expected), None)
    if extra is not None:
        raise UsageError(f"checkpoint {path} holds '{extra}', which this config does not build: the checkpoint is of "
                         f"a larger or another model; make model.cfg match it (e.g. model.cfg.hidden_layers)")
