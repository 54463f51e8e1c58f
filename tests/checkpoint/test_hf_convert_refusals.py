"""tools/hf_convert.py refuses, in one line and before it writes anything, what it would otherwise write
wrongly without a word: an import whose --tensor-parallel-size the fine-tuning config it writes cannot train."""
import sys

import pytest

from tests.launch import ROOT

sys.path.insert(0, str(ROOT / "tools"))
from hf_convert import main  # noqa: E402


def _error(capsys, argv) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _gpt2_dir(path, heads, width):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=width, n_layer=1, n_head=heads,
                               bos_token_id=99, eos_token_id=99)).save_pretrained(path)
    return path


def _llama_dir(path, kv_heads, ffn):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=ffn, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=kv_heads,
                                 max_position_embeddings=32)).save_pretrained(path)
    return path


CASES = {
    # The config it wrote before set tensor_parallel_size=3, which the fine-tuning run refused at start-up.
    "heads": (lambda p: _gpt2_dir(p, heads=2, width=32), 3,
              "error: --tensor-parallel-size 3 would write a config that cannot train: tensor_parallel_size=3 does not "
              "divide model.cfg.num_attention_heads=2; use a tensor_parallel_size that divides 2 (1 or 2)"),
    "kv_heads": (lambda p: _llama_dir(p, kv_heads=2, ffn=64), 4,
                 "error: --tensor-parallel-size 4 would write a config that cannot train: tensor_parallel_size=4 does "
                 "not divide model.cfg.num_key_value_heads=2; use a tensor_parallel_size that divides 2 (1 or 2)"),
    "ffn": (lambda p: _llama_dir(p, kv_heads=4, ffn=62), 4,
            "error: --tensor-parallel-size 4 would write a config that cannot train: tensor_parallel_size=4 does not "
            "divide model.cfg.ffn_hidden_size=62; use a tensor_parallel_size that divides 62 (1, 2, 31 or 62)"),
    # 3 heads divide over 3 ranks; the 100 ids padded to 128 rows do not.
    "vocab": (lambda p: _gpt2_dir(p, heads=3, width=48), 3,
              "error: --tensor-parallel-size 3 does not divide the 128 vocabulary rows (padded to a multiple of "
              "--make-vocab-size-divisible-by 128); give a --make-vocab-size-divisible-by that is a multiple of 3, "
              "or a --tensor-parallel-size that divides 128"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_import_refuses_a_tensor_parallel_size_the_model_cannot_take_before_writing(case, tmp_path, capsys):
    make, tp, expected = CASES[case]
    hf_dir = make(tmp_path / "hf")
    out = tmp_path / "out"
    capsys.readouterr()
    assert _error(capsys, ["import", "--hf-dir", str(hf_dir), "--output", str(out),
                           "--tensor-parallel-size", str(tp)]) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_import_takes_a_tensor_parallel_size_that_divides_everything(tmp_path):
    hf_dir = _gpt2_dir(tmp_path / "hf", heads=2, width=32)
    assert main(["import", "--hf-dir", str(hf_dir), "--output", str(tmp_path / "out"),
                 "--tensor-parallel-size", "2"]) == 0
    assert "tensor_parallel_size=2" in (tmp_path / "out" / "config.py").read_text()


# ------------------------------------------------------------------- export of a copy that computes otherwise

_COPY_SCRIPT = """
import sys
sys.path.insert(0, "tools")
from hf_convert import main

config, hf_dir, imported, exported = sys.argv[1:]
assert main(["import", "--config-file", config, "--hf-dir", hf_dir, "--output", imported]) == 0
sys.exit(main(["export", "--config-file", imported + "/config.py", "--checkpoint", imported, "--output", exported]))
"""

_COPY_CONFIG = """\
from configs.common.data.gpt_dataset import dataloader, tokenization
from configs.common.optim import optim
from configs.common.train import train
from libai_lite.config import LazyCall
from {name}.modeling.gpt_model import {name}ForPreTraining

model = LazyCall({name}ForPreTraining)(cfg=dict(hidden_layers=1, vocab_size=128, hidden_size=32, ffn_hidden_size=64,
                                               num_attention_heads=2, max_seq_length=32))
"""


def _export_a_copy(tmp_path, name, edit=None):
    """projects/GPT copied to ``name`` with its classes renamed (README steps 1 and 2, and not step 4: its mapping
    keeps GPT-2's model_type), ``edit`` applied to its gpt_model.py; a tiny GPT-2 imported and exported through it."""
    import os
    import re
    import shutil
    import subprocess

    from tests.launch import env

    shutil.copytree(ROOT / "projects" / "GPT", tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    for path in (tmp_path / name / "modeling").glob("*.py"):
        path.write_text(re.sub(r"\bGPT(Model|ForPreTraining|Embedding|Loss)\b", name + r"\1", path.read_text()))
    if edit is not None:
        model_file = tmp_path / name / "modeling" / "gpt_model.py"
        model_file.write_text(edit(model_file.read_text()))
    _gpt2_dir(tmp_path / "hf", heads=2, width=32)
    config = tmp_path / "my_copy_config.py"  # not copy.py: the folder is on the path, before the standard library
    config.write_text(_COPY_CONFIG.format(name=name))
    return subprocess.run([sys.executable, "-c", _COPY_SCRIPT, str(config), str(tmp_path / "hf"),
                           str(tmp_path / "imported"), str(tmp_path / "exported")], cwd=ROOT,
                          env=env(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}"), capture_output=True, text=True,
                          timeout=300)


def _without_positions(source: str) -> str:
    """The copy's own change: no learned positions (the weights stay, so GPT-2's mapping still writes them)."""
    old = "return self.dropout(self.token_embeddings(input_ids) + self.position_embeddings(position_ids))"
    assert source.count(old) == 1
    return source.replace(old, "return self.dropout(self.token_embeddings(input_ids))")


def test_export_refuses_a_copy_that_computes_otherwise_than_the_model_type_it_writes(tmp_path):
    """It was written as GPT2LMHeadModel (model_type gpt2), which generates other tokens than the copy."""
    r = _export_a_copy(tmp_path, "NoPosLM", _without_positions)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert errors[0].startswith("error: NoPosLMForPreTraining does not compute what the exported GPT2LMHeadModel "
                                "(model_type 'gpt2', written by the mapping of NoPosLM.modeling.hf_mapping) "
                                "computes: their logits on a probe batch differ by up to "), errors[0]
    assert errors[0].endswith(
        "so transformers would generate other tokens; give NoPosLMForPreTraining's project a Hugging Face mapping of "
        "its own (register_hf_model with a model_type and converters that run its code), or export with the "
        "original project; nothing was written"), errors[0]
    assert not (tmp_path / "exported").exists() and not (tmp_path / "exported.tmp").exists()


def test_export_of_a_copy_that_computes_gpt2_is_checked_and_says_so(tmp_path):
    r = _export_a_copy(tmp_path, "SameLM")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "note: checked: transformers' GPT2LMHeadModel gives SameLMForPreTraining's logits on a probe batch" \
           in r.stdout, r.stdout[-2000:]
    assert (tmp_path / "exported" / "model.safetensors").is_file()


@pytest.mark.parametrize("other", ["wider", "deeper"])
def test_import_of_weights_of_another_size_than_config_json_is_one_line_and_writes_nothing(other, tmp_path, capsys):
    """A model.safetensors copied from another size: a wider GPT-2's fused qkv failed a reshape (a traceback)."""
    import shutil

    hf = _gpt2_dir(tmp_path / "hf", heads=2, width=32)
    donor = _gpt2_dir(tmp_path / "donor", heads=3, width=48) if other == "wider" else None
    if donor is None:
        from transformers import GPT2Config, GPT2LMHeadModel

        donor = tmp_path / "donor"
        GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                   bos_token_id=99, eos_token_id=99)).save_pretrained(donor)
    shutil.copy(donor / "model.safetensors", hf / "model.safetensors")
    capsys.readouterr()  # transformers' own progress bars while saving
    line = _error(capsys, ["import", "--hf-dir", str(hf), "--output", str(tmp_path / "out")])
    want = (f"error: the weights in {hf} do not fit its config.json: converting them failed (" if other == "wider"
            else "error: the GPT-2 weights has the unexpected key 'h.1.attn.c_attn.bias' (12 in all)")
    assert line.startswith(want), line
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["donor", "hf"]
