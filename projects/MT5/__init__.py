"""T5 / mT5 pretraining: the model in ``modeling`` (importing it registers the Hugging Face T5/mT5 mapping),
the span-corruption data in ``data``, recipes in ``configs``."""
from .modeling import MT5Config, MT5ForPreTraining, MT5Model

__all__ = ["MT5Config", "MT5ForPreTraining", "MT5Model"]
