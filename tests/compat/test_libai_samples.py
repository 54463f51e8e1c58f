"""LiBai-format configs of the T5 and Llama projects load and train here, with no ../shared beside the clone.

The configs are ``tests/compat/samples/libai`` (LiBai's tree layout, written for these tests); sizes and
data paths are overridden on the command line, and the data is made here in the formats LiBai's projects read:
Hugging Face ``datasets`` folders of token windows (its T5 project) and ``torch.save`` lists of Alpaca samples
(its Llama project). LiBai's own files are ``tests/compat/test_libai_configs.py``'s, which needs ../shared.
"""
import json
import logging
import math
import pickle
import textwrap

import numpy as np
import pytest
import torch

from compat.libai import notice as libai_notice
from compat.libai.data import build_nlp_train_loader, build_nlp_train_val_test_loader
from libai_lite.config import ConfigLoadError, LazyConfig, default_argument_parser, instantiate
from libai_lite.config.instantiate import InstantiationError, instantiate_with
from libai_lite.data.gpt_dataset import IGNORE_INDEX
from libai_lite.utils.errors import UsageError
from tests.launch import ROOT

SAMPLES = ROOT / "tests" / "compat" / "samples" / "libai"
T5 = SAMPLES / "projects" / "T5" / "configs" / "mt5_pretrain.py"
LLAMA = SAMPLES / "projects" / "Llama" / "configs" / "llama_config.py"
SFT = SAMPLES / "projects" / "Llama" / "configs" / "llama_sft.py"
SPM = ROOT / "data_test" / "spm" / "spiece.model"  # 4000 pieces; bos 1 would be Llama's, eos 1 here

# T5 span corruption of 34-token windows gives 32 encoder tokens (the collate_fn's max_seq_length) and 8 targets.
T5_VOCAB, T5_ENC, T5_RAW, T5_DEC = 128, 32, 34, 8
T5_ARGS = [f"dataloader.train.collate_fn.vocab_size={T5_VOCAB}", f"dataloader.train.collate_fn.max_seq_length={T5_ENC}",
           "dataloader.train.collate_fn.eos_token_id=101", "dataloader.train.collate_fn.decoder_start_token_id=100",
           f"model.cfg.vocab_size={T5_VOCAB}", "model.cfg.hidden_size=32", "model.cfg.hidden_layers=1",
           "model.cfg.num_attention_heads=2", "model.cfg.head_size=16", "model.cfg.intermediate_size=64",
           "train.train_micro_batch_size=8", "train.train_iter=2"]
LLAMA_ARGS = [f"tokenization.tokenizer.pretrained_model_path={SPM}", "model.cfg.hidden_size=32",
              "model.cfg.intermediate_size=64", "model.cfg.num_attention_heads=2", "model.cfg.hidden_layers=2",
              "model.cfg.max_position_embeddings=32", "model.cfg.pretrained_model_path=null",
              "train.num_accumulation_steps=1", "train.train_micro_batch_size=8",
              "train.train_epoch=1"]
# Speed only: no loader workers, a line per step, no memory estimate.
COMMON = ["+dataloader.train.num_workers=0", "train.log_period=1", "+train.log_memory_estimate=False"]


@pytest.fixture
def in_process(monkeypatch):
    """Run tools/train_net.py's launch in this process from the repository root; give the logger back after, and
    forget the warnings said once per process, so this run says its own."""
    log = logging.getLogger("libai_lite")
    saved = (list(log.handlers), log.propagate, log.level)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(libai_notice, "_warned", set())
    yield
    for h in list(log.handlers):
        if h not in saved[0]:
            log.removeHandler(h)
            h.close()
    log.propagate, log.level = saved[1], saved[2]


def train(config, args) -> int:
    from libai_lite.engine.launch import launch

    return launch(default_argument_parser().parse_args(["--config-file", str(config), *args]))


def losses(out) -> list:
    rows = [json.loads(line) for line in (out / "metrics.json").read_text().splitlines()]
    return [row["total_loss"] for row in rows if "total_loss" in row]


