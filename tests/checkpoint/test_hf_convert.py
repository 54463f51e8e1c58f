"""Hugging Face weights in and out (tools/hf_convert.py, libai_lite/checkpoint/hf.py and hf_io.py, the
mappings the projects register).

Tiny randomly initialised transformers models are saved with save_pretrained (safetensors, a
sharded index, and a pytorch_model.bin), imported, compared logit for logit with transformers on
batches with padding, exported again and reloaded with transformers' own from_pretrained. A copy
of projects/GPT under another name converts through the copy's own registered mapping.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from omegaconf import OmegaConf

from tests.launch import ROOT, env, python_tool, train_ranks
from libai_lite.checkpoint import Checkpointer
from libai_lite.checkpoint.hf import (
    checkpoint_vocab_size,
    load_hf_model,
    mapping_for_model,
    read_hf_state_dict,
    resize_vocab_rows,
    save_hf_model,
)
from libai_lite.config import LazyConfig
from libai_lite.utils.errors import UsageError
from projects.GPT.modeling import GPTForPreTraining
from projects.MT5 import MT5ForPreTraining

sys.path.insert(0, str(ROOT / "tools"))
from hf_convert import main  # noqa: E402

GPT_VOCAB = 8000  # data_test/gpt2's tokenizer
SPM_VOCAB = 4000 + 100  # data_test/spm's pieces + 100 sentinels
T5_KW = dict(d_model=48, d_kv=8, d_ff=96, num_layers=2, num_heads=4, dropout_rate=0.0)


def _randomise(hf):
    """HF starts biases at 0 and norms at 1: random values expose a swapped bias or norm."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "ln_" in name or "layer_norm" in name:
                p.normal_(1.0 if "layer_norm" in name else 0.0, 0.3)
    return hf.eval()


def _gpt2(vocab=GPT_VOCAB):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=GPT_VOCAB - 1, eos_token_id=GPT_VOCAB - 1)
    return _randomise(GPT2LMHeadModel(config))


def _t5(kind):
    """'t5': v1.0 (ReLU, tied, scaled); 't5_v1_1': T5 class, gated-GELU, untied; 'mt5': MT5 class, untied."""
    from transformers import MT5Config, MT5ForConditionalGeneration, T5Config, T5ForConditionalGeneration

    torch.manual_seed(1)
    if kind == "t5":
        return _randomise(T5ForConditionalGeneration(T5Config(vocab_size=SPM_VOCAB, feed_forward_proj="relu", **T5_KW)))
    if kind == "t5_v1_1":
        hf = T5ForConditionalGeneration(T5Config(vocab_size=128, feed_forward_proj="gated-gelu",
                                                 tie_word_embeddings=False, **T5_KW))
    else:
        hf = MT5ForConditionalGeneration(MT5Config(vocab_size=128, **T5_KW))
    # transformers 5 builds every T5 tied; real v1.1 / mT5 checkpoints have their own head.
    hf.lm_head.weight = torch.nn.Parameter(torch.randn(128, T5_KW["d_model"]) * 0.2)
    return _randomise(hf)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    _gpt2().save_pretrained(path)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(ROOT / "data_test" / "gpt2" / name, path)
    return path


@pytest.fixture(scope="module")
def t5_bin_dir(tmp_path_factory):
    """T5 v1.0 as an old-style pytorch_model.bin (transformers 5 only writes safetensors) with a tokenizer."""
    path = tmp_path_factory.mktemp("hf") / "t5"
    hf = _t5("t5")
    hf.save_pretrained(path)
    torch.save(hf.state_dict(), path / "pytorch_model.bin")  # with the tied copies, as old versions saved it
    (path / "model.safetensors").unlink()
    shutil.copy(ROOT / "data_test" / "spm" / "spiece.model", path)
    (path / "tokenizer_config.json").write_text(json.dumps({"extra_ids": 100}))
    return path


def _right_padded(vocab, batch=3, length=20, seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, 13:] = 0
    mask[2, 6:] = 0
    return ids, mask


def _t5_batch(vocab):
    enc, enc_mask = _right_padded(vocab, 3, 20, seed=3)
    dec, dec_mask = _right_padded(vocab, 3, 12, seed=4)
    dec_mask[1, 9:] = 0
    return enc, enc_mask, dec, dec_mask


