"""LiBai's own config files (unmodified copies in ../shared/fixtures/libai) load and train here.

Only data paths (and, for speed, sizes and iterations) are overridden on the command line; the
files are read where they are, never copied into the project. Without ../shared beside the clone these
tests skip, saying so; tests/compat/test_libai_samples.py covers LiBai-format configs without it.
"""
import json
import shutil
import sys
import textwrap

import pytest
import torch

from libai_lite.config import ConfigLoadError, LazyConfig, instantiate
from tests.launch import ROOT, one_error_line, python_tool

GPT = "configs/gpt2_pretrain.py"
T5 = "configs/t5_large_pretrain.py"
MT5 = "projects/MT5/configs/mt5_pretrain.py"


@pytest.fixture(scope="module")
def libai_tree():
    path = ROOT.parent / "shared" / "fixtures" / "libai"
    if not (path / GPT).is_file():
        pytest.skip("../shared/fixtures/libai not found beside the clone: these tests read LiBai's own config files "
                    "from it (tests/compat/test_libai_samples.py trains LiBai-format configs without it)")
    return path


def data_overrides(tmp_path, kind: str, test_set: bool = True) -> list:
    """The data paths of a LiBai config pointed at a copy of the demo data (index caches go beside it)."""
    src = ROOT / "data_test" / kind
    dst = tmp_path / kind
    dst.mkdir()
    for f in src.glob(f"demo_{kind}_text_document.*"):
        if f.suffix in (".bin", ".idx"):
            shutil.copy(f, dst)
    prefix = dst / f"demo_{kind}_text_document"
    out = [f"dataloader.train.dataset.0.data_prefix={prefix}",
           f"dataloader.train.dataset.0.indexed_dataset.data_prefix={prefix}"]
    if test_set:
        out += [f"dataloader.test.0.dataset.data_prefix={prefix}",
                f"dataloader.test.0.dataset.indexed_dataset.data_prefix={prefix}"]
    if kind == "gpt2":
        return out + [f"tokenization.tokenizer.vocab_file={src / 'vocab.json'}",
                      f"tokenization.tokenizer.merges_file={src / 'merges.txt'}"]
    return out + [f"tokenization.tokenizer.vocab_file={src / 'vocab.txt'}"]


# Speed only: a tiny model, a few iterations, no worker processes.
COMMON = ["train.train_iter=3", "train.train_micro_batch_size=2", "train.test_micro_batch_size=2", "train.log_period=1",
          "train.evaluation.eval_period=2", "train.evaluation.eval_iter=1", "dataloader.train.num_workers=0",
          "+train.log_memory_estimate=False"]
TINY = {
    GPT: ["model.cfg.hidden_layers=2", "model.cfg.hidden_size=64", "model.cfg.ffn_hidden_size=128",
          "model.cfg.num_attention_heads=4", "model.cfg.max_seq_length=32",
          "dataloader.train.dataset.0.max_seq_length=32",
          "train.dist.pipeline_num_layers=2"],
    T5: ["model.cfg.hidden_layers=1", "model.cfg.hidden_size=32", "model.cfg.intermediate_size=64",
         "model.cfg.num_attention_heads=2", "dataloader.train.dataset.0.max_seq_length=32",
         "dataloader.train.dataset.0.max_seq_length_dec=16", "train.dist.pipeline_num_layers=2"],
    MT5: ["model.cfg.hidden_layers=1", "model.cfg.hidden_size=32", "model.cfg.head_size=16",
          "model.cfg.intermediate_size=64", "model.cfg.num_attention_heads=2",
          "dataloader.train.dataset.0.max_seq_length=32",
          "dataloader.train.dataset.0.max_seq_length_dec=16", "train.dist.pipeline_num_layers=2", "train.train_epoch=0",
          "train.num_accumulation_steps=1"],
}
KIND = {GPT: "gpt2", T5: "bert", MT5: "bert"}


def train(libai_tree, tmp_path, config):
    out = tmp_path / "out"
    args = [*data_overrides(tmp_path, KIND[config], test_set=config != MT5), *COMMON, *TINY[config],
            f"train.output_dir={out}"]
    r = python_tool([sys.executable, "tools/train_net.py", "--config-file", str(libai_tree / config), *args], timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.json").read_text().splitlines()]
    losses = [row["total_loss"] for row in rows if "total_loss" in row]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses), losses
    return r, out


def test_gpt2_pretrain_trains_unchanged(libai_tree, tmp_path):
    r, out = train(libai_tree, tmp_path, GPT)
    warning = next(line for line in r.stderr.splitlines() if "LiBai keys with no effect here" in line)
    for key in ("graph", "train.input_placement_device", "train.rdma_enabled", "train.nccl_fusion_threshold_mb",
                "train.nccl_fusion_max_ops", "eval_metric=Acc@1"):
        assert key in warning
    saved = (out / "config.yaml").read_text()
    # LiBai's amp is fp16; the graph section is gone; the model is this project's GPT.
    assert "dtype: fp16" in saved and "graph" not in saved.split("\ntrain:")[0]
    assert "_target_: projects.GPT.modeling" in saved


