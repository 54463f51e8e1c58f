"""The tokenizer interface, file checks and Megatron's vocabulary padding rule."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, List, Optional, Sequence, Tuple


def pad_vocab_size(orig_vocab_size: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Round ``orig_vocab_size`` up to a multiple of ``make_vocab_size_divisible_by``.

    Unlike Megatron-LM, the divisor is not multiplied by the tensor-parallel size, so one config builds one
    model and a checkpoint resumes under any layout. The tensor-parallel size must divide the padded size;
    the tensor-parallel check refuses others, naming this key.
    """
    for name, value in (
        ("orig_vocab_size", orig_vocab_size),
        ("make_vocab_size_divisible_by", make_vocab_size_divisible_by),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"pad_vocab_size: {name} must be a positive integer, got {value!r}")
    multiple = make_vocab_size_divisible_by
    return -(-orig_vocab_size // multiple) * multiple


def check_file(path, what: str, fix: str) -> str:
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


def first_line(error: Exception) -> str:
    """The first line of a library's error message (its type when it has none), for one-line errors."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def to_id_list(ids) -> List[int]:
    """Accept lists, tuples, numpy arrays or tensors of ids and return plain ints."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


class BaseTokenizer:
    """Interface every libai_lite tokenizer offers.

    Ids are "unpadded": ``vocab_size`` counts the model's own tokens plus any specials the
    wrapper adds; use :func:`pad_vocab_size` for the embedding size. An id attribute left None
    means the tokenizer has no such token.
    """

    vocab_size: int
    eod_id = pad_token_id = eos_token_id = bos_token_id = unk_token_id = None
    cls_token_id = sep_token_id = mask_token_id = None
    # Whether a document starts with BOS (a Hugging Face tokenizer.json whose template adds one, as
    # Llama's): generation prompts, perplexity documents and LAMBADA contexts then do too.
    add_bos_token = False
    _sentinels: Sequence[int] = ()

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        """Ids of the sentinel tokens (``<extra_id_0>``, ...), in sentinel order."""
        return list(self._sentinels)

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        """Token ids of ``text``, bare; ``add_special_tokens`` adds what Megatron-LM's ``tokenize`` adds.

        That is the template of a Hugging Face ``tokenizer.json`` (a BOS for Llama and Mistral) and
        nothing for the GPT-2, BERT and SentencePiece tokenizers.
        """
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> List[List[int]]:
        """``encode`` of each text."""
        return [self.encode(t, add_special_tokens) for t in texts]

    def encode_batch_bytes(self, texts: Sequence[str], dtype, add_special_tokens: bool = False) -> List[bytes]:
        """``encode_batch``'s ids of each text as the raw bytes of a ``dtype`` array (a ``.bin`` file's form)."""
        import numpy as np

        return [np.array(ids, dtype=dtype).tobytes() for ids in self.encode_batch(texts, add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text for ``ids``."""
        raise NotImplementedError

    def base_vocab(self) -> Iterable[Tuple[str, int]]:
        """``(token, id)`` of the vocabulary the tokenizer's files define, without the ids a wrapper appends
        (sentinels, Megatron's [BOS]/[EOS] or <EOD>): two tokenizers with the same base vocabulary read a
        corpus's text ids alike, whatever extra ids each adds on top."""
        raise NotImplementedError

    def vocab_fingerprint(self) -> str:
        """``"sha256:<hex>"`` of :meth:`base_vocab` sorted by id: one string for one vocabulary, whatever
        file format or folder it came from."""
        cached = self.__dict__.get("_vocab_fingerprint")
        if cached is None:
            pairs = sorted(((int(i), str(t)) for t, i in self.base_vocab()))
            data = json.dumps(pairs, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            cached = self._vocab_fingerprint = "sha256:" + hashlib.sha256(data).hexdigest()
        return cached

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod_id={self.eod_id})"


class TokenizersBackend(BaseTokenizer):
    """A tokenizer whose work a Hugging Face ``tokenizers.Tokenizer`` (``self._tok``) does."""

    # Regexes (Unicode, ASCII-only) splitting a normalised text as the pre-tokenizer does, and how str.split
    # may cut an ASCII text into pieces pre-tokenised alone (WordCache units), for
    # subclasses whose model runs on each pre-token alone (see word_cache.py); None: no word cache.
    _word_split: Optional[tuple] = None
    _word_cache = None

    def enable_word_cache(self, max_words: int = 1 << 18) -> bool:
        """Encode batches through an exact per-word id cache from now on; False when not possible.

        Meant for one long pass over a corpus (preprocessing): the cache holds up to
        ``max_words`` words.
        """
        if self._word_split is None or self._tok.post_processor is not None or self._tok.get_added_tokens_decoder():
            return False
        from .word_cache import WordCache

        self._word_cache = WordCache(self._tok, *self._word_split, max_words=max_words)
        return True

    def base_vocab(self) -> Iterable[Tuple[str, int]]:
        return self._tok.get_vocab(with_added_tokens=True).items()

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> List[List[int]]:
        if self._word_cache is not None:
            # No template or added tokens (checked when enabled): add_special_tokens changes nothing.
            return self._word_cache.encode_batch(texts)
        # encode_batch_fast skips offset tracking, which we never use.
        return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)]

    def encode_batch_bytes(self, texts: Sequence[str], dtype, add_special_tokens: bool = False) -> List[bytes]:
        if self._word_cache is not None:
            return self._word_cache.encode_batch_bytes(texts, dtype)
        return super().encode_batch_bytes(texts, dtype, add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(to_id_list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        """Id of a vocabulary entry, or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, idx: int) -> Optional[str]:
        """Vocabulary entry for ``idx``, or None when out of range."""
        return self._tok.id_to_token(int(idx))