def _gpt_logits_match(ours, hf, vocab):
    """Our logits at the real (unpadded) positions equal transformers' with the attention mask."""
    ids, mask = _right_padded(vocab)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids)["logits"][..., :vocab]
    keep = mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], atol=1e-5, rtol=1e-5)


def _t5_logits_match(ours, hf, vocab):
    enc, enc_mask, dec, dec_mask = _t5_batch(vocab)
    with torch.no_grad():
        expected = hf(input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec,
                      decoder_attention_mask=dec_mask).logits
        got = ours(enc, dec, encoder_attn_mask=enc_mask, decoder_attn_mask=dec_mask)["logits"][..., :vocab]
        unmasked = ours(enc, dec)["logits"][..., :vocab]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (unmasked - expected).abs().max() > 1e-3  # the padding matters, so the masks were exercised


def _load_imported(out, model_cls):
    """What train.load_weight does: build from the generated config's model.cfg, load with the Checkpointer."""
    cfg = LazyConfig.load(out / "config.py")
    assert cfg.train.load_weight == str(out)
    model = model_cls(OmegaConf.to_container(cfg.model.cfg, resolve=True))
    Checkpointer(model).load(str(out), weights_only=True)
    return cfg, model.eval()


# ----------------------------------------------------------------------------------- GPT-2


def test_gpt2_import_matches_transformers_and_export_gives_the_same_weights_back(gpt2_dir, tmp_path):
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    out, exp = tmp_path / "imported", tmp_path / "exported"
    assert main(["import", "--model", "gpt2", "--hf-dir", str(gpt2_dir), "--output", str(out)]) == 0
    assert {".metadata", "config.py", "vocab.json", "merges.txt"} <= set(os.listdir(out))
    assert not os.path.exists(str(out) + ".tmp")
    cfg, ours = _load_imported(out, GPTForPreTraining)
    # Padded as the trainer pads the tokenizer's 8000 ids at tp=1 (a multiple of 128).
    assert cfg.model.cfg.vocab_size == 8064 and cfg.tokenization.make_vocab_size_divisible_by == 128
    assert cfg.model.cfg.activation == "gelu_tanh" and cfg.model.cfg.max_seq_length == 32
    _gpt_logits_match(ours, hf, GPT_VOCAB)
    emb = ours.GPT_model.embeddings.token_embeddings.weight
    assert ours.GPT_model.lm_head.weight is emb
    torch.testing.assert_close(emb[GPT_VOCAB:], emb[:GPT_VOCAB].mean(0).expand(64, -1))

    old_mask = os.umask(0o022)
    try:
        assert main(["export", "--config-file", str(out / "config.py"), "--checkpoint", str(out),
                     "--output", str(exp)]) == 0
    finally:
        os.umask(old_mask)
    assert {"config.json", "generation_config.json", "model.safetensors", "vocab.json", "merges.txt"} <= set(
        os.listdir(exp))
    # safetensors writes 0600; every exported file follows the umask like the JSON files do.
    assert {oct(os.stat(exp / n).st_mode & 0o777) for n in os.listdir(exp)} == {oct(0o644)}
    back = GPT2LMHeadModel.from_pretrained(exp).eval()
    assert back.config.vocab_size == GPT_VOCAB  # the padded rows are cut to the tokenizer's vocabulary
    assert back.config.eos_token_id == back.config.bos_token_id == 0  # data_test's <|endoftext|>
    original = hf.state_dict()
    for key, value in back.state_dict().items():
        assert torch.equal(value, original[key]), key  # a pure permutation: bit for bit
    _gpt_logits_match(ours, back, GPT_VOCAB)


def test_gpt2_hub_layout_without_transformer_prefix_loads(tmp_path):
    """OpenAI's `gpt2` on the Hub is a bare GPT2Model: keys without `transformer.`, plus old mask buffers."""
    hf = _gpt2(vocab=100)
    sd = {k[len("transformer."):]: v for k, v in hf.state_dict().items() if k.startswith("transformer.")}
    sd["h.0.attn.bias"] = torch.ones(1, 1, 32, 32).tril()
    hf.config.save_pretrained(tmp_path)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    model_type, cfg, ours = load_hf_model(str(tmp_path))
    assert model_type == "gpt2" and cfg["vocab_size"] == 100 and not ours.training
    _gpt_logits_match(ours, hf, 100)


