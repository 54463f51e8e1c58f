"""BERT WordPiece on Hugging Face ``tokenizers`` (ids identical to Megatron-LM's BertWordPiece*)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from .base import BaseTokenizer, check_tokenizer_file, to_id_list

REQUIRED_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def load_bert_vocab(vocab_file: str) -> "OrderedDict[str, int]":
    """Read a BERT ``vocab.txt`` exactly as Megatron's ``load_vocab`` does.

    Each line is one id (line number), surrounding whitespace stripped; a
    repeated token keeps its last line's id, which is what Megatron ends up with.
    """
    vocab: "OrderedDict[str, int]" = OrderedDict()
    try:
        with open(vocab_file, "r", encoding="utf-8") as f:
            for index, line in enumerate(f):
                vocab[line.strip()] = index
    except UnicodeDecodeError:
        raise ValueError(
            f"BERT vocab file {vocab_file} is not UTF-8 text; pass a vocab.txt with one token per line"
        ) from None
    return vocab


class BertTokenizer(BaseTokenizer):
    """WordPiece tokenizer matching Megatron-LM's ``BertWordPieceLowerCase`` / ``BertWordPieceCase``.

    ``encode`` returns the bare word pieces (no [CLS]/[SEP]), as Megatron's
    ``tokenize`` does. Like Megatron, ``[BOS]`` and ``[EOS]`` are appended to the
    vocabulary when the file lacks them, followed by ``vocab_extra_ids`` sentinels
    ``<extra_id_0>`` ...; these added tokens are never produced from text (the
    string ``[SEP]`` in a text is split into ``[``, ``sep``, ``]``, as in Megatron).
    ``eod_id`` is the ``[SEP]`` id, since BERT has no end-of-document token.
    """

    def __init__(self, vocab_file, do_lower_case: bool = True, vocab_extra_ids: int = 0):
        vocab_file = check_tokenizer_file(
            vocab_file,
            "BERT vocab file",
            "pass a WordPiece vocab.txt (e.g. --vocab-file data_test/bert/vocab.txt)",
        )
        vocab = load_bert_vocab(vocab_file)
        missing = [t for t in REQUIRED_SPECIALS if t not in vocab]
        if missing:
            raise ValueError(
                f"BERT vocab file {vocab_file} lacks {' '.join(missing)}; "
                "pass a BERT vocab.txt that lists [PAD] [UNK] [CLS] [SEP] [MASK]"
            )
        self.vocab_file = vocab_file
        self.do_lower_case = bool(do_lower_case)

        # Megatron's WordpieceTokenizer gives up on words longer than 200 characters.
        model = models.WordPiece(dict(vocab), unk_token="[UNK]", max_input_chars_per_word=200)
        self._tok = Tokenizer(model)
        self._tok.normalizer = normalizers.BertNormalizer(
            clean_text=True,
            handle_chinese_chars=True,
            strip_accents=self.do_lower_case,
            lowercase=self.do_lower_case,
        )
        self._tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self._tok.decoder = decoders.WordPiece(prefix="##")

        self._vocab: Dict[str, int] = dict(vocab)
        self._inv_vocab: Dict[int, str] = {i: t for t, i in vocab.items()}
        # Megatron appends ids after len(vocab), not after the highest line number.
        self._size = len(self._vocab)
        self._added: Dict[int, str] = {}

        def add_token(token: str) -> int:
            if token not in self._vocab:
                self._vocab[token] = self._size
                self._inv_vocab[self._size] = token
                self._added[self._size] = token
                self._size += 1
            return self._vocab[token]

        self.cls_token_id = vocab["[CLS]"]
        self.sep_token_id = vocab["[SEP]"]
        self.pad_token_id = vocab["[PAD]"]
        self.mask_token_id = vocab["[MASK]"]
        self.unk_token_id = vocab["[UNK]"]
        self.bos_token_id = add_token("[BOS]")
        self.eos_token_id = add_token("[EOS]")
        self._extra_ids = [add_token(f"<extra_id_{i}>") for i in range(int(vocab_extra_ids))]
        self.eod_id = self.sep_token_id

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        return list(self._extra_ids)

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        ids = to_id_list(ids)
        if not any(i in self._added for i in ids):
            return self._tok.decode(ids, skip_special_tokens=False)
        # Tokens added on top of the WordPiece model are unknown to the backend,
        # so decode the runs between them and splice their strings in.
        parts, run = [], []
        for i in ids:
            if i in self._added:
                if run:
                    parts.append(self._tok.decode(run, skip_special_tokens=False))
                    run = []
                parts.append(self._added[i])
            else:
                run.append(i)
        if run:
            parts.append(self._tok.decode(run, skip_special_tokens=False))
        return " ".join(p for p in parts if p)

    def token_to_id(self, token: str) -> Optional[int]:
        """Id of a vocabulary entry (including added ones), or None."""
        return self._vocab.get(token)

    def id_to_token(self, idx: int) -> Optional[str]:
        """Vocabulary entry for ``idx``, or None when out of range."""
        return self._inv_vocab.get(int(idx))

    def get_vocab(self) -> Dict[str, int]:
        """Token -> id mapping, including the added tokens."""
        return dict(self._vocab)
