"""Megatron-LM ``pretrain_gpt.py`` command lines as this project's config.

:func:`translate_megatron_args` is the one door (``tools/from_megatron.py`` and ``tools/train_net.py
--megatron-args`` use it, with :func:`render_config`): ``flags`` reads the command line, ``models`` chooses
the project that builds the model it describes (``MEGATRON_MODELS``), ``translate`` turns the rest into
config assignments (``data_flags`` the corpus and tokenizer flags) on a ``run.MegatronRun``. Megatron-LM checkpoints are ``compat.checkpoints``'.
"""
from .flags import KNOWN_FLAGS
from .models import MEGATRON_MODELS, MegatronModel
from .translate import MegatronRun, render_config, translate_megatron_args

__all__ = ["KNOWN_FLAGS", "MEGATRON_MODELS", "MegatronModel", "MegatronRun", "render_config",
           "translate_megatron_args"]
