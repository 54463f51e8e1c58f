"""SentencePiece tokenizer with Megatron-LM's and T5's special-token conventions."""
from __future__ import annotations

import re
from typing import Iterable, List, Optional, Sequence

import sentencepiece

from .base import BaseTokenizer, check_file, first_line, to_id_list

STYLES = ("megatron", "t5")


class SentencePieceTokenizer(BaseTokenizer):
    """A SentencePiece model plus special tokens, in one of two id conventions.

    ``style="megatron"`` matches Megatron-LM's ``SentencePieceTokenizer`` id for id. After the model's ``n``
    pieces it appends, in this order and only when missing, ``<CLS> <SEP> <EOD> <MASK>``, the pad, bos and
    eos pieces (``<PAD>``/``<BOS>``/``<EOS>`` when the model has none), then ``<extra_id_0>`` ... upwards;
    ``eod_id`` is ``<EOD>``. Text is split around all of those strings, leftmost first, ties to the earlier.

    ``style="t5"`` follows Hugging Face's ``T5Tokenizer``: only ``extra_ids`` sentinels are added, numbered
    from the top (``<extra_id_0>`` = n + extra_ids - 1); pad/eos/unk/bos are the model's (bos may be None)
    and ``eod_id`` is eos. Text is split around the sentinels and eos/pad/unk, longest match first.
    """

    def __init__(self, model_file, extra_ids: int = 0, style: str = "megatron"):
        if style not in STYLES:
            raise ValueError(f"unknown SentencePiece style {style!r}; use one of {', '.join(STYLES)}")
        self.model_file = check_file(
            model_file,
            "SentencePiece model",
            "set tokenization.tokenizer.model_file (tools/preprocess_data.py: --tokenizer-model) to a trained "
            ".model file, e.g. data_test/spm/spiece.model",
        )
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.Load(self.model_file)
        except Exception as e:  # sentencepiece raises OSError/RuntimeError on bad protos
            raise ValueError(
                f"cannot load SentencePiece model {self.model_file} ({first_line(e)}); "
                "pass a .model file written by sentencepiece training"
            ) from None
        self.style = style
        self.extra_ids = int(extra_ids)
        if self.extra_ids < 0:
            raise ValueError(f"extra_ids must be >= 0, got {extra_ids}")
        # Batched encoding threads; preprocessing workers set 1 to avoid oversubscription.
        self.num_threads = -1
        n = self._n_pieces = self.sp.get_piece_size()

        def model_id(i: int) -> Optional[int]:
            return i if 0 <= i < n else None

        self.unk_token_id = model_id(self.sp.unk_id())
        if style == "megatron":
            vocab = {self.sp.id_to_piece(i): i for i in range(n)}
            special = {}  # insertion order is the split priority on a tie

            def add(token: str) -> int:
                special[token] = vocab.setdefault(token, len(vocab))
                return special[token]

            def piece_or(i: int, default: str) -> str:
                return self.sp.id_to_piece(i) if model_id(i) is not None else default

            self.cls_token_id, self.sep_token_id, self.eod_id, self.mask_token_id = map(
                add, ("<CLS>", "<SEP>", "<EOD>", "<MASK>")
            )
            self.pad_token_id = add(piece_or(self.sp.pad_id(), "<PAD>"))
            self.bos_token_id = add(piece_or(self.sp.bos_id(), "<BOS>"))
            self.eos_token_id = add(piece_or(self.sp.eos_id(), "<EOS>"))
            self._sentinels = [add(f"<extra_id_{i}>") for i in range(self.extra_ids)]
            self.vocab_size = len(vocab)
            order = list(special)
        else:
            self.vocab_size = n + self.extra_ids
            self._sentinels = [n + self.extra_ids - 1 - i for i in range(self.extra_ids)]
            special = {f"<extra_id_{i}>": sid for i, sid in enumerate(self._sentinels)}
            for i in (self.sp.eos_id(), self.sp.pad_id(), self.sp.unk_id()):
                if model_id(i) is not None:
                    special[self.sp.id_to_piece(i)] = i
            self.pad_token_id, self.eos_token_id, self.bos_token_id = (
                model_id(i) for i in (self.sp.pad_id(), self.sp.eos_id(), self.sp.bos_id())
            )
            self.eod_id = self.eos_token_id
            # HF's added-token trie prefers the longest match (<extra_id_10> over <extra_id_1>).
            order = sorted(special, key=len, reverse=True)
        self._special = special
        self._inv_special = {i: t for t, i in special.items()}
        # A capturing alternation in priority order: re.split gives [text, special, text, ...] with
        # "leftmost match, ties broken by order".
        self._split_re = re.compile("(" + "|".join(map(re.escape, order)) + ")") if order else None
        # Cheap pre-check: most texts contain none of the specials' first characters.
        self._first_chars = {t[0] for t in order}

    def base_vocab(self):
        """The model's pieces; the specials and sentinels either style appends are left out."""
        return ((self.sp.id_to_piece(i), i) for i in range(self._n_pieces))

    def _split(self, text: str) -> List[str]:
        if self._split_re is None or not any(c in text for c in self._first_chars):
            return [text]
        return self._split_re.split(text)

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> List[List[int]]:
        # add_special_tokens adds nothing: Megatron's SentencePiece tokenize adds no bos or eos.
        parts = [self._split(t) for t in texts]
        plain = [p for split in parts for p in split[::2]]
        encoded = iter(self.sp.encode(plain, out_type=int, num_threads=self.num_threads) if plain else ())
        out = []
        for split in parts:
            ids = next(encoded)
            for special in split[1::2]:
                ids.append(self._special[special])
                ids.extend(next(encoded))
            out.append(ids)
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text for ``ids``; special tokens are written with a space on each side (Megatron's rule)."""
        text, run = "", []
        for i in to_id_list(ids):
            token = self._inv_special.get(i)
            if token is None:
                run.append(i)
            elif not skip_special_tokens:
                text += self.sp.decode_ids(run) + " " + token + " "
                run = []
        return text + self.sp.decode_ids(run)

    def token_to_id(self, token: str) -> Optional[int]:
        """Id of a piece or added token, or None."""
        if token in self._special:
            return self._special[token]
        i = self.sp.piece_to_id(token)
        return i if self.sp.id_to_piece(i) == token else None

    def id_to_token(self, idx: int) -> Optional[str]:
        """Piece or added token for ``idx``, or None when out of range."""
        idx = int(idx)
        return self.sp.id_to_piece(idx) if 0 <= idx < self._n_pieces else self._inv_special.get(idx)
