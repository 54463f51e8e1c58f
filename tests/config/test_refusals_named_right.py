"""Refusals that named the wrong thing or came as a traceback: each is now accepted or one line naming
the key to change (a LiBai switch matching the dropout rule, optimizer arguments, missing tokenizer
files in a training config, the memory estimate's layout, a README path)."""
import re

import pytest
import torch
from omegaconf import OmegaConf

from libai_lite.config import LazyCall
from libai_lite.optim import build_optimizer, get_default_optimizer_params
from libai_lite.utils.errors import UsageError
from tests.launch import ROOT


def test_bias_dropout_fusion_is_a_switch_not_a_dropout_probability():
    """GPT's and MT5's model.cfg ranges (their classes' ``config_ranges``) take LiBai's switch as a switch."""
    from libai_lite.run_sections import check_settings

    for target in ("projects.GPT.modeling.gpt_model.GPTForPreTraining",
                   "projects.MT5.modeling.mt5_model.MT5ForPreTraining"):
        def model(**cfg):
            return OmegaConf.create({"model": {"_target_": target, "cfg": cfg}})

        check_settings(model(bias_dropout_fusion=True, attention_dropout_prob=0.1))
        with pytest.raises(UsageError, match="attention_dropout_prob=1.5 is out of range"):
            check_settings(model(bias_dropout_fusion=True, attention_dropout_prob=1.5))
        with pytest.raises(UsageError, match="bias_dropout_fusion=0.5 is not allowed"):
            check_settings(model(bias_dropout_fusion=0.5))


def test_a_model_class_declares_its_own_ranges_and_the_core_names_no_model_key():
    """config/validate.py's table names no model key; a copied project's class brings its ranges with it."""
    from libai_lite.run_sections import RANGES
    from libai_lite.run_sections import check_settings

    assert not [k for k in RANGES if k.startswith("model.")]
    cfg = OmegaConf.create({"model": {"_target_": "projects.Llama.modeling.llama_model.LlamaForPreTraining",
                                      "cfg": {"num_key_value_heads": 0}}})
    with pytest.raises(UsageError, match="^model.cfg.num_key_value_heads=0 is out of range"):
        check_settings(cfg)
    check_settings(OmegaConf.create({"model": {"_target_": "torch.nn.Identity", "cfg": {"num_key_value_heads": 0}}}))


def _optim(**extra):
    return OmegaConf.create({"optim": LazyCall(torch.optim.AdamW)(
        params=LazyCall(get_default_optimizer_params)(), lr=1e-3, **extra)}).optim


def test_do_bias_correction_true_is_what_adamw_does():
    node = _optim(do_bias_correction=True)
    opt = build_optimizer(node, torch.nn.Linear(2, 2))
    assert isinstance(opt, torch.optim.AdamW) and "do_bias_correction" not in opt.defaults
    assert node.do_bias_correction is True  # the saved config keeps what the user wrote


def test_do_bias_correction_false_and_unknown_arguments_are_one_line():
    with pytest.raises(UsageError) as e:
        build_optimizer(_optim(do_bias_correction=False), torch.nn.Linear(2, 2))
    assert "optim.do_bias_correction=False" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UsageError) as e:
        build_optimizer(_optim(betaz=(0.9, 0.9)), torch.nn.Linear(2, 2))
    assert str(e.value).startswith("optim.betaz is not an argument of AdamW") and "betas" in str(e.value)


def test_missing_tokenizer_file_names_the_config_key():
    from libai_lite.tokenizer import GPT2Tokenizer

    with pytest.raises(ValueError) as e:
        GPT2Tokenizer(None, "data_test/gpt2/merges.txt")
    assert "set tokenization.tokenizer.vocab_file" in str(e.value)


def test_estimate_memory_examples_run_and_a_capped_layout_names_nproc(capsys):
    from tools.estimate_memory import __doc__ as doc, main

    examples = re.findall(r"python tools/estimate_memory.py (.+?)(?:\n\n|\n(?=    python))", doc, re.S)
    assert len(examples) == 2
    second = examples[1].replace("\\\n", " ").split()
    assert "--nproc" in second
    # The model swapped for a tiny one: the example's arguments and layout, checked in seconds.
    tiny = ["model.cfg.hidden_layers=2", "model.cfg.hidden_size=64", "model.cfg.num_attention_heads=2",
            "model.cfg.ffn_hidden_size=128", "model.cfg.max_seq_length=32"]
    assert main([*second, *tiny]) == 0
    assert "warning" not in capsys.readouterr().err
    config = second[0]
    assert main([config, "train.dist.tensor_parallel_size=2", *tiny]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pass --nproc 2" in err


def test_readme_names_config_files_that_exist():
    readme = (ROOT / "README.md").read_text()
    # Paths from the repository root (a project folder a user copies to, projects/MyLM, is not one).
    named = set(re.findall(r"`((?:configs/common|projects/(?:GPT|MT5|Llama))/[\w/]+\.py)`", readme))
    assert "projects/GPT/configs/model.py" in named
    missing = [p for p in named if not (ROOT / p).exists()]
    assert not missing, missing