@pytest.mark.slow
def test_t5_large_pretrain_trains_unchanged(libai_tree, tmp_path):
    r, out = train(libai_tree, tmp_path, T5)
    log = (out / "log.txt").read_text()
    # LiBai's Megatron-style T5 is T5 v1.0 here; its demo data is not sentence-split: both said at start-up.
    assert "max_position_embeddings=512" in log and "short_seq_prob" in log


@pytest.mark.slow
def test_mt5_pretrain_trains_unchanged(libai_tree, tmp_path):
    # LiBai's dp=2 x tp=2 on one process: dp = world / (tp x pp) and tp capped at the world size, as in LiBai.
    train(libai_tree, tmp_path, MT5)


def test_configs_load_as_this_projects_objects(libai_tree):
    gpt = LazyConfig.load(libai_tree / GPT)
    assert "graph" not in gpt and gpt.train.amp.dtype == "fp16"
    assert gpt.train.evaluation.eval_metric == "PPL"
    assert gpt.dataloader.train._target_.__module__ == "compat.libai.data"
    assert gpt.optim._target_.__module__ == "compat.libai.optim"
    t5 = LazyConfig.load(libai_tree / T5)
    assert t5.model._target_.__module__ == "compat.libai.mt5"
    assert t5.model._target_.__name__ == "T5ForPreTraining"
    mt5 = LazyConfig.load(libai_tree / MT5)
    assert mt5.model._target_.__name__ == "MT5ForPreTraining" and mt5.model.cfg.initializer_range == 0.02
    # LiBai's train.update(...) kept its own keys: the file's evaluation, scheduler and dist.
    assert mt5.train.scheduler._target_.__name__ == "WarmupExponentialLR"
    assert mt5.train.dist.tensor_parallel_size == 2
    # LiBai's data_parallel_size=2 is ignored there (world / (tp x pp)): null here, so the launch decides.
    assert mt5.train.dist.data_parallel_size is None
    # No libai or oneflow module is left behind for a real LiBai install to trip over.
    assert not [m for m in sys.modules if m.split(".")[0] in ("libai", "oneflow")]


def test_libai_initializer_range_is_a_standard_deviation(libai_tree):
    """LiBai's MT5 initializer_range=0.02 is N(0, 0.02) (outputs / sqrt(2L)); a T5 factor of 0.02 is ~28x smaller."""
    cfg = LazyConfig.load(libai_tree / MT5)
    cfg.model.cfg.update(hidden_size=256, head_size=32, num_attention_heads=8, intermediate_size=512, hidden_layers=2,
                         vocab_size=512)
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    params = dict(model.named_parameters())
    qkv = params["mt5_model.encoder_layers.0.self_attention.query_key_value.weight"]
    out = params["mt5_model.encoder_layers.0.mlp.dense_4h_to_h.weight"]
    # Sample std of 196k / 131k normal draws: within 2% of the std.
    assert abs(qkv.std().item() / 0.02 - 1) < 0.02
    assert abs(out.std().item() / (0.02 / 2.0) - 1) < 0.02
    assert abs(params["mt5_model.embedding.weight"].std().item() / 0.02 - 1) < 0.02


def test_a_real_libai_install_keeps_working(libai_tree, tmp_path, monkeypatch):
    fake = tmp_path / "site" / "libai"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    LazyConfig.load(libai_tree / GPT)
    try:
        import libai

        assert libai.REAL and libai.__file__ == str(fake / "__init__.py")
    finally:
        sys.modules.pop("libai", None)


def test_unknown_libai_name_is_refused_in_one_line(tmp_path):
    cfg = tmp_path / "c.py"
    cfg.write_text(textwrap.dedent("""
        from libai.config import LazyCall
        from libai.models import SwinTransformer
        model = LazyCall(SwinTransformer)()
    """))
    with pytest.raises(ConfigLoadError, match=r"libai.models.SwinTransformer has no counterpart in libai_lite"):
        LazyConfig.load(cfg)


def test_do_bias_correction_false_is_refused_in_one_line(libai_tree, tmp_path):
    args = [*data_overrides(tmp_path, "gpt2"), *COMMON, *TINY[GPT], f"train.output_dir={tmp_path / 'o'}",
            "optim.do_bias_correction=False"]
    r = python_tool([sys.executable, "tools/train_net.py", "--config-file", str(libai_tree / GPT), *args], timeout=300)
    assert r.returncode == 1
    assert "optim.do_bias_correction=False" in one_error_line(r)
