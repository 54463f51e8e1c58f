"""Tokenizers: GPT-2 byte-level BPE, BERT WordPiece, SentencePiece (Megatron and T5 conventions), Hugging Face
``tokenizer.json`` (Llama 3, Mistral, Qwen2)."""
from .base import BaseTokenizer, check_file, pad_vocab_size
from .bert import BertTokenizer
from .build import TOKENIZER_TYPES, build_tokenizer
from .gpt2 import GPT2Tokenizer
from .huggingface import HuggingFaceTokenizer
from .sentencepiece_tokenizer import SentencePieceTokenizer

__all__ = ["BaseTokenizer", "BertTokenizer", "GPT2Tokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
           "TOKENIZER_TYPES", "build_tokenizer", "check_file", "pad_vocab_size"]
