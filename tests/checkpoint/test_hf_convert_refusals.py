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
