"""BERT WordPiece on Hugging Face ``tokenizers`` (ids identical to Megatron-LM's BertWordPiece*)."""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from .base import TokenizersBackend, check_file
from .word_cache import BERT_SPLIT_ASCII, bert_split

REQUIRED_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class BertTokenizer(TokenizersBackend):
    """WordPiece tokenizer matching Megatron-LM's ``BertWordPieceLowerCase`` / ``BertWordPieceCase``.

    ``encode`` returns the bare word pieces (no [CLS]/[SEP]). As in Megatron, ``[BOS]`` and ``[EOS]`` are
    appended when the vocabulary lacks them, then ``vocab_extra_ids`` sentinels; text never produces these,
    since the pre-tokenizer splits at brackets. ``eod_id`` is ``[SEP]``: BERT has no end-of-document token.
    """

    _word_split = (bert_split, BERT_SPLIT_ASCII, "whitespace")

    def __init__(self, vocab_file, do_lower_case: bool = True, vocab_extra_ids: int = 0):
        vocab_file = check_file(
            vocab_file, "BERT vocab file",
            "set tokenization.tokenizer.vocab_file (tools/preprocess_data.py: --vocab-file) to a "
            "WordPiece vocab.txt, e.g. data_test/bert/vocab.txt"
        )
        try:
            with open(vocab_file, encoding="utf-8") as f:
                # Megatron's load_vocab: id = line number, and a repeated token keeps its last line.
                vocab = {line.strip(): index for index, line in enumerate(f)}
        except UnicodeDecodeError:
            raise ValueError(
                f"BERT vocab file {vocab_file} is not UTF-8 text; pass a vocab.txt with one token per line"
            ) from None
        missing = [t for t in REQUIRED_SPECIALS if t not in vocab]
        if missing:
            raise ValueError(
                f"BERT vocab file {vocab_file} lacks {' '.join(missing)}; "
                "pass a BERT vocab.txt that lists [PAD] [UNK] [CLS] [SEP] [MASK]"
            )
        self.vocab_file = vocab_file
        # vocab.txt's own entries: what a corpus's ids mean, whatever [BOS]/[EOS]/sentinels are added.
        self._file_vocab = dict(vocab)
        self.do_lower_case = bool(do_lower_case)
        # Megatron appends ids after len(vocab), not after the highest line number.
        added = ["[BOS]", "[EOS]"] + [f"<extra_id_{i}>" for i in range(int(vocab_extra_ids))]
        for token in added:
            vocab.setdefault(token, len(vocab))
        self.vocab_size = len(vocab)
        self.pad_token_id, self.unk_token_id, self.cls_token_id, self.sep_token_id, self.mask_token_id = (
            vocab[t] for t in REQUIRED_SPECIALS
        )
        self.bos_token_id, self.eos_token_id = vocab["[BOS]"], vocab["[EOS]"]
        self._sentinels = [vocab[t] for t in added[2:]]
        self.eod_id = self.sep_token_id

        # Megatron's WordpieceTokenizer gives up on words longer than 200 characters.
        self._tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=200))
        self._tok.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=self.do_lower_case, lowercase=self.do_lower_case
        )
        self._tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self._tok.decoder = decoders.WordPiece(prefix="##")

    def base_vocab(self):
        return self._file_vocab.items()