def t5_parts(tmp_path, rows: int = 4):
    """LiBai's T5 project data: folders part_0 ... part_9 of ``rows`` token windows each (40 samples)."""
    datasets = pytest.importorskip("datasets", reason="LiBai's T5 project data is Hugging Face datasets folders")
    rng = np.random.default_rng(0)
    for i in range(10):
        windows = rng.integers(1, 100, size=(rows, T5_RAW)).tolist()
        datasets.Dataset.from_dict({"input_ids": windows}).save_to_disk(str(tmp_path / f"part_{i}"))
    return tmp_path / "part_0"


def alpaca(path, n: int, length: int = 32, prompt: int = 8, end: int = 24, seed: int = 0):
    """Samples as LiBai's prepare_alpaca.py makes them: prompt and padding labelled -1, inputs padded with 0,
    both shifted."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        tokens = torch.randint(3, 4000, (length,), generator=g)
        tokens[end:] = -1
        labels = tokens.clone()
        labels[:prompt] = -1
        tokens[tokens < 0] = 0
        rows.append({"input_ids": tokens[:-1], "labels": labels[1:]})
    torch.save(rows, path)
    return path


def test_t5_project_config_trains(in_process, tmp_path):
    """LiBai's projects/T5 mt5_pretrain.py: mT5 on datasets folders, span-corrupted by its collate_fn, one epoch."""
    out = tmp_path / "out"
    part = t5_parts(tmp_path)
    assert train(T5, [f"dataloader.train.dataset.0.data_path={part}", *T5_ARGS, *COMMON,
                      f"train.output_dir={out}"]) == 0
    log = (out / "log.txt").read_text()
    # train_epoch=1 of LiBai's file over 40 samples in batches of 8 outlasts its train_iter.
    assert "train.train_epoch=1: 40 samples per epoch, train.train_iter set to 5" in log
    assert "weights each target token's loss by its token id" in log
    seen = losses(out)
    # A fresh model predicts about uniformly: the first loss is near ln(vocab).
    assert len(seen) == 5 and abs(seen[0] - math.log(T5_VOCAB)) < 0.2, seen
    saved = LazyConfig.load(out / "config.yaml")
    assert saved.model._target_ == "compat.libai.mt5.T5ProjectForPreTraining"
    assert saved.model.cfg.model_type == "mt5"
    assert saved.dataloader.train.collate_fn._target_ == "compat.libai.mt5.T5SpanCollator"


def test_llama_sft_config_trains(in_process, tmp_path):
    """LiBai's projects/Llama llama_sft.py: its Llama (not this project's projects.Llama module), tokenizer and
    Alpaca samples, counted in epochs, with its fp16 and activation checkpointing."""
    out = tmp_path / "out"
    train_file, test_file = alpaca(tmp_path / "train", 16), alpaca(tmp_path / "test", 4, seed=1)
    assert train(SFT, [f"dataloader.train.dataset.0.path={train_file}", f"dataloader.test.0.dataset.path={test_file}",
                       *LLAMA_ARGS, *COMMON, f"train.output_dir={out}"]) == 0
    log = (out / "log.txt").read_text()
    assert "train.train_epoch=1: 16 samples per epoch, train.train_iter set to 2" in log
    assert "Tokenizer with 4000 ids" in log and "Activation checkpointing (full) on 2 of 2" in log
    seen = losses(out)
    assert len(seen) == 2 and abs(seen[0] - math.log(4000)) < 0.2, seen
    saved = LazyConfig.load(out / "config.yaml")
    assert saved.model._target_ == "compat.libai.llama.LlamaForCausalLM"
    assert saved.train.amp.dtype == "fp16"
    # The dataset's copy of the tokenizer follows the override of tokenization.tokenizer.
    assert saved.dataloader.train.dataset[0].tokenizer.pretrained_model_path == str(SPM)