# ------------------------------------------------------------------------------ T5 family


def test_t5_v1_0_from_pytorch_bin_tied_and_scaled_round_trip(t5_bin_dir, tmp_path):
    from transformers import T5ForConditionalGeneration

    hf = T5ForConditionalGeneration.from_pretrained(t5_bin_dir).eval()
    model_type, cfg, ours = load_hf_model(str(t5_bin_dir))
    assert model_type == "t5" and cfg["model_type"] == "t5" and cfg["tie_word_embeddings"] is True
    assert ours.mt5_model.lm_head.weight is ours.mt5_model.embedding.weight
    _t5_logits_match(ours, hf, SPM_VOCAB)

    out, exp = tmp_path / "imported", tmp_path / "exported"
    assert main(["import", "--model", "t5", "--hf-dir", str(t5_bin_dir), "--output", str(out)]) == 0
    cfg, ours = _load_imported(out, MT5ForPreTraining)
    assert cfg.model.cfg.vocab_size == 4224 and cfg.tokenization.tokenizer.extra_ids == 100
    assert cfg.train.dist.pipeline_num_layers == 4 and cfg.train.dist.tensor_parallel_size == 1
    _t5_logits_match(ours, hf, SPM_VOCAB)

    assert main(["export", "--config-file", str(out / "config.py"), "--checkpoint", str(out),
                 "--output", str(exp)]) == 0
    hf_config = json.loads((exp / "config.json").read_text())
    assert hf_config["model_type"] == "t5" and hf_config["tie_word_embeddings"] is True
    assert hf_config["vocab_size"] == SPM_VOCAB and hf_config["decoder_start_token_id"] == 0
    assert "lm_head.weight" not in read_hf_state_dict(str(exp))  # tied: written once, as shared.weight
    assert json.loads((exp / "tokenizer_config.json").read_text())["extra_ids"] == 100
    back = T5ForConditionalGeneration.from_pretrained(exp).eval()
    _t5_logits_match(ours, back, SPM_VOCAB)


@pytest.mark.parametrize("kind", ["mt5", "t5_v1_1"])
def test_untied_gated_gelu_from_sharded_safetensors_and_back(kind, tmp_path):
    from transformers import MT5ForConditionalGeneration, T5ForConditionalGeneration

    hf = _t5(kind)
    hf_dir = tmp_path / "hf"
    hf.save_pretrained(hf_dir, max_shard_size="40KB")
    assert (hf_dir / "model.safetensors.index.json").is_file()
    if kind == "mt5":  # as on the Hub: transformers 5 writes true, older mT5 configs say false
        config = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    model_type, cfg, ours = load_hf_model(str(hf_dir))
    assert model_type == ("mt5" if kind == "mt5" else "t5")
    # Either way our architecture is the gated-GELU, untied, unscaled one.
    assert cfg["model_type"] == "mt5" and cfg["tie_word_embeddings"] is False
    assert not torch.equal(ours.mt5_model.lm_head.weight, ours.mt5_model.embedding.weight)
    _t5_logits_match(ours, hf, 128)

    exp = tmp_path / "exported"
    save_hf_model(ours, cfg, str(exp))
    hf_config = json.loads((exp / "config.json").read_text())
    assert hf_config["model_type"] == "mt5" and hf_config["tie_word_embeddings"] is False
    assert "lm_head.weight" in read_hf_state_dict(str(exp))
    back = MT5ForConditionalGeneration.from_pretrained(exp).eval()
    assert not torch.equal(back.lm_head.weight, back.shared.weight)
    _t5_logits_match(ours, back, 128)
    assert isinstance(back, MT5ForConditionalGeneration) and not isinstance(back, T5ForConditionalGeneration)


