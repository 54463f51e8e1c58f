"""GPT modeling: ``GPTModel`` (logits) and ``GPTForPreTraining`` (logits + LM loss)."""
from .gpt_model import GPTEmbedding, GPTForPreTraining, GPTLoss, GPTModel

__all__ = ["GPTEmbedding", "GPTForPreTraining", "GPTLoss", "GPTModel"]
