"""Megatron's packed-document options, decided on a sample's input tokens, that keep its documents apart.

* ``reset_position_ids``: positions restart at 0 after each ``eod``;
* ``reset_attention_mask``: a token after an ``eod`` attends to nothing up to and including it; this
  travels as ``document_ids`` (``[seq]`` counts of ``eod`` tokens before each position);
* ``eod_mask_loss``: labels become ``IGNORE_INDEX`` where the input token is ``eod``.

With both resets a document's logits are those it gets when run alone from position 0.
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch

from ..utils.errors import UsageError
from .gpt_dataset import IGNORE_INDEX

OPTIONS = ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")


def document_ids(input_ids: torch.Tensor, eod_token_id: int) -> torch.Tensor:
    """Index of the document each position of ``input_ids`` ``[..., seq]`` belongs to: the number of
    ``eod`` tokens strictly before it (an ``eod`` belongs to the document it ends)."""
    is_eod = (input_ids == eod_token_id).long()
    return is_eod.cumsum(-1) - is_eod


def document_position_ids(input_ids: torch.Tensor, eod_token_id: int) -> torch.Tensor:
    """Position ids ``[..., seq]`` that restart at 0 on the token after each ``eod`` (Megatron's
    ``reset_position_ids``)."""
    seq = input_ids.shape[-1]
    arange = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[..., 1:] = input_ids[..., :-1] == eod_token_id
    # Each position's latest document start, by a running maximum over the start positions (0 elsewhere).
    first = torch.cummax(torch.where(starts, arange, torch.zeros_like(arange)), dim=-1).values
    return arange - first


def check_packing_options(eod_token_id: Optional[int], reset_position_ids: bool = False,
                          reset_attention_mask: bool = False, eod_mask_loss: bool = False) -> bool:
    """Whether any option is on; refuses, in one line, an option without a usable ``eod_token_id``."""
    enabled = [name for name, on in zip(OPTIONS, (reset_position_ids, reset_attention_mask, eod_mask_loss)) if on]
    if not enabled:
        return False
    if eod_token_id is None:
        verb = "needs" if len(enabled) == 1 else "need"
        raise UsageError(f"{', '.join(enabled)} {verb} the end-of-document token id: set dataloader.train.eod_token_id "
                         f"(the tokenizer's eod_id) or turn the option off")
    if isinstance(eod_token_id, bool) or not isinstance(eod_token_id, numbers.Integral) or eod_token_id < 0:
        raise UsageError(f"dataloader.train.eod_token_id must be a non-negative token id, got {eod_token_id!r}")
    return True


def check_eod_token_id(eod_token_id, vocab_size: Optional[int], key: str = "dataloader.train.eod_token_id") -> None:
    """Refuse, in one line, an end-of-document id outside the tokenizer's ``vocab_size`` ids: no token of the
    data can equal it, so ``eod_mask_loss`` would mask nothing and the resets would never reset."""
    if (vocab_size is None or eod_token_id is None or isinstance(eod_token_id, bool)
            or not isinstance(eod_token_id, numbers.Integral)):
        return
    if not 0 <= eod_token_id < vocab_size:
        raise UsageError(f"{key}={eod_token_id} is outside the tokenizer's vocabulary of {vocab_size} ids, so no "
                         f"token can end a document: set it to the id that ends each document in the data (null "
                         f"takes the tokenizer's eod_id)")


def packed_document_fields(input_ids: torch.Tensor, labels: torch.Tensor, eod_token_id: int,
                           reset_position_ids: bool = False, reset_attention_mask: bool = False,
                           eod_mask_loss: bool = False) -> dict:
    """What the model needs for one sample (or a batch) under the options on: ``position_ids`` (with
    ``reset_position_ids``), ``document_ids`` (with ``reset_attention_mask``) and ``labels`` (with
    ``IGNORE_INDEX`` where the input token is ``eod`` under ``eod_mask_loss``, else unchanged)."""
    out = {"labels": labels}
    if reset_position_ids:
        out["position_ids"] = document_position_ids(input_ids, eod_token_id)
    if reset_attention_mask:
        out["document_ids"] = document_ids(input_ids, eod_token_id)
    if eod_mask_loss:
        # A new tensor: the dataset's labels may view a read-only memory map.
        out["labels"] = torch.where(input_ids == eod_token_id, torch.full_like(labels, IGNORE_INDEX), labels)
    return out


class PackedDocumentDataset(torch.utils.data.Dataset):
    """Adds the packed-document fields (``packed_document_fields``) to the ``{"input_ids", "labels"}``
    samples of any dataset (a ``GPTDataset``, a blend), so the DataLoader collates them into the batch.

    Attributes of the wrapped dataset (``data_prefix``, ``max_token_id``, ``datasets``) stay reachable.
    """

    def __init__(self, dataset, eod_token_id: int, reset_position_ids: bool = False,
                 reset_attention_mask: bool = False, eod_mask_loss: bool = False):
        if not check_packing_options(eod_token_id, reset_position_ids, reset_attention_mask, eod_mask_loss):
            raise UsageError("PackedDocumentDataset needs at least one of " + ", ".join(OPTIONS))
        self.dataset = dataset
        self.eod_token_id = int(eod_token_id)
        self.options = dict(reset_position_ids=bool(reset_position_ids),
                            reset_attention_mask=bool(reset_attention_mask), eod_mask_loss=bool(eod_mask_loss))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict:
        sample = dict(self.dataset[idx])
        sample.update(packed_document_fields(sample["input_ids"], sample["labels"], self.eod_token_id,
                                             **self.options))
        return sample

    def __getattr__(self, name):
        if name == "dataset":  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


def wrap_packed_documents(dataset, eod_token_id: Optional[int], reset_position_ids: bool = False,
                          reset_attention_mask: bool = False, eod_mask_loss: bool = False):
    """``dataset`` wrapped in a ``PackedDocumentDataset`` when an option is on (None and no option: unchanged)."""
    if not check_packing_options(eod_token_id, reset_position_ids, reset_attention_mask, eod_mask_loss) \
            or dataset is None:
        return dataset
    return PackedDocumentDataset(dataset, eod_token_id, reset_position_ids, reset_attention_mask, eod_mask_loss)
