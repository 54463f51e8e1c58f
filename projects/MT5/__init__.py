"""T5 / mT5 pretraining: the model in ``modeling`` (importing it registers the Hugging Face T5/mT5 mapping),
the span-corruption data in ``data``, recipes in ``configs``."""
# projects/MT5/libai_compat.py reads the model classes as ``mt5_model.*`` of this package.
from .modeling import MT5Config, MT5ForPreTraining, MT5Model, mt5_model  # noqa: F401

__all__ = ["MT5Config", "MT5ForPreTraining", "MT5Model"]
