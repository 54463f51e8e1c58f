"""T5 / mT5 pretraining: ``MT5Model`` (logits) and ``MT5ForPreTraining`` (logits + seq2seq LM loss)."""
from .mt5_model import MT5Config, MT5ForPreTraining, MT5Model

__all__ = ["MT5Config", "MT5ForPreTraining", "MT5Model"]
