"""LiBai's model-level names and their counterparts in these projects, for LiBai config files.

``compat.libai.config`` serves a LiBai config's ``from libai.models import ...`` (and the other modules
listed here) from this table while the config loads, beside the names that need no model
(``libai.config``, ``libai.scheduler``, ``GPT2Dataset``, ...). A project that brings a LiBai model adds
its names here. docs/migrating.md lists what maps.
"""
from projects.GPT.modeling import GPTForPreTraining, GPTModel

from . import llama, mt5

LIBAI_NAMES = {
    # LiBai's GPT takes the same cfg keys with the same meaning (initializer_range is a std in both).
    "libai.models": {
        "GPTModel": GPTModel,
        "GPTForPreTraining": GPTForPreTraining,
        "T5Model": mt5.T5Model,
        "T5ForPreTraining": mt5.T5ForPreTraining,
    },
    "libai.data.datasets": {"T5Dataset": mt5.T5Dataset},
    # LiBai's MT5 project, imported by its configs as projects.MT5.mt5_model: LiBai's meaning of its keys.
    "projects.MT5.mt5_model": {"MT5Model": mt5.MT5Model, "MT5ForPreTraining": mt5.MT5ForPreTraining},
    # LiBai's T5 project: the same model as its MT5 project, with Hugging Face datasets folders as data.
    "projects.T5.models.t5_model": {"T5Model": mt5.T5ProjectModel, "T5ForPreTraining": mt5.T5ProjectForPreTraining},
    "projects.T5.datasets.dataset": {"UnsuperviseT5Dataset": mt5.UnsuperviseT5Dataset, "collate_fn": mt5.collate_fn},
    # LiBai's Llama project (its module names would otherwise resolve into this project's projects.Llama).
    "projects.Llama.llama": {"LlamaForCausalLM": llama.LlamaForCausalLM},
    "projects.Llama.tokenizer": {"LlamaTokenizer": llama.LlamaTokenizer},
    "projects.Llama.dataset": {"AlpacaDataset": llama.AlpacaDataset},
}
