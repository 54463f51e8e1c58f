"""Other frameworks' configs, command lines, names and checkpoints, in this project's terms.

``compat.libai``: LiBai config files loaded unchanged (the ``libai``/``oneflow`` imports they write, the
keys whose meaning differs, LiBai's model, dataset, tokenizer and optimizer names). ``compat.megatron``:
Megatron-LM ``pretrain_gpt.py`` command lines (Megatron-DeepSpeed's and OneFlow-GPT's too) as a config;
``compat.deepspeed``: a DeepSpeed ``ds_config.json`` as config overrides; ``compat.fairseq``: a
``fairseq-train`` command line and its data-bin; ``compat.command_line``: what the translating tools share.
``compat.checkpoints``: Megatron-LM and LiBai
checkpoints recognised by their files. ``compat.lm_eval``: this project's models as lm-evaluation-harness
models (importing it registers them). This package stands above ``libai_lite`` and ``projects`` (it names
their models) and below ``tools``; the core reaches it only through the entry points setup.py declares.
"""
