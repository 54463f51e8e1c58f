"""Data validated before the first step, at the cost of reading the index: each class of bad data is one
line naming the file and the fix, with nothing written (docs/bad_input.md, section "Data"); a bad cached
sample index is rebuilt with one warning.

Most cases run in process on tiny corpora; two run through tools/train_net.py the way a user runs them.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from libai_lite.data import gpt_dataset as gd
from libai_lite.data import indexed_dataset as idx_mod
from libai_lite.data.build import build_gpt_train_valid_test_datasets, build_gpt_train_valid_test_loaders
from libai_lite.data.index_cache import index_stem
from libai_lite.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset, MMapIndexedDatasetBuilder
from libai_lite.utils.errors import UsageError
from tests.launch import DATA, ROOT, one_error_line, tiny, train_net, tree_snapshot

DOC = ROOT / "docs" / "bad_input.md"
FIXTURES = ROOT.parent / "shared" / "fixtures" / "megatron"
HEADER = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
RERUN = "re-run tools/preprocess_data.py for this prefix"


def corpus(directory, name="c", num_docs=30, vocab=1000, dtype=np.uint16, seed=0, max_len=40):
    """A random corpus of one sequence per document; returns its prefix."""
    rng = np.random.RandomState(seed)
    prefix = str(Path(directory) / name)
    b = MMapIndexedDatasetBuilder(prefix, dtype=dtype)
    for _ in range(num_docs):
        b.add_item(rng.randint(0, vocab, size=rng.randint(1, max_len + 1)))
        b.end_document()
    b.finalize()
    return prefix


def poke(path, offset, data: bytes):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def build(prefix, cache, vocab_size=1000, **kw):
    return build_gpt_train_valid_test_datasets(prefix, "8,1,1", [40, 8, 8], 8, 1234, str(cache),
                                               vocab_size=vocab_size, **kw)


# ----------------------------------------------------------------------------------------------
# The .idx/.bin pair: case -> (damage(prefix, other_prefix), the part of the one line checked)
# ----------------------------------------------------------------------------------------------
def _n(prefix):
    return len(MMapIndexedDataset(prefix))


INDEX_CASES = {
    # the sequence count, smaller and larger than the arrays the file holds
    "sequence_count_smaller": (lambda p, o: poke(p + ".idx", 18, struct.pack("<Q", 20)),
                               "the sequence count in its header is 20, but the file holds 30"),
    "sequence_count_larger": (lambda p, o: poke(p + ".idx", 18, struct.pack("<Q", 31)),
                              "the sequence count in its header is 31, but the file holds 30"),
    "document_count": (lambda p, o: poke(p + ".idx", 26, struct.pack("<Q", 7)),
                       "the document count in its header is 7, but the file holds 31"),
    # one size changed: the pointers no longer step by the sizes
    "size_changed": (lambda p, o: poke(p + ".idx", HEADER + 4 * 4, struct.pack("<i", 77)),
                     "sequence 5 starts at byte"),
    # the last size changed: the pointers agree, the .bin does not
    "last_size_changed": (lambda p, o: poke(p + ".idx", HEADER + 29 * 4, struct.pack("<i", 1)),
                          "bytes more than"),
    "pointer_changed": (lambda p, o: poke(p + ".idx", HEADER + 30 * 4 + 9 * 8, struct.pack("<q", 2)),
                        "sequence 9 starts at byte 2"),
    "extra_bytes_in_bin": (lambda p, o: open(p + ".bin", "ab").write(b"\0\0"), "has 2 bytes more than"),
    "extra_bytes_in_idx": (lambda p, o: open(p + ".idx", "ab").write(b"\0" * 5),
                           "has 5 bytes after the arrays its header describes"),
    "dtype_byte_uint8_over_uint16": (lambda p, o: poke(p + ".idx", 17, bytes([1])),
                                     "says its tokens are uint8 (1 byte each), but"),
    "dtype_byte_int32_over_uint16": (lambda p, o: poke(p + ".idx", 17, bytes([4])),
                                     "says its tokens are int32 (4 bytes each), but"),
    # another corpus's .idx over this .bin: of fewer tokens, then of more
    "other_corpus_idx": (lambda p, o: shutil.copy(o + ".idx", p + ".idx"), "bytes more than"),
    "other_corpus_idx_of_more_tokens": (lambda p, o: shutil.copy(o + "_more.idx", p + ".idx"), "is truncated"),
    "document_index_unordered": (lambda p, o: poke(p + ".idx", HEADER + 30 * 12 + 4 * 8, struct.pack("<q", 1)),
                                 "its document index is not an increasing list"),
    "document_index_short_of_the_end": (lambda p, o: poke(p + ".idx", HEADER + 30 * 12 + 30 * 8, struct.pack("<q", 29)),
                                        "from 0 to 30"),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_an_index_not_describing_its_bin_is_one_line_naming_file_and_fix(tmp_path, case):
    data = tmp_path / "data"
    data.mkdir()
    prefix = corpus(data)
    other = corpus(tmp_path, "other", num_docs=20, seed=1)
    corpus(tmp_path, "other_more", num_docs=40, seed=1)
    assert _n(prefix) == 30 and MMapIndexedDataset(prefix).token_range()[1] < 1000  # the undamaged pair opens
    damage, needle = INDEX_CASES[case]
    damage(prefix, other)
    before = tree_snapshot(tmp_path)
    with pytest.raises(IndexedDatasetError) as e:
        build(prefix, tmp_path / "cache")
    msg = str(e.value)
    assert "\n" not in msg and needle in msg, msg
    assert prefix in msg and msg.endswith(RERUN), msg
    assert tree_snapshot(tmp_path) == before


def test_a_corrupt_sequence_count_is_not_called_a_truncated_file(tmp_path):
    prefix = corpus(tmp_path)
    poke(prefix + ".idx", 18, struct.pack("<Q", 1 << 40))
    with pytest.raises(IndexedDatasetError, match="sequence count in its header is 1099511627776") as e:
        MMapIndexedDataset(prefix)
    assert "truncated" not in str(e.value)
    # A file really cut short is still called truncated.
    prefix = corpus(tmp_path, "cut")
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(HEADER + 100)
    with pytest.raises(IndexedDatasetError, match=r"cut\.idx is truncated \(134 bytes"):
        MMapIndexedDataset(prefix)


def test_megatron_written_and_demo_indices_pass_the_checks():
    prefixes = [ROOT / f"data_test/{name}/demo_{name}_text_document" for name in ("gpt2", "bert", "spm")]
    prefixes += sorted(p.with_suffix("") for p in FIXTURES.glob("*.idx"))
    for prefix in prefixes:
        ds = MMapIndexedDataset(str(prefix))
        assert ds.doc_idx[-1] == len(ds) and ds.token_range()[2]  # whole: under the sampling budget


# ----------------------------------------------------------------------------------------------
# token ids and the end-of-document id
# ----------------------------------------------------------------------------------------------
def test_ids_outside_the_vocabulary_are_refused_before_anything_is_written(tmp_path):
    prefix = corpus(tmp_path / "d", vocab=1000)
    ds = MMapIndexedDataset(prefix)
    poke(prefix + ".bin", int(ds.pointers[17]) + 2, np.uint16(1000).tobytes())
    before = tree_snapshot(tmp_path)
    with pytest.raises(UsageError) as e:
        build(prefix, tmp_path / "cache", vocab_size=1000)
    assert str(e.value) == (f"{prefix} holds token id 1000, outside the model's vocabulary of 1000: preprocess it "
                            f"with this model's tokenizer (tools/preprocess_data.py) or fix vocab_size")
    assert tree_snapshot(tmp_path) == before
    assert build(prefix, tmp_path / "cache", vocab_size=1001)[0].max_token_id == 1000


def test_a_large_corpus_is_checked_in_bounded_runs_spread_over_it(tmp_path, monkeypatch):
    # 64 KiB of tokens, a budget of 4 runs of 1 KiB: the runs start at the first token and end at the last.
    prefix = str(tmp_path / "big")
    tokens = np.full(1 << 15, 7, dtype=np.uint16)
    tokens[0], tokens[-1], tokens[len(tokens) // 3 + 5] = 3, 900, 901
    b = MMapIndexedDatasetBuilder(prefix, dtype=np.uint16)
    b.add_item(tokens)
    b.end_document()
    b.finalize()
    ds = MMapIndexedDataset(prefix)
    # Run starts are linspace(0, n - 512, 4): 0, 10752, 21504, 32256; 10927 lies in the second run.
    assert ds.token_range(max_bytes=4096, runs=4) == (3, 901, False)
    assert ds.token_range(max_bytes=1 << 20, runs=4) == (3, 901, True)
    # The defaults are read at call time, so the dataset's check uses this budget.
    monkeypatch.setattr(idx_mod, "SAMPLE_BYTES", 4096)
    monkeypatch.setattr(idx_mod, "SAMPLE_RUNS", 4)
    with pytest.raises(UsageError, match="holds token id 901, outside the model's vocabulary of 901"):
        gd.token_id_range(MMapIndexedDataset(prefix), prefix, vocab_size=901)
    # Another tokenizer's corpus (ids shifted past the vocabulary everywhere) is seen in any run.
    shifted = str(tmp_path / "shifted")
    b = MMapIndexedDatasetBuilder(shifted, dtype=np.uint16)
    b.add_item(tokens + 2000)
    b.end_document()
    b.finalize()
    with pytest.raises(UsageError, match="outside the model's vocabulary of 1000"):
        gd.token_id_range(MMapIndexedDataset(shifted), shifted, vocab_size=1000)


def test_a_float_dtype_byte_is_refused_as_not_token_ids(tmp_path):
    prefix = corpus(tmp_path, dtype=np.int32)
    poke(prefix + ".idx", 17, bytes([7]))  # float32: same width, so the index itself is consistent
    before = tree_snapshot(tmp_path)
    with pytest.raises(UsageError, match=r"c\.idx says its tokens are float32: token ids are integers"):
        build(prefix, tmp_path / "cache")
    assert tree_snapshot(tmp_path) == before


@pytest.mark.parametrize("options", [dict(eod_mask_loss=True), dict(reset_position_ids=True), {}])
def test_an_end_of_document_id_outside_the_vocabulary_is_refused(tmp_path, options):
    prefix = corpus(tmp_path / "d")
    before = tree_snapshot(tmp_path)
    kw = dict(train_valid_test_num_samples=[16, 0, 0], micro_batch_size=2, seq_length=8,
              cache_dir=str(tmp_path / "cache"), num_workers=0, splits_string="1,0,0", **options)
    with pytest.raises(UsageError) as e:
        build_gpt_train_valid_test_loaders(prefix, vocab_size=1000, eod_token_id=1000, **kw)
    assert str(e.value).startswith("dataloader.train.eod_token_id=1000 is outside the tokenizer's vocabulary of "
                                   "1000 ids")
    assert tree_snapshot(tmp_path) == before
    assert build_gpt_train_valid_test_loaders(prefix, vocab_size=1000, eod_token_id=999, **kw)[0] is not None


# ----------------------------------------------------------------------------------------------
# cached sample indices
# ----------------------------------------------------------------------------------------------
def _rebuild_warnings(caplog):
    return [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("libai_lite")]


def _damage_array(path, how):
    a = np.load(path)
    if how == "repeated":
        a[...] = a.flat[5]  # one sample (row, document) everywhere: shapes and ranges still fit
    elif how == "out_of_range":
        a.flat[3] = a.max() + 10 ** 6
    else:
        a.flat[3] = -1
    np.save(path, a)


@pytest.mark.parametrize("kind,how,needle", [
    ("shuffle", "repeated", "does not match the checksum written with it"),
    ("doc", "repeated", "does not match the checksum written with it"),
    ("shuffle", "out_of_range", "holds sample 1000"),
    ("doc", "out_of_range", "holds document 1000"),
    ("sample", "out_of_range", "holds "),
    ("doc", "negative", "holds document -1, outside"),
])
def test_a_bad_cached_index_is_rebuilt_with_one_warning(tmp_path, caplog, kind, how, needle):
    prefix = corpus(tmp_path)
    train = build(prefix, tmp_path / "cache")[0]
    want = {k: np.array(getattr(train, f"{k}_idx")) for k in ("doc", "sample", "shuffle")}
    path = train.index_paths[kind]
    _damage_array(path, how)
    with caplog.at_level(logging.INFO, logger="libai_lite"):
        again = build(prefix, tmp_path / "cache")[0]
    warnings = _rebuild_warnings(caplog)
    assert len(warnings) == 1, [r.message for r in warnings]
    assert warnings[0].message.startswith(f"rebuilding the train indices of {prefix}: {path} ")
    assert needle in warnings[0].message, warnings[0].message
    for k, array in want.items():
        np.testing.assert_array_equal(getattr(again, f"{k}_idx"), array)
    # The rebuilt cache is trusted again, without another warning.
    caplog.clear()
    build(prefix, tmp_path / "cache")
    assert not _rebuild_warnings(caplog)


def test_the_checksums_are_written_with_the_arrays(tmp_path):
    prefix = corpus(tmp_path)
    train = build(prefix, tmp_path / "cache")[0]
    desc = json.loads(Path(train.index_paths["desc"]).read_text())
    for kind in ("doc", "sample", "shuffle"):
        assert desc["checksums"][kind] == f"{zlib.crc32(np.load(train.index_paths[kind]).tobytes()):08x}"


def test_a_cache_without_a_description_is_checked_by_shape_and_range(tmp_path, caplog, monkeypatch):
    # Megatron-LM writes the same three files and no description: accepted when shapes and ranges fit.
    prefix = corpus(tmp_path)
    train = build(prefix, tmp_path / "cache")[0]
    os.remove(train.index_paths["desc"])
    mtimes = {p: os.stat(p).st_mtime_ns for p in train.index_paths.values() if os.path.exists(p)}

    def must_not_rebuild(*args, **kwargs):
        raise AssertionError("a valid cache without a description was rebuilt")

    with monkeypatch.context() as m:
        m.setattr(gd, "build_sample_idx", must_not_rebuild)
        build(prefix, tmp_path / "cache")
    assert {p: os.stat(p).st_mtime_ns for p in mtimes} == mtimes
    _damage_array(train.index_paths["shuffle"], "out_of_range")
    with caplog.at_level(logging.INFO, logger="libai_lite"):
        build(prefix, tmp_path / "cache")
    warnings = _rebuild_warnings(caplog)
    assert len(warnings) == 1 and "holds sample 1000" in warnings[0].message


def test_a_cache_without_a_description_whose_doc_idx_is_another_seeds_is_rebuilt_at_start_up(tmp_path, caplog):
    """Each array keeps its shape and ranges, so only the sample index stepping through the documents tells;
    it failed inside a DataLoader worker, at the first sample that straddles two documents."""
    prefix = corpus(tmp_path, num_docs=60)
    other = build_gpt_train_valid_test_datasets(prefix, "8,1,1", [40, 8, 8], 8, 99, str(tmp_path / "other"),
                                                vocab_size=1000)[0]
    train = build(prefix, tmp_path / "cache")[0]
    want = {k: np.array(getattr(train, f"{k}_idx")) for k in ("doc", "sample", "shuffle")}
    assert not np.array_equal(np.load(other.index_paths["doc"]), want["doc"])
    shutil.copy(other.index_paths["doc"], train.index_paths["doc"])
    os.remove(train.index_paths["desc"])
    with caplog.at_level(logging.INFO, logger="libai_lite"):
        again = build(prefix, tmp_path / "cache")[0]
    warnings = _rebuild_warnings(caplog)
    assert len(warnings) == 1 and f"{train.index_paths['sample']} does not fit {train.index_paths['doc']}: sample " \
        in warnings[0].message and "(files of another seed or split)" in warnings[0].message, warnings
    for k, array in want.items():
        np.testing.assert_array_equal(getattr(again, f"{k}_idx"), array)
    assert all(len(again[i]["input_ids"]) == 8 for i in range(len(again)))


@pytest.mark.skipif(not (FIXTURES / "gpt2_megatron_indices.npz").exists(), reason="Megatron fixtures not present")
def test_index_files_written_by_megatron_lm_are_accepted_as_they_are(tmp_path, monkeypatch, caplog):
    prefix = str(FIXTURES / "gpt2_mmap_text_document")
    configs = json.loads((FIXTURES / "gpt2_megatron_indices.json").read_text())
    config = next(c for c in configs if all(c["num_samples"]))
    cache = str(tmp_path / "cache")
    os.makedirs(cache)
    with np.load(FIXTURES / "gpt2_megatron_indices.npz") as z:
        reference = {k: z[k] for k in z.files if k.startswith(config["key"] + "/")}
    for name, n in zip(("train", "valid", "test"), config["num_samples"]):
        stem = index_stem(prefix, cache, name, n, config["seq_length"], config["seed"])
        for kind in ("doc", "sample", "shuffle"):
            np.save(f"{stem}_{kind}_idx.npy", reference[f"{config['key']}/{name}_{kind}"])

    def must_not_rebuild(*args, **kwargs):
        raise AssertionError("Megatron-LM's index files were rebuilt")

    monkeypatch.setattr(gd, "build_sample_idx", must_not_rebuild)
    with caplog.at_level(logging.INFO, logger="libai_lite"):
        datasets = build_gpt_train_valid_test_datasets(prefix, config["splits_string"], config["num_samples"],
                                                       config["seq_length"], config["seed"], cache)
    assert not _rebuild_warnings(caplog)
    np.testing.assert_array_equal(datasets[0].shuffle_idx, reference[f"{config['key']}/train_shuffle"])


# ----------------------------------------------------------------------------------------------
# through tools/train_net.py, and the documented table
# ----------------------------------------------------------------------------------------------
def _run(tmp_path, *extra):
    out = tmp_path / "out"
    before = tree_snapshot(tmp_path)
    r = train_net(tiny(out, tmp_path / "cache", "train.train_iter=2", *extra), timeout=180)
    assert r.returncode != 0
    line = one_error_line(r)
    assert not out.exists() and tree_snapshot(tmp_path) == before, "a refused run wrote files"
    return line


def test_train_net_refuses_a_uint8_dtype_byte_over_a_uint16_bin(tmp_path):
    prefix = tmp_path / "data" / "demo"
    prefix.parent.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(ROOT / (DATA + ext), str(prefix) + ext)
    poke(str(prefix) + ".idx", 17, bytes([1]))
    line = _run(tmp_path, f"dataloader.train.data_prefix={prefix}")
    assert line == (f"error: {prefix}.idx says its tokens are uint8 (1 byte each), but {prefix}.bin holds 2 bytes "
                    f"for each of its 413712 tokens: the dtype byte of the index is wrong (or the files are from "
                    f"different runs); {RERUN}")


@pytest.mark.slow  # the check itself is tested in process above; this is its path through the trainer
def test_train_net_refuses_an_end_of_document_id_outside_the_vocabulary(tmp_path):
    line = _run(tmp_path, "dataloader.train.eod_mask_loss=True", "dataloader.train.eod_token_id=50257")
    assert line.startswith("error: dataloader.train.eod_token_id=50257 is outside the tokenizer's vocabulary of "
                           "8000 ids"), line


def _data_rows():
    """docs/bad_input.md's data section: its table rows as cell lists."""
    text = DOC.read_text()
    section = text[text.index("\n## Data"):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| ") and not line.startswith(("| input", "| ---"))]


# Rows of the data section tested above outside INDEX_CASES: case -> the part of the message checked there.
OTHER_NEEDLES = {
    "ids_outside_vocabulary": "outside the model's vocabulary of",
    "eod_outside_vocabulary": "is outside the tokenizer's vocabulary of",
    "cached_index_repeated": "does not match the checksum written with it",
    "cached_index_out_of_range": "holds sample",
}


def test_the_documented_data_rows_quote_the_messages_these_tests_check():
    rows = {re.sub(r"`", "", r[-1]).split("::")[-1]: r for r in _data_rows()}
    needles = {case: needle for case, (_, needle) in INDEX_CASES.items()} | OTHER_NEEDLES
    assert set(rows) <= set(needles), sorted(set(rows) - set(needles))
    assert set(OTHER_NEEDLES) | {"sequence_count_smaller", "size_changed", "extra_bytes_in_bin",
                                 "dtype_byte_uint8_over_uint16", "other_corpus_idx"} <= set(rows)
    # The rows quote the demo corpus, the tests tiny ones: the wording must agree, not the numbers.
    def shape(text):
        return re.sub(r"\d+", "N", text)

    for case, row in rows.items():
        assert shape(needles[case]) in shape(row[-2]), (case, needles[case])
