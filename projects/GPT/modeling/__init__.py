"""GPT modeling: ``GPTModel`` (logits) and ``GPTForPreTraining`` (logits + LM loss).

Importing the package registers the Hugging Face GPT-2 mapping (``hf_mapping``) for ``GPTForPreTraining``.
"""
from . import hf_mapping  # noqa: F401  (registers the Hugging Face mapping)
from .gpt_model import GPTEmbedding, GPTForPreTraining, GPTModel

__all__ = ["GPTEmbedding", "GPTForPreTraining", "GPTModel"]
