"""GPT-2 byte-level BPE on Hugging Face ``tokenizers`` (ids identical to Megatron-LM's GPT2BPETokenizer)."""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .base import TokenizersBackend, check_file, first_line
from .word_cache import GPT2_SPLIT, GPT2_SPLIT_ASCII

EOD_TOKEN = "<|endoftext|>"


def check_merges(merges_file: str) -> None:
    """Refuse a merges.txt with no merge in it (empty, or only its ``#version`` header) in one line.

    ``tokenizers`` loads one as a BPE that merges nothing: every text becomes single bytes, and training
    on those ids runs without a word of warning.
    """
    try:
        with open(merges_file, encoding="utf-8") as f:
            if any(line.strip() and not line.startswith("#version") for line in f):
                return
    except UnicodeDecodeError:
        return  # not text: tokenizers' own error names it
    raise ValueError(
        f"GPT-2 merges file {merges_file} holds no merges (it is empty or has only its #version header); "
        "pass the merges.txt written with this vocab.json"
    )


class GPT2Tokenizer(TokenizersBackend):
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``.

    ``<|endoftext|>`` is the end-of-document token and doubles as bos/eos, as in GPT-2. Like
    Megatron-LM's tokenizer, the literal string ``<|endoftext|>`` inside a text is encoded byte
    for byte, not as the special id, so documents cannot forge document boundaries.
    """

    _word_split = (GPT2_SPLIT, GPT2_SPLIT_ASCII, "space")

    def __init__(self, vocab_file, merges_file):
        self.vocab_file = check_file(
            vocab_file, "GPT-2 vocab file",
            "set tokenization.tokenizer.vocab_file (tools/preprocess_data.py: --vocab-file) to the GPT-2 "
            "vocab.json, e.g. data_test/gpt2/vocab.json"
        )
        self.merges_file = check_file(
            merges_file, "GPT-2 merges file",
            "set tokenization.tokenizer.merges_file (tools/preprocess_data.py: --merge-file) to the GPT-2 "
            "merges.txt, e.g. data_test/gpt2/merges.txt"
        )
        check_merges(self.merges_file)
        try:
            self._tok = Tokenizer(models.BPE.from_file(self.vocab_file, self.merges_file))
        except Exception as e:  # tokenizers raises plain Exception on bad files
            raise ValueError(
                f"cannot load GPT-2 BPE from {self.vocab_file} and {self.merges_file} ({first_line(e)}); "
                "check they are a GPT-2 format vocab.json/merges.txt pair"
            ) from None
        # GPT-2's regex split, no leading space added: Megatron's own encoder does the same.
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tok.decoder = decoders.ByteLevel()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod_id = self.bos_token_id = self.eos_token_id = self._tok.token_to_id(EOD_TOKEN)
        if self.eod_id is None:
            raise ValueError(
                f"GPT-2 vocab file {self.vocab_file} has no {EOD_TOKEN} entry; "
                f"retrain it with {EOD_TOKEN} as a special token"
            )