def test_llama_config_builds_this_llama_with_libai_keys():
    cfg = LazyConfig.load(LLAMA)
    assert cfg.model._target_.__module__ == "compat.libai.llama"
    cfg.model.cfg.update(hidden_size=64, intermediate_size=96, num_attention_heads=4, hidden_layers=2, vocab_size=256,
                         max_position_embeddings=48, pretrained_model_path=None)
    model = instantiate(cfg.model)
    llama = model.llama
    assert type(model).__name__ == "LlamaForPreTraining"
    assert (llama.max_seq_length, llama.head_size, llama.tie_word_embeddings) == (48, 16, False)
    assert llama.layers["0"].mlp.dense_h_to_4h.weight.shape == (2 * 96, 64)  # SwiGLU's gate and up
    assert llama.final_layernorm.eps == 1e-5  # rms_norm_eps


@pytest.fixture
def warnings_said(monkeypatch):
    """The messages the ``libai_lite`` logger warns from here on (warnings said once per process said afresh)."""
    monkeypatch.setattr(libai_notice, "_warned", set())
    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    log = logging.getLogger("libai_lite")
    log.addHandler(handler)
    yield said
    log.removeHandler(handler)


def test_what_differs_from_libai_is_said(warnings_said):
    t5 = LazyConfig.load(T5)
    said = " ".join(warnings_said)
    assert "train.evaluation.enabled (dataloader.train is build_nlp_train_loader, which makes no valid split" in said
    assert "train.dist.data_parallel_size=2 is world / (tp x pp) in LiBai" in said
    assert t5.train.dist.data_parallel_size is None
    # Computed from hidden_layers when the file loaded: a command-line hidden_layers would leave it stale.
    assert "train.dist.pipeline_num_layers=16 is the model's layer count, derived from the model here" in said
    assert t5.train.dist.pipeline_num_layers is None
    t5.model.cfg.update(hidden_size=32, hidden_layers=1, num_attention_heads=2, head_size=16, intermediate_size=64,
                        vocab_size=64, model_type="t5")
    assert instantiate(t5.model).mt5_model.tie_word_embeddings
    assert "model_type='t5' ties the head without scaling the decoder output" in warnings_said[-1]

    llama = LazyConfig.load(LLAMA)
    llama.model.cfg.update(hidden_size=32, intermediate_size=64, num_attention_heads=2, hidden_layers=1,
                           vocab_size=64, pretrained_model_path=None, rope_scaling={"type": "linear", "factor": 2.0},
                           tie_word_embeddings=True)
    # LiBai's Llama reads neither key: its head stays untied and its rotary frequencies unscaled.
    model = instantiate(llama.model).llama
    assert not model.tie_word_embeddings and model.layers["0"].self_attention.rotary.scaling is None
    line = warnings_said[-1]
    assert line.startswith("LiBai keys with no effect here: model.cfg.rope_scaling=")
    assert "model.cfg.tie_word_embeddings=True" in line and "generation settings is_encoder_decoder" in line


def test_llama_pretrained_model_path_is_refused_with_the_converter():
    cfg = LazyConfig.load(LLAMA)
    with pytest.raises(InstantiationError, match=r"pretrained_model_path.*tools/hf_convert.py import --model llama"):
        instantiate(cfg.model)


def test_t5_collate_fn_corrupts_spans_as_libai():
    cfg = LazyConfig.load(T5)
    cfg.dataloader.train.collate_fn.update(vocab_size=T5_VOCAB, max_seq_length=T5_ENC)
    collate = instantiate(cfg.dataloader.train.collate_fn)
    window = np.arange(1, T5_RAW + 1)
    a, b = collate.prepare({"input_ids": window}, 7), collate.prepare({"input_ids": window}, 8)
    assert a["encoder_input_ids"].shape == (T5_ENC,) and a["labels"].shape == (T5_DEC,)
    enc, labels = a["encoder_input_ids"].tolist(), a["labels"].tolist()
    assert enc[-1] == labels[-1] == 12801 and a["decoder_input_ids"].tolist() == [12800] + labels[:-1]
    # Sentinels count down from the top of the vocabulary; putting each span back behind its sentinel
    # gives the window again.
    spans, current = {}, []
    for t in labels[:-1]:
        if t >= T5_VOCAB - 8:
            current = spans[t] = []
        else:
            current.append(t)
    assert len(spans) >= 1 and list(spans) == list(range(T5_VOCAB - 1, T5_VOCAB - 1 - len(spans), -1))
    rebuilt = [x for t in enc[:-1] for x in (spans[t] if t in spans else [t])]
    assert rebuilt == window.tolist()
    # A sample depends on its position alone.
    assert torch.equal(collate.prepare({"input_ids": window}, 7)["labels"], a["labels"])
    assert not torch.equal(a["encoder_input_ids"], b["encoder_input_ids"])
    with pytest.raises(UsageError, match=r"holds 33 tokens.*needs windows of 34"):
        collate.prepare({"input_ids": window[:-1]}, 0)


