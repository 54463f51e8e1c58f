"""Llama modeling: ``LlamaModel`` (logits) and ``LlamaForPreTraining`` (logits + LM loss).

Importing the package registers the Hugging Face Llama, Mistral and Qwen2 mapping (``hf_mapping``).
"""
from . import hf_mapping  # noqa: F401  (registers the Hugging Face mapping)
from .llama_model import LlamaForPreTraining, LlamaModel

__all__ = ["LlamaForPreTraining", "LlamaModel"]
