"""Megatron-LM's T5 dataset over sentence-split data, against Megatron's own code.

``megatron_t5_reference.npz`` was written by Megatron-LM's code itself (legacy ``megatron/data``,
the last version before its removal, NVIDIA/Megatron-LM 25a99468cd^): ``helpers.cpp``'s
``build_mapping`` compiled with g++ against a stand-in for its pybind11 arrays, and
``t5_dataset.build_training_sample`` (with ``dataset_utils.create_masked_lm_predictions``) run on
WordPiece ids of ``data_test/bert/vocab.txt`` with 100 extra ids; ``make_megatron_t5_reference.py``
writes it again from a Megatron-LM checkout.
"""
from pathlib import Path

import numpy as np
import pytest

from libai_lite.data.gpt_dataset import IGNORE_INDEX
from libai_lite.data.indexed_dataset import MMapIndexedDatasetBuilder
from libai_lite.tokenizer import build_tokenizer
from libai_lite.utils.errors import UsageError
from projects.MT5.data.megatron_t5_dataset import (
    build_megatron_t5_datasets,
    build_samples_mapping,
    build_training_sample,
    megatron_t5_ids,
)

ROOT = Path(__file__).resolve().parents[2]
REF = np.load(Path(__file__).with_name("megatron_t5_reference.npz"))


def _bert():
    return build_tokenizer("BertWordPieceLowerCase", vocab_file=ROOT / "data_test/bert/vocab.txt", vocab_extra_ids=100)


@pytest.mark.parametrize("case", range(5))
def test_samples_mapping_equals_megatrons_helpers(case):
    # Splits with empty documents and documents holding a sentence over 512 tokens; one epoch and
    # many; short sequences never, sometimes, always.
    epochs, max_num_samples, max_seq_length, seed = REF[f"m{case}_params"].tolist()
    got = build_samples_mapping(REF[f"m{case}_doc_idx"], REF["sizes"], epochs or None, max_num_samples or None,
                                max_seq_length, float(REF[f"m{case}_ssp"]), seed)
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(got.astype(np.int64), REF[f"m{case}_expected"])


def test_training_samples_equal_megatrons():
    tok = _bert()
    ids = megatron_t5_ids(tok)

    def is_start(token):
        return not tok.id_to_token(token).startswith("##")

    for k in range(40):
        lens, tokens = REF[f"s{k}_lens"], REF[f"s{k}_tokens"].tolist()
        sentences = [tokens[a:b] for a, b in zip(np.cumsum(lens) - lens, np.cumsum(lens))]
        target, idx = REF[f"s{k}_meta"].tolist()
        got = build_training_sample(sentences, target, 256, 96, ids, is_start, 0.15,
                                    np.random.RandomState(seed=1234 + idx))
        for key in ("text_enc", "text_dec", "labels", "loss_mask"):
            np.testing.assert_array_equal(got[key], REF[f"s{k}_{key}"], err_msg=f"sample {k} {key}")
        assert got["truncated"] == int(REF[f"s{k}_truncated"])


def _sentence_corpus(tmp_path):
    """REF's sentence lengths as a ``_text_sentence`` dataset of ordinary WordPiece ids."""
    prefix = str(tmp_path / "corpus_text_sentence")
    rng = np.random.default_rng(0)
    sizes, doc_idx = REF["sizes"], REF["m2_doc_idx"]
    builder = MMapIndexedDatasetBuilder(prefix, dtype=np.uint16)
    for a, b in zip(doc_idx[:-1], doc_idx[1:]):
        lens = sizes[a:b].tolist()
        builder.add_doc(rng.integers(1000, 7000, sum(lens)), lens)
    builder.finalize()
    return prefix


def test_dataset_samples(tmp_path):
    prefix = _sentence_corpus(tmp_path)
    train, valid, test = build_megatron_t5_datasets(prefix, _bert(), "949,50,1", (300, 20, 0), max_seq_length=128,
                                                    max_seq_length_dec=64)
    assert test is None and len(train) >= 300 and len(valid) >= 20
    # The train split's mapping is helpers.cpp's over the split's documents (legacy rounding).
    first, end = 0, int(round(0.949 * 400))
    np.testing.assert_array_equal(
        train.samples_mapping, build_samples_mapping(REF["m2_doc_idx"][first:end + 1], REF["sizes"], None, 300,
                                                     126, 0.1, 1234))
    for i in (0, 7, len(train) - 1):
        raw, s = train.megatron_sample(i), train[i]
        assert s["encoder_input_ids"].shape == (128,) and s["decoder_input_ids"].shape == (64,)
        loss = raw["loss_mask"] == 1
        assert (s["labels"].numpy()[~loss] == IGNORE_INDEX).all()
        assert (s["labels"].numpy()[loss] == raw["labels"][loss]).all()
        assert s["encoder_attn_mask"].sum() == (raw["text_enc"] >= 1).sum()
        start, stop, _ = (int(v) for v in train.samples_mapping[i])
        # The encoder keeps the sample's tokens outside the spans, in order; the sentinels stand for the rest.
        kept = [t for t in raw["text_enc"].tolist() if t >= 1 and t not in train.ids["sentinels"]]
        text = np.concatenate([np.asarray(train.indexed[j]) for j in range(start, stop)]).tolist()
        assert all(t in text for t in kept)