def test_alpaca_labels_skip_what_libai_skips(tmp_path):
    from compat.libai.llama import AlpacaDataset

    path = alpaca(tmp_path / "train", 2)
    raw = torch.load(path)
    ds = AlpacaDataset(path)
    sample = ds[0]
    assert torch.equal(sample["input_ids"], raw[0]["input_ids"])
    # LiBai's loss drops labels <= 0 (the prompt, the padding, and <unk>=0).
    kept = raw[0]["labels"] > 0
    assert torch.equal(sample["labels"][kept], raw[0]["labels"][kept])
    assert (sample["labels"][~kept] == IGNORE_INDEX).all() and int((~kept).sum()) == 7 + 8


def test_alpaca_written_by_flow_save_is_refused_naming_the_format(tmp_path):
    from compat.libai.llama import AlpacaDataset

    path = tmp_path / "train"
    # flow.save's layout: one pickle of {"protocol_version", "oneflow", "data"}.
    path.write_bytes(pickle.dumps({"protocol_version": 1, "oneflow": None, "data": []}))
    with pytest.raises(UsageError, match=r"written by flow.save.*torch.save") as e:
        AlpacaDataset(path)
    assert "No module named" not in str(e.value) and "install" not in str(e.value)


def test_map_dataset_loader_cycles_passes_and_resumes():
    """LiBai's build_nlp_train_loader over a map-style dataset: each pass a new order of all samples, and a
    loader resumed after k samples yields what the unbroken one yields after k."""
    data = [{"input_ids": torch.tensor([i]), "labels": torch.tensor([i])} for i in range(10)]
    layout = dict(micro_batch_size=2, data_parallel_rank=0, data_parallel_size=1, num_workers=0)
    full, valid, test = build_nlp_train_loader([data], train_valid_test_num_samples=[30, 0, 0], **layout)
    assert valid is None and test is None
    order = [int(x) for batch in full for x in batch["input_ids"]]
    passes = [order[i:i + 10] for i in (0, 10, 20)]
    assert all(sorted(p) == list(range(10)) for p in passes) and passes[0] != passes[1]
    resumed, _, _ = build_nlp_train_loader([data], train_valid_test_num_samples=[30, 0, 0], consumed_samples=14,
                                           **layout)
    assert [int(x) for batch in resumed for x in batch["input_ids"]] == order[14:]


