"""Build a tokenizer from Megatron-LM's ``--tokenizer-type`` names."""
from __future__ import annotations

from .base import BaseTokenizer
from .bert import BertTokenizer
from .gpt2 import GPT2Tokenizer
from .huggingface import HuggingFaceTokenizer
from .sentencepiece_tokenizer import SentencePieceTokenizer

TOKENIZER_TYPES = (
    "GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer", "HuggingFaceTokenizer"
)


def build_tokenizer(tokenizer_type: str, vocab_file=None, merge_file=None, tokenizer_model=None,
                    vocab_extra_ids: int = 0, spm_style: str = "megatron") -> BaseTokenizer:
    """Return the tokenizer Megatron-LM builds for ``tokenizer_type``.

    ``vocab_extra_ids`` adds ``<extra_id_*>`` sentinels to the BERT and SentencePiece tokenizers
    (GPT-2 and Hugging Face ignore it, as in Megatron); ``spm_style`` is the SentencePiece id convention
    ("megatron" or "t5"). ``HuggingFaceTokenizer`` takes the directory holding ``tokenizer.json`` as
    ``tokenizer_model``.
    """
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is None or merge_file is None:
            raise ValueError("GPT2BPETokenizer needs a vocab.json and a merges.txt; pass --vocab-file and --merge-file")
        return GPT2Tokenizer(vocab_file, merge_file)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        if vocab_file is None:
            raise ValueError(f"{tokenizer_type} needs a WordPiece vocab.txt; pass --vocab-file")
        lower = tokenizer_type == "BertWordPieceLowerCase"
        return BertTokenizer(vocab_file, do_lower_case=lower, vocab_extra_ids=vocab_extra_ids)
    if tokenizer_type == "SentencePieceTokenizer":
        if tokenizer_model is None:
            raise ValueError("SentencePieceTokenizer needs a .model file; pass --tokenizer-model")
        return SentencePieceTokenizer(tokenizer_model, extra_ids=vocab_extra_ids, style=spm_style)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r}; use one of {', '.join(TOKENIZER_TYPES)}")
