"""fairseq-train command lines (``language_modeling``, ``transformer_lm``) as this project's config.

:func:`translate_fairseq_args` reads the flags, :func:`render_config` writes the config file that runs them
on ``projects/GPT``, :func:`prepare_split` makes the data-bin's split readable here with its ids unchanged
(``FairseqDictionary`` is its tokenizer). ``tools/from_fairseq.py`` and ``tools/train_net.py --fairseq-args``
use them; docs/migrating.md says what maps.
"""
from .data import FairseqDictionary, prepare_split
from .schedule import FairseqLR
from .translate import ARCHS, FairseqRun, render_config, translate_fairseq_args

__all__ = ["ARCHS", "FairseqDictionary", "FairseqLR", "FairseqRun", "prepare_split", "render_config",
           "translate_fairseq_args"]