def test_refusals(tmp_path):
    with pytest.raises(UsageError, match="sentence-split data"):
        build_megatron_t5_datasets(str(ROOT / "data_test/bert/demo_bert_text_document"), _bert(), "949,50,1", (10, 0, 0))
    with pytest.raises(UsageError, match="no document of this split"):
        build_samples_mapping([0, 2, 2], [600, 5], None, 10, 126, 0.1, 1234)
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=ROOT / "data_test/gpt2/vocab.json",
                           merge_file=ROOT / "data_test/gpt2/merges.txt")
    with pytest.raises(UsageError, match="vocab_extra_ids=100"):
        megatron_t5_ids(gpt2)


def test_mapping_is_cached_under_megatrons_name(tmp_path):
    prefix = _sentence_corpus(tmp_path)
    train, _, _ = build_megatron_t5_datasets(prefix, _bert(), "949,50,1", (300, 0, 0), max_seq_length=128,
                                             max_seq_length_dec=64, cache_dir=str(tmp_path / "cache"))
    (path,) = (tmp_path / "cache").glob("*.npy")
    assert path.name.startswith("corpus_text_sentence-") and path.name.endswith(
        "_train_indexmap_300mns_126msl_0.10ssp_1234s.npy")
    again, _, _ = build_megatron_t5_datasets(prefix, _bert(), "949,50,1", (300, 0, 0), max_seq_length=128,
                                             max_seq_length_dec=64, cache_dir=str(tmp_path / "cache"))
    assert isinstance(again.samples_mapping, np.memmap)
    np.testing.assert_array_equal(again.samples_mapping, train.samples_mapping)
    # Another splits string: the cached mapping reaches past the split's documents and is rebuilt.
    other, _, _ = build_megatron_t5_datasets(prefix, _bert(), "50,50,0", (300, 0, 0), max_seq_length=128,
                                             max_seq_length_dec=64, cache_dir=str(tmp_path / "cache"))
    assert int(np.asarray(other.samples_mapping)[:, 1].max()) <= int(REF["m2_doc_idx"][200])


def test_trains_through_train_net(tmp_path):
    """The MT5 demo model trains on the loader through tools/train_net.py, validation included."""
    import json

    from tests.launch import train_net

    prefix = _sentence_corpus(tmp_path)
    config = tmp_path / "megatron_t5.py"
    config.write_text(
        "from libai_lite.config import LazyCall\n"
        "from projects.MT5.configs.mt5_pretrain import dataloader, model, optim, tokenization, train\n"
        "from projects.MT5.data.megatron_t5_dataset import build_megatron_t5_train_valid_test_loaders\n"
        "dataloader.train = LazyCall(build_megatron_t5_train_valid_test_loaders)(\n"
        f"    data_prefix={prefix!r}, tokenizer='${{tokenization.tokenizer}}', max_seq_length=128,\n"
        f"    max_seq_length_dec=64, seed='${{train.seed}}', num_workers=0, cache_dir={str(tmp_path / 'cache')!r})\n")
    out = tmp_path / "run"
    r = train_net([f"train.output_dir={out}", "train.dist.data_parallel_size=1", "train.dist.tensor_parallel_size=1",
                   "train.zero_optimization.enabled=False", "model.cfg.hidden_layers=2", "model.cfg.hidden_size=64",
                   "model.cfg.num_attention_heads=2", "model.cfg.head_size=32", "model.cfg.intermediate_size=128",
                   "train.num_accumulation_steps=1", "train.train_micro_batch_size=4", "train.test_micro_batch_size=4",
                   "train.train_iter=6", "train.train_epoch=0", "train.log_period=2", "train.evaluation.eval_period=3",
                   "train.evaluation.eval_iter=2", "train.log_memory_estimate=False"], config=str(config))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.json")]
    assert all(np.isfinite(row["total_loss"]) for row in rows if "total_loss" in row)
    assert [row for row in rows if "valid/PPL" in row]
