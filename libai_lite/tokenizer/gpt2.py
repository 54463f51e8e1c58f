"""GPT-2 byte-level BPE on Hugging Face ``tokenizers`` (ids identical to Megatron-LM's GPT2BPETokenizer)."""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .base import BaseTokenizer, check_tokenizer_file, to_id_list

EOD_TOKEN = "<|endoftext|>"


class GPT2Tokenizer(BaseTokenizer):
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``.

    ``<|endoftext|>`` is the end-of-document token and doubles as bos/eos, as in
    GPT-2. Like Megatron-LM's tokenizer, the literal string ``<|endoftext|>``
    inside a text is *not* turned into the special id: it is encoded byte for
    byte, so documents cannot forge document boundaries.
    """

    def __init__(self, vocab_file, merges_file):
        fix = "pass the GPT-2 vocab.json (e.g. --vocab-file data_test/gpt2/vocab.json)"
        vocab_file = check_tokenizer_file(vocab_file, "GPT-2 vocab file", fix)
        merges_file = check_tokenizer_file(
            merges_file,
            "GPT-2 merges file",
            "pass the GPT-2 merges.txt (e.g. --merge-file data_test/gpt2/merges.txt)",
        )
        try:
            model = models.BPE.from_file(vocab_file, merges_file)
        except Exception as e:  # tokenizers raises plain Exception on bad files
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(
                f"cannot load GPT-2 BPE from {vocab_file} and {merges_file} ({first}); "
                "check they are a GPT-2 format vocab.json/merges.txt pair"
            ) from None
        self._tok = Tokenizer(model)
        # GPT-2's regex split, no leading space added: Megatron's own encoder does the same.
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tok.decoder = decoders.ByteLevel()
        self.vocab_file = vocab_file
        self.merges_file = merges_file
        self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

        eod = self._tok.token_to_id(EOD_TOKEN)
        if eod is None:
            raise ValueError(
                f"GPT-2 vocab file {vocab_file} has no {EOD_TOKEN} entry; "
                f"retrain it with {EOD_TOKEN} as a special token"
            )
        self.eod_id = eod
        self.bos_token_id = eod
        self.eos_token_id = eod
        self.pad_token_id = None
        self.unk_token_id = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        # encode_batch_fast skips offset tracking, which we never use.
        return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(to_id_list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> Optional[int]:
        """Id of a vocabulary entry (byte-level form, e.g. ``Ġthe``), or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, idx: int) -> Optional[str]:
        """Vocabulary entry for ``idx``, or None when out of range."""
        return self._tok.id_to_token(int(idx))

    def get_vocab(self) -> Dict[str, int]:
        """Token -> id mapping."""
        return self._tok.get_vocab(with_added_tokens=True)
