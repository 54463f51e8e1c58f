"""Shared tokenizer interface, file checks and Megatron's vocabulary padding rule."""
from __future__ import annotations

import os
from typing import Iterable, List, Optional, Sequence


def pad_vocab_size(
    orig_vocab_size: int, make_vocab_size_divisible_by: int = 128, tensor_parallel_size: int = 1
) -> int:
    """Round ``orig_vocab_size`` up to a multiple of ``make_vocab_size_divisible_by * tensor_parallel_size``.

    This is Megatron-LM's ``_vocab_size_with_padding``: the embedding is split
    evenly across tensor-parallel ranks and each shard stays a multiple of the
    divisor, which keeps GEMM shapes friendly.
    """
    for name, value in (
        ("orig_vocab_size", orig_vocab_size),
        ("make_vocab_size_divisible_by", make_vocab_size_divisible_by),
        ("tensor_parallel_size", tensor_parallel_size),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"pad_vocab_size: {name} must be a positive integer, got {value!r}")
    multiple = make_vocab_size_divisible_by * tensor_parallel_size
    return -(-orig_vocab_size // multiple) * multiple


def check_tokenizer_file(path, what: str, fix: str) -> str:
    """Return ``path`` as a string, or raise a one-line error naming the file and the fix."""
    if path is None or str(path) == "":
        raise ValueError(f"no {what} given; {fix}")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} not found: {path}; {fix}")
    if os.path.isdir(path):
        raise ValueError(f"{what} is a directory, not a file: {path}; {fix}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{what} is not readable: {path}; check its permissions or {fix}")
    return path


class BaseTokenizer:
    """Interface every libai_lite tokenizer offers.

    Ids are "unpadded": ``vocab_size`` counts the model's own tokens plus any
    specials the wrapper adds; use :func:`pad_vocab_size` for the embedding size.
    """

    # Filled in by subclasses; None means "this tokenizer has no such token".
    eod_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None
    unk_token_id: Optional[int] = None
    cls_token_id: Optional[int] = None
    sep_token_id: Optional[int] = None
    mask_token_id: Optional[int] = None

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def eod(self) -> Optional[int]:
        """Megatron's name for :attr:`eod_id`."""
        return self.eod_id

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        """Ids of the sentinel tokens (``<extra_id_0>``, ...), in sentinel order."""
        return []

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text``, with no special tokens added around it."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of each text; subclasses override this with a batched backend."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text for ``ids``."""
        raise NotImplementedError

    # Megatron's method names, so code ported from Megatron-LM reads the same.
    def tokenize(self, text: str) -> List[int]:
        """Alias of :meth:`encode` (Megatron-LM's name)."""
        return self.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        """Alias of :meth:`decode` (Megatron-LM's name)."""
        return self.decode(ids)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod_id={self.eod_id})"


def to_id_list(ids) -> List[int]:
    """Accept lists, tuples, numpy arrays or tensors of ids and return plain ints."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]
