"""LiBai config files loaded unchanged, and LiBai's names built as this project's objects.

:class:`LibaiDialect` is the one door (the core's ``libai_lite.config_dialects`` entry point): ``config``
answers a LiBai config's imports and translates its keys; what the imports reach is in ``data``
(datasets, loaders, tokenizers), ``optim`` (OneFlow's optimizers), ``models`` (the model-level names),
with ``llama`` and ``mt5`` for LiBai's Llama, T5 and MT5 projects; ``notice`` says each warning once. Only
``config`` is imported with the door: the rest loads when a LiBai config imports it.
"""
from .config import LibaiDialect, translate_libai_config
from .notice import warn_once

__all__ = ["LibaiDialect", "translate_libai_config", "warn_once"]