def test_train_loader_over_a_gpt2_dataset_reads_all_its_documents(tmp_path):
    """build_nlp_train_loader(dataset=[GPT2Dataset(...)]): Megatron's GPT samples of the whole corpus, train only."""
    from compat.libai.data import GPT2Dataset

    for f in (ROOT / "data_test" / "gpt2").glob("demo_gpt2_text_document.*"):
        if f.suffix in (".bin", ".idx"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    entry = GPT2Dataset(data_prefix=str(tmp_path / "demo_gpt2_text_document"), max_seq_length=16)
    train_loader, valid, test = build_nlp_train_loader([entry], train_valid_test_num_samples=[8, 0, 0],
                                                       micro_batch_size=2, num_workers=0)
    first = next(iter(train_loader))
    assert valid is None and test is None
    assert first["input_ids"].shape == (2, 16) and torch.equal(first["input_ids"][:, 1:], first["labels"][:, :-1])
    # One epoch of the whole corpus (Megatron builds whole epochs), more than LiBai's default train split holds.
    whole = build_nlp_train_loader.samples_per_epoch([entry])
    assert len(train_loader) == whole // 2
    assert whole > build_nlp_train_val_test_loader.samples_per_epoch([entry], splits=[[949, 50, 1]])


def test_sft_test_loader_reads_every_sample_once(tmp_path):
    """LiBai's build_nlp_test_loader over Alpaca samples (dataloader.test, --eval-only): in order, once, the
    last batch padded with samples whose labels are all ignored."""
    cfg = LazyConfig.load(SFT)
    cfg.dataloader.test[0].dataset.path = str(alpaca(tmp_path / "test", 5))
    cfg.tokenization.tokenizer.pretrained_model_path = str(SPM)
    loader = instantiate_with(cfg.dataloader.test[0], micro_batch_size=2, num_workers=0)
    batches = list(loader)
    assert [len(b["input_ids"]) for b in batches] == [2, 2, 2]
    assert (batches[-1]["labels"][1] == IGNORE_INDEX).all()
    assert not (batches[-1]["labels"][0] == IGNORE_INDEX).all()


def test_libai_submodules_and_loaders_map():
    from compat.libai import LibaiDialect
    from libai_lite.evaluation import DatasetEvaluator, PPLEvaluator

    imports = LibaiDialect()
    assert imports.load("libai", ["evaluation"]).evaluation.PPLEvaluator is PPLEvaluator
    assert imports.load("libai.evaluation", ["evaluator"]).evaluator.DatasetEvaluator is DatasetEvaluator
    assert imports.load("libai.data.build", ["build_nlp_train_loader"]).build_nlp_train_loader is build_nlp_train_loader
    with pytest.raises(ImportError, match=r"libai.data.build.build_image_train_loader has no counterpart.*"
                                          r"build_nlp_train_loader"):
        imports.load("libai.data.build", ["build_image_train_loader"])


def libai_tree(tmp_path, config: str, code: dict):
    """A LiBai tree in ``tmp_path`` with ``config`` (its path: text) and LiBai code files (path: text)."""
    (tmp_path / "configs").mkdir()
    for rel, text in {**code, **config}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(textwrap.dedent(text))
    return tmp_path / next(iter(config))


@pytest.mark.parametrize("case", ["needs libai's runtime", "hidden by an installed project"])
def test_libai_code_with_no_counterpart_is_refused_naming_it(tmp_path, case):
    if case == "needs libai's runtime":  # LiBai's MagicPrompt reaches its mock_transformers tokenizers
        code = {"projects/mock_transformers/mock_tokenization.py": "import oneflow as flow\n"}
        line = "from projects.mock_transformers import mock_tokenization"
        needs, project = "projects.mock_transformers.mock_tokenization", "projects/MagicPrompt"
    else:  # LiBai's projects/Llama/adapter, where this project's projects.Llama has none
        code = {"projects/Llama/adapter/adapter_model.py": "import oneflow as flow\n"}
        line = "from projects.Llama.adapter.adapter_model import LlamaForCausalLM"
        needs, project = "projects.Llama.adapter.adapter_model.LlamaForCausalLM", "projects/Llama"
    config = libai_tree(tmp_path, {f"{project}/configs/run.py": f"from libai.config import LazyCall\n{line}\n"}, code)
    with pytest.raises(ConfigLoadError) as e:
        LazyConfig.load(config)
    message = str(e.value)
    assert f"LiBai's {project} needs {needs}, which libai_lite has no counterpart for" in message
    assert "projects.Llama.llama" in message  # what does map is listed
    assert "oneflow" not in message.lower()


def test_a_libai_config_without_its_dialect_installed_names_the_reinstall(monkeypatch):
    """An editable install made before the dialect entry points (or a checkout on PYTHONPATH) has none."""
    from libai_lite.config import loader

    monkeypatch.setattr(loader, "new_dialects", lambda: [])
    with pytest.raises(ConfigLoadError, match="no config dialect is installed to answer it .entry-point group "
                                              "libai_lite.config_dialects.: install the project again with pip "
                                              "install -e ."):
        LazyConfig.load(T5)
