"""MT5 modeling: ``MT5Model`` (logits) and ``MT5ForPreTraining`` (logits + seq2seq LM loss).

Importing the package registers the Hugging Face T5/mT5 mapping (``hf_mapping``) for ``MT5ForPreTraining``.
"""
from . import hf_mapping  # noqa: F401  (registers the Hugging Face mapping)
from .mt5_model import MT5Config, MT5ForPreTraining, MT5Model

__all__ = ["MT5Config", "MT5ForPreTraining", "MT5Model"]