def test_resize_vocab_rows_keeps_a_tie_and_pads_with_the_mean():
    w = torch.randn(10, 4)
    out = resize_vocab_rows({"emb": w, "head": w, "other": torch.ones(3)}, ("emb", "head"), 16)
    assert out["emb"] is out["head"] and out["emb"].shape == (16, 4) and torch.equal(out["emb"][:10], w)
    torch.testing.assert_close(out["emb"][10:], w.mean(0).expand(6, 4))
    assert resize_vocab_rows(out, ("emb", "head"), 10)["emb"].shape == (10, 4)


# ------------------------------------- fine-tune from an import under a parallel layout, export


LAYOUTS = {
    # name: (processes, import --tensor-parallel-size, overrides, padded vocabulary)
    "tp2": (2, 2, ["train.dist.tensor_parallel_size=2", "train.train_micro_batch_size=4"], 8064),
    "pp2": (2, 1, ["train.dist.pipeline_parallel_size=2", "train.train_micro_batch_size=2"], 8064),
    "dp2_zero3": (2, 1, ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=3",
                         "train.train_micro_batch_size=2"], 8064),
}


@pytest.mark.parametrize("layout", ["tp2", pytest.param("pp2", marks=pytest.mark.slow),
                                    pytest.param("dp2_zero3", marks=pytest.mark.slow)])
