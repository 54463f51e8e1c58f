"""SentencePiece tokenizer with Megatron-LM's and T5's special-token conventions."""
from __future__ import annotations

import re
from typing import Dict, Iterable, List, Optional, Sequence

import sentencepiece

from .base import BaseTokenizer, check_tokenizer_file, to_id_list

STYLES = ("megatron", "t5")


class SentencePieceTokenizer(BaseTokenizer):
    """A SentencePiece model plus special tokens, in one of two id conventions.

    ``style="megatron"`` (default) reproduces Megatron-LM's
    ``SentencePieceTokenizer`` (Aug 2023) id for id. After the model's ``n``
    pieces it appends, in this order and only when the piece is missing:
    ``<CLS> <SEP> <EOD> <MASK>``, the pad piece (``<PAD>`` if the model has no
    pad), the bos piece (``<BOS>`` if none), the eos piece (``<EOS>`` if none),
    then ``<extra_id_0>`` ... ``<extra_id_{extra_ids-1}>`` in increasing order.
    For a T5-style model (pad=0 eos=1 unk=2, no bos) with 4,000 pieces this gives
    CLS=4000 SEP=4001 EOD=4002 MASK=4003 BOS=4004, pad=0, eos=1, extra_id_i=4005+i.
    ``eod_id`` is ``<EOD>``. Text is split around every one of those special
    strings (including the model's own pad/eos pieces such as ``</s>``), the
    leftmost occurrence first and, on a tie, the one added first; the pieces in
    between are encoded by SentencePiece.

    ``style="t5"`` follows Hugging Face's ``T5Tokenizer``: no tokens are added
    besides ``extra_ids`` sentinels, numbered from the top
    (``<extra_id_0>`` = n + extra_ids - 1, ``<extra_id_1>`` one below, ...);
    pad/eos/unk are the model's (0/1/2 for T5/mT5 models), ``bos_token_id`` is
    None when the model has no bos, and ``eod_id`` is the eos id. Text is split
    around the sentinels and the model's eos/pad/unk strings, longest match first.
    """

    def __init__(self, model_file, extra_ids: int = 0, style: str = "megatron"):
        if style not in STYLES:
            raise ValueError(f"unknown SentencePiece style {style!r}; use one of {', '.join(STYLES)}")
        model_file = check_tokenizer_file(
            model_file,
            "SentencePiece model",
            "pass a trained .model file (e.g. --tokenizer-model data_test/spm/spiece.model)",
        )
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            ok = self.sp.Load(model_file)
        except Exception as e:  # sentencepiece raises OSError/RuntimeError on bad protos
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(
                f"cannot load SentencePiece model {model_file} ({first}); "
                "pass a .model file written by sentencepiece training"
            ) from None
        if ok is False:
            raise ValueError(
                f"cannot load SentencePiece model {model_file}; "
                "pass a .model file written by sentencepiece training"
            )
        self.model_file = model_file
        self.style = style
        self.extra_ids = int(extra_ids)
        if self.extra_ids < 0:
            raise ValueError(f"extra_ids must be >= 0, got {extra_ids}")
        # Batched encoding threads; preprocessing workers set 1 to avoid oversubscription.
        self.num_threads = -1
        n = self.sp.get_piece_size()
        self._n_pieces = n

        def model_id(i: int) -> Optional[int]:
            return i if 0 <= i < n else None

        self.unk_token_id = model_id(self.sp.unk_id())
        if style == "megatron":
            self._init_megatron(n)
        else:
            self._init_t5(n)

        # Regex alternation reproduces "leftmost match, ties broken by order" when
        # tokens are listed in priority order.
        self._split_re = (
            re.compile("|".join(re.escape(t) for t in self._split_order if t)) if any(self._split_order) else None
        )
        # Cheap pre-check: most texts contain none of the specials' first characters.
        self._first_chars = sorted({t[0] for t in self._split_order if t})

    def _init_megatron(self, n: int) -> None:
        vocab: Dict[str, int] = {}
        for i in range(n):
            vocab[self.sp.id_to_piece(i)] = i
        special: Dict[str, int] = {}  # insertion order is the split priority

        def add(token: str) -> int:
            if token not in vocab:
                vocab[token] = len(vocab)
            special[token] = vocab[token]
            return vocab[token]

        def piece_or(fn, default: str) -> str:
            i = fn()
            return self.sp.id_to_piece(i) if 0 <= i < n else default

        self.cls_token_id = add("<CLS>")
        self.sep_token_id = add("<SEP>")
        self.eod_id = add("<EOD>")
        self.mask_token_id = add("<MASK>")
        self.pad_token_id = add(piece_or(self.sp.pad_id, "<PAD>"))
        self.bos_token_id = add(piece_or(self.sp.bos_id, "<BOS>"))
        self.eos_token_id = add(piece_or(self.sp.eos_id, "<EOS>"))
        self._sentinels = [add(f"<extra_id_{i}>") for i in range(self.extra_ids)]

        self._vocab_size = len(vocab)
        self._added = {i: t for t, i in vocab.items() if i >= n}
        self._special = special
        self._inv_special = {i: t for t, i in special.items()}
        self._split_order = list(special)

    def _init_t5(self, n: int) -> None:
        self._vocab_size = n + self.extra_ids
        self._sentinels = [n + self.extra_ids - 1 - i for i in range(self.extra_ids)]
        self._added = {sid: f"<extra_id_{i}>" for i, sid in enumerate(self._sentinels)}
        special = {t: i for i, t in self._added.items()}
        for fn in (self.sp.eos_id, self.sp.pad_id, self.sp.unk_id):
            i = fn()
            if 0 <= i < n:
                special[self.sp.id_to_piece(i)] = i

        def model_id(i: int) -> Optional[int]:
            return i if 0 <= i < n else None

        self.pad_token_id = model_id(self.sp.pad_id())
        self.eos_token_id = model_id(self.sp.eos_id())
        self.bos_token_id = model_id(self.sp.bos_id())
        self.eod_id = self.eos_token_id
        self.cls_token_id = self.sep_token_id = self.mask_token_id = None
        self._special = special
        self._inv_special = {i: t for t, i in special.items()}
        # HF's added-token trie prefers the longest match (<extra_id_10> over <extra_id_1>).
        self._split_order = sorted(special, key=len, reverse=True)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        return list(self._sentinels)

    def _plan(self, text: str, segments: List[str]) -> list:
        """Split ``text`` around special strings; append plain parts to ``segments``.

        Returns a list whose entries are either an index into ``segments``
        (non-negative) or ``-1 - special_id``.
        """
        if self._split_re is None or not any(c in text for c in self._first_chars):
            segments.append(text)
            return [len(segments) - 1]
        plan, pos = [], 0
        for m in self._split_re.finditer(text):
            segments.append(text[pos : m.start()])
            plan.append(len(segments) - 1)
            plan.append(-1 - self._special[m.group(0)])
            pos = m.end()
        segments.append(text[pos:])
        plan.append(len(segments) - 1)
        return plan

    def encode(self, text: str) -> List[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        segments: List[str] = []
        plans = [self._plan(t, segments) for t in texts]
        encoded = self.sp.encode(segments, out_type=int, num_threads=self.num_threads) if segments else []
        out = []
        for plan in plans:
            if len(plan) == 1:
                out.append(encoded[plan[0]])
                continue
            ids: List[int] = []
            for k in plan:
                if k >= 0:
                    ids.extend(encoded[k])
                else:
                    ids.append(-1 - k)
            out.append(ids)
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text for ``ids``; special tokens are written with a space on each side (Megatron's rule)."""
        ids = to_id_list(ids)
        text, run = "", []
        for i in ids:
            token = self._inv_special.get(i)
            if token is None:
                token = self._added.get(i)
            if token is None:
                run.append(i)
                continue
            if skip_special_tokens:
                continue
            text += self.sp.decode_ids(run) + " " + token + " "
            run = []
        return text + self.sp.decode_ids(run)

    def token_to_id(self, token: str) -> Optional[int]:
        """Id of a piece or added token, or None."""
        if token in self._special:
            return self._special[token]
        for i, t in self._added.items():
            if t == token:
                return i
        i = self.sp.piece_to_id(token)
        if i == self.sp.unk_id() and token != self.sp.id_to_piece(i):
            return None
        return i

    def id_to_token(self, idx: int) -> Optional[str]:
        """Piece or added token for ``idx``, or None when out of range."""
        idx = int(idx)
        if idx in self._added:
            return self._added[idx]
        if 0 <= idx < self._n_pieces:
            return self.sp.id_to_piece(idx)
        return None
