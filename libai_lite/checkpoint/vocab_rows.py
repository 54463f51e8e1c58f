"""Vocabulary rows of a checkpoint that pads its vocabulary otherwise, and shape refusals that name
the ``model.cfg`` key that differs (used by ``checkpointer.check_checkpoint_shapes`` and ``Checkpointer.load``)."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def vocab_padding_differs(stored: Sequence[int], built: Sequence[int], vocab_ids: int | None,
                          vocab_rows: int | None) -> bool:
    """Whether a tensor stored as ``stored`` differs from the ``built`` one only in vocabulary padding rows.

    ``vocab_rows`` rows are built (the tokenizer's ``vocab_ids`` padded) and at least ``vocab_ids`` are stored;
    a checkpoint padded otherwise then loads with rows cut or added.
    """
    stored, built = tuple(stored), tuple(built)
    return (vocab_ids is not None and vocab_rows is not None and len(stored) == len(built) >= 1
            and built[0] == vocab_rows and stored[0] != vocab_rows and stored[0] >= vocab_ids
            and stored[1:] == built[1:])


def shape_refusal(key: str, stored: tuple, built: tuple, vocab_ids: int | None, model_config,
                  rebuild: Callable[[dict], dict | None] | None = None) -> str:
    """The refusal of ``key`` stored as ``stored`` where ``built`` is built, naming the config key that
    gives the differing size when ``model_config`` (``model.cfg``) holds one with that value.

    Where several keys hold that value (hidden_size=64 and max_seq_length=64), ``rebuild`` (``{key: value}`` ->
    the model's state-dict shapes with those ``model.cfg`` changes, or None) tells which one, changed to the
    stored size, builds the stored shape."""
    head = f"holds '{key}' with shape {list(stored)} but this config builds {list(built)}"
    vocab_rows = (model_config or {}).get("vocab_size")
    if (vocab_ids is not None and len(stored) == len(built) >= 1 and built[0] == vocab_rows
            and stored[1:] == built[1:] and stored[0] < vocab_ids):
        return (f"{head}: the checkpoint is of another model shape, with a vocabulary of {stored[0]} rows, fewer "
                f"than the tokenizer's {vocab_ids} ids; set tokenization.tokenizer to the one it was trained with")
    sizes: dict[int, list[str]] = {}
    for name, value in (model_config or {}).items():
        if isinstance(value, int) and not isinstance(value, bool):
            sizes.setdefault(value, []).append(name)
    dims = [(b, s) for b, s in zip(built, stored) if b != s] if len(built) == len(stored) else []
    for b, s in dims:
        if b in sizes:
            names = sizes[b]
            name = next((n for n in names if len(names) > 1 and rebuild is not None
                         and _builds(rebuild, {n: s}, key, stored)), names[0])
            return (f"{head}: the checkpoint is of another model shape; model.cfg.{name}={b} gives {b} where "
                    f"it has {s}: set model.cfg.{name} to the value it was trained with")
    return f"{head}: the checkpoint is of another model shape; make model.cfg match it"


def _builds(rebuild: Callable[[dict], dict | None], changes: dict, key: str, stored: tuple) -> bool:
    """Whether the model built with ``changes`` to ``model.cfg`` has ``key`` of shape ``stored``."""
    try:
        shapes = rebuild(changes)
    except Exception:  # noqa: BLE001 - a change the model refuses (sizes that do not divide) explains nothing
        return False
    return shapes is not None and tuple(shapes.get(key, ())) == tuple(stored)


def fit_vocab_rows(loaded: torch.Tensor, target: torch.Tensor, vocab_ids: int, is_weight: bool) -> torch.Tensor:
    """``target`` (a tensor or DTensor) set to ``loaded`` (the full stored tensor) with its rows cut or
    added to ``target``'s. An added weight row is the mean of the real ids' rows (a padded id then gets the
    mean logit, as ``hf.resize_vocab_rows`` does); added optimizer state is zero, as a fresh optimizer's."""
    rows = target.shape[0]
    full = torch.zeros(target.shape, dtype=loaded.dtype, device=loaded.device)
    keep = min(rows, loaded.shape[0])
    full[:keep] = loaded[:keep]
    if is_weight and rows > keep:
        full[keep:] = loaded[:vocab_ids].float().mean(0).to(loaded.dtype)
    if isinstance(target, DTensor):
        # Every rank holds the full tensor: each takes its own shard without communication.
        full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(full)
    else:
        target.copy_(full)
    return target