def test_import_fine_tune_under_a_layout_then_export_matches_our_one_process_model(layout, gpt2_dir, tmp_path,
                                                                                   monkeypatch, capsys):
    """The generated config trains as is (the vocabulary padded to 8064 rows whatever the layout); the
    export of the resulting checkpoint reproduces our one-process model loaded from it."""
    from transformers import GPT2LMHeadModel

    nproc, tp, overrides, padded = LAYOUTS[layout]
    out = tmp_path / "imported"
    assert main(["import", "--model", "gpt2", "--hf-dir", str(gpt2_dir), "--output", str(out),
                 "--tensor-parallel-size", str(tp)]) == 0
    run = tmp_path / "run"
    r = train_ranks(nproc, [f"train.output_dir={run}", f"dataloader.train.cache_dir={tmp_path / 'cache'}",
                            "dataloader.train.num_workers=0", "train.train_iter=2", "train.global_batch_size=4",
                            "train.log_period=1", "train.evaluation.enabled=False", "train.checkpointer.period=1000",
                            "optim.lr=1e-2", *overrides], config=str(out / "config.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"Loaded weights from {out}" in (run / "log.txt").read_text()
    ckpt = run / "model_final"
    assert checkpoint_vocab_size(str(ckpt), GPTForPreTraining) == padded  # 8064 at tp2 too: one model

    exp = tmp_path / "exported"
    monkeypatch.chdir(ROOT)  # config.yaml names the tokenizer files relative to where the run started
    assert main(["export", "--config-file", str(run / "config.yaml"), "--checkpoint", str(ckpt),
                 "--output", str(exp)]) == 0
    assert f"{padded} rows in the checkpoint, cut to the tokenizer's 8000" in capsys.readouterr().out
    ours = GPTForPreTraining(dict(OmegaConf.to_container(LazyConfig.load(run / "config.yaml").model.cfg),
                                  vocab_size=padded))
    Checkpointer(ours).load(str(ckpt), weights_only=True)
    back = GPT2LMHeadModel.from_pretrained(exp).eval()
    _gpt_logits_match(ours.eval(), back, GPT_VOCAB)
    # Two steps at lr 1e-2 moved the weights: the export is the fine-tuned model, not the import.
    original = GPT2LMHeadModel.from_pretrained(gpt2_dir).state_dict()
    for key in ("transformer.h.0.attn.c_attn.weight", "transformer.wte.weight"):
        assert not torch.equal(back.state_dict()[key], original[key][: back.state_dict()[key].shape[0]]), key


# ------------------------------------------------------------------------------- bad input


def _error(capsys, argv) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_import_refuses_bad_input_with_one_line(t5_bin_dir, gpt2_dir, tmp_path, capsys):
    out = tmp_path / "out"
    imp = ["import", "--output", str(out)]
    assert "holds a 't5' model (config.json model_type) but --model gpt2 was given; use --model t5" in _error(
        capsys, imp + ["--model", "gpt2", "--hf-dir", str(t5_bin_dir)])
    # The list names every registered type: the built-in ones, and any project another test imported.
    msg = _error(capsys, imp + ["--model", "falcon", "--hf-dir", str(gpt2_dir)])
    assert "model type 'falcon' has no registered Hugging Face mapping; use one of gpt2, " in msg
    assert all(f" {t}," in msg for t in ("llama", "mistral", "mixtral", "mt5", "qwen2"))
    assert "does not exist" in _error(capsys, imp + ["--model", "gpt2", "--hf-dir", str(tmp_path / "nowhere")])
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in _error(capsys, imp + ["--model", "gpt2", "--hf-dir", str(tmp_path / "empty")])
    (tmp_path / "config_only").mkdir()
    shutil.copy(gpt2_dir / "config.json", tmp_path / "config_only")
    assert "has no weights" in _error(capsys, imp + ["--model", "gpt2", "--hf-dir", str(tmp_path / "config_only")])
    assert not out.exists() and not (tmp_path / "out.tmp").exists()

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "exists and is not empty" in _error(capsys, imp + ["--model", "gpt2", "--hf-dir", str(gpt2_dir)])
    assert os.listdir(out) == ["keep.txt"]
    assert main(imp + ["--model", "gpt2", "--hf-dir", str(gpt2_dir), "--force"]) == 0
    assert (out / ".metadata").is_file() and not (out / "keep.txt").exists()


def test_export_refuses_a_checkpoint_of_another_shape_and_writes_nothing(gpt2_dir, tmp_path, capsys):
    out = tmp_path / "imported"
    assert main(["import", "--model", "gpt2", "--hf-dir", str(gpt2_dir), "--output", str(out)]) == 0
    capsys.readouterr()
    exp = tmp_path / "exported"
    base = ["export", "--config-file", str(out / "config.py"), "--output", str(exp)]
    msg = _error(capsys, base + ["--checkpoint", str(out), "model.cfg.hidden_size=32"])
    assert "another model shape; model.cfg.hidden_size=32 gives 32 where it has 64" in msg
    assert "missing or incomplete" in _error(capsys, base + ["--checkpoint", str(tmp_path / "nowhere")])
    assert "Unknown config key" in _error(capsys, base + ["--checkpoint", str(out), "model.cfg.hiden_size=32"])
    unmapped = tmp_path / "unmapped.py"
    unmapped.write_text("from torch import nn\nfrom libai_lite.config import LazyCall\n"
                        "model = LazyCall(nn.Identity)(cfg={})\n")
    msg = _error(capsys, ["export", "--config-file", str(unmapped), "--checkpoint", str(out), "--output", str(exp)])
    assert "Identity has no Hugging Face mapping (registered: GPTForPreTraining, LlamaForPreTraining, " in msg
    assert "MT5ForPreTraining" in msg
    assert not exp.exists() and not (tmp_path / "exported.tmp").exists()


def test_command_line_error_is_one_line_and_exit_status_1(tmp_path):
    r = python_tool([sys.executable, "tools/hf_convert.py", "import", "--model", "t5", "--hf-dir",
                     str(tmp_path / "missing"), "--output", str(tmp_path / "out")], timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: ")
    assert "Traceback" not in r.stderr and "does not exist" in r.stderr


def test_load_hf_model_refuses_unknown_architectures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    with pytest.raises(UsageError, match="model_type='falcon'.*converts gpt2, "):
        load_hf_model(str(tmp_path))


def test_a_subclass_without_a_mapping_of_its_own_exports_through_its_base_class():
    class Tweaked(GPTForPreTraining):
        pass

    assert mapping_for_model(Tweaked) is mapping_for_model(GPTForPreTraining)
    assert mapping_for_model(Tweaked).model_types == ("gpt2",)


# ------------------------------------------------------------------- a project copied elsewhere


_COPY_SCRIPT = """
import sys
sys.path.insert(0, "tools")
from hf_convert import main

config, hf_dir, imported, exported = sys.argv[1:]
assert main(["import", "--config-file", config, "--hf-dir", hf_dir, "--output", imported]) == 0
assert main(["export", "--config-file", imported + "/config.py", "--checkpoint", imported, "--output", exported]) == 0

from libai_lite.checkpoint.hf import mapping_for_model
from MyLM.modeling.gpt_model import MyLMForPreTraining

mapping = mapping_for_model(MyLMForPreTraining)
assert mapping.model_class is MyLMForPreTraining, mapping
assert mapping.state_dict_to_hf.__module__ == "MyLM.modeling.hf_mapping", mapping.state_dict_to_hf.__module__
assert "projects.GPT.modeling" not in sys.modules, "the built-in GPT project was imported"
"""


def test_a_copied_project_converts_through_its_own_registered_mapping(tmp_path):
    """projects/GPT copied to MyLM with its classes renamed: importing MyLMForPreTraining registers the copy's
    hf_mapping, import (--config-file of a MyLM config) and export go through it, and transformers reloads
    the export with the original model's logits. In a subprocess: only the copy is registered there."""
    from transformers import GPT2LMHeadModel

    shutil.copytree(ROOT / "projects" / "GPT", tmp_path / "MyLM", ignore=shutil.ignore_patterns("__pycache__"))
    for path in (tmp_path / "MyLM" / "modeling").glob("*.py"):
        path.write_text(re.sub(r"\bGPT(Model|ForPreTraining|Embedding|Loss)\b", r"MyLM\1", path.read_text()))
    hf = _gpt2(vocab=100)
    hf.save_pretrained(tmp_path / "hf")
    config = tmp_path / "mylm.py"
    config.write_text(textwrap.dedent("""\
        from configs.common.data.gpt_dataset import dataloader, tokenization
        from configs.common.optim import optim
        from configs.common.train import train
        from libai_lite.config import LazyCall
        from MyLM.modeling.gpt_model import MyLMForPreTraining

        model = LazyCall(MyLMForPreTraining)(cfg=dict(hidden_layers=1, vocab_size=128, hidden_size=16,
                                                      ffn_hidden_size=32, num_attention_heads=2, max_seq_length=32))
        """))
    imported, exported = tmp_path / "imported", tmp_path / "exported"
    r = subprocess.run([sys.executable, "-c", _COPY_SCRIPT, str(config), str(tmp_path / "hf"), str(imported),
                        str(exported)], cwd=ROOT, env=env(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "(MyLMForPreTraining)" in r.stdout.splitlines()[0]  # the import built the copy's class
    assert "(MyLMForPreTraining) to" in r.stdout and "as GPT2LMHeadModel" in r.stdout
    assert str(config) in (imported / "config.py").read_text()  # the fine-tuning config starts from the user's

    back = GPT2LMHeadModel.from_pretrained(exported).eval()
    assert back.config.vocab_size == 128  # padded on import; no tokenizer in the config to cut it back
    ids, mask = _right_padded(100)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        got = back(input_ids=ids, attention_mask=mask).logits[..., :100]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# -m slow: the same verification refuses flipped bytes by default in
# tests/checkpoint/test_checkpoint_integrity.py (resume and generate, with and without --no-verify)
@pytest.mark.slow
def test_export_refuses_a_corrupt_checkpoint_and_no_verify_exports_it(tmp_path):
    """Flipped bits in a shard stop the export in one line; --no-verify (the user's risk) exports it."""

    from tests.launch import tiny, train_net

    run = tmp_path / "run"
    r = train_net(tiny(run, tmp_path / "cache", "train.train_iter=2", "train.evaluation.enabled=False"))
    assert r.returncode == 0, r.stderr[-3000:]
    shard = sorted((run / "model_final").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    cmd = [sys.executable, "tools/hf_convert.py", "export", "--config-file", "projects/GPT/configs/gpt2_pretrain.py",
           "--checkpoint", str(run / "model_final")]
    small = [f"model.cfg.{k}" for k in ("hidden_layers=2", "hidden_size=64", "ffn_hidden_size=128",
                                         "num_attention_heads=2", "max_seq_length=32")]
    r = python_tool(cmd + ["--output", str(tmp_path / "hf"), *small], timeout=300)
    assert r.returncode != 0 and "CRC-32 mismatch" in r.stderr and not (tmp_path / "hf").exists(), r.stderr[-2000:]
    r = python_tool(cmd + ["--output", str(tmp_path / "hf2"), "--no-verify", *small], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "hf2" / "config.json").exists()
