"""GPT dataset, samplers and loader builders on small synthetic Megatron-format corpora."""
from __future__ import annotations

import glob
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from libai_lite.data import (
    IGNORE_INDEX,
    BlendableDataset,
    GPTDataset,
    IndexedDatasetError,
    MegatronPretrainingSampler,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    PaddedEvalDataset,
    SequentialEvalSampler,
    build_blending_indices,
    build_gpt_train_valid_test_datasets,
    build_gpt_train_valid_test_loaders,
    check_token_ids,
    get_train_valid_test_split,
    parse_data_prefix,
)
from libai_lite.data import gpt_dataset as gd

from libai_lite.utils.errors import UsageError
from tests.launch import ROOT, env, spawn_ranks

FIXTURES = Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures" / "megatron"


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def make_corpus(directory, name="corpus", num_docs=40, seed=0, min_len=1, max_len=60, vocab=5000,
                sequences_per_doc=1):
    """Write a random corpus; returns (prefix, list of per-document token arrays)."""
    rng = np.random.RandomState(seed)
    prefix = str(Path(directory) / name)
    builder = MMapIndexedDatasetBuilder(prefix, dtype=np.uint16)
    docs = []
    for _ in range(num_docs):
        lengths = rng.randint(min_len, max_len + 1, size=sequences_per_doc)
        tokens = rng.randint(0, vocab, size=int(lengths.sum())).astype(np.uint16)
        if sequences_per_doc == 1:
            builder.add_item(tokens)
            builder.end_document()
        else:
            builder.add_doc(tokens, lengths.tolist())
        docs.append(tokens.astype(np.int64))
    builder.finalize()
    return prefix, docs


def stream_of(ds: GPTDataset, docs) -> np.ndarray:
    """The document stream the dataset cuts samples from: its doc_idx order, concatenated."""
    return np.concatenate([docs[int(d)] for d in ds.doc_idx])


def megatron_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    """Line-by-line port of Megatron-LM's C++ build_sample_idx (helpers.cpp), the reference."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sample_index, doc_idx_index, doc_offset = 1, 0, 0
    while sample_index <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        out[sample_index] = (doc_idx_index, doc_offset)
        sample_index += 1
    return out


def gpt(prefix, num_samples, seq_length, seed=1234, documents=None, name="train", cache_dir=None):
    indexed = MMapIndexedDataset(prefix)
    if documents is None:
        documents = np.arange(len(indexed.doc_idx) - 1)
    return GPTDataset(name, indexed, documents, num_samples, seq_length, seed, prefix, cache_dir)


# ----------------------------------------------------------------------------------------------
# index construction
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seq_length", [1, 3, 7, 64, 500])
def test_sample_idx_matches_megatron_reference(seq_length):
    rng = np.random.RandomState(seq_length)
    sizes = rng.randint(0, 40, size=50).astype(np.int32)  # zero-length documents included
    sizes[0] = 0
    documents = np.arange(50)
    tokens = int(sizes.sum())
    for num_samples in (1, 5, tokens // seq_length + 3):
        epochs = gd.num_epochs_needed(tokens, seq_length, num_samples)
        doc_idx = gd.build_doc_idx(documents, epochs, np.random.RandomState(0))
        got = gd.build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens)
        want = megatron_sample_idx(sizes, doc_idx, seq_length, epochs, tokens)
        np.testing.assert_array_equal(got, want)
        assert got.shape[0] - 1 >= num_samples


def test_num_epochs_matches_megatron_loop():
    for tokens in (1, 2, 17, 1000):
        for seq in (1, 4, 33):
            for n in (0, 1, 5, 200):
                epochs, total = 0, 0
                while True:
                    epochs += 1
                    total += tokens
                    if (total - 1) // seq >= n:
                        break
                assert gd.num_epochs_needed(tokens, seq, n) == epochs


def test_samples_are_consecutive_tokens_of_the_shuffled_stream(tmp_path):
    prefix, docs = make_corpus(tmp_path)
    seq = 16
    ds = gpt(prefix, num_samples=30, seq_length=seq)
    stream = stream_of(ds, docs)
    for i in range(len(ds)):
        p = int(ds.shuffle_idx[i])
        item = ds[i]
        assert item["input_ids"].dtype == torch.int64 and item["labels"].dtype == torch.int64
        assert item["input_ids"].shape == (seq,) and item["labels"].shape == (seq,)
        np.testing.assert_array_equal(item["input_ids"].numpy(), stream[p * seq:p * seq + seq])
        np.testing.assert_array_equal(item["labels"].numpy(), stream[p * seq + 1:p * seq + seq + 1])
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(IndexError):
        ds[-1]


def test_epochs_are_shuffled_together_as_megatron_does_each_document_once_per_epoch(tmp_path):
    prefix, docs = make_corpus(tmp_path, num_docs=25)
    tokens = sum(len(d) for d in docs)
    seq = 8
    ds = gpt(prefix, num_samples=3 * tokens // seq, seq_length=seq)
    n = len(docs)
    assert ds.num_epochs >= 3 and not ds.separate_last_epoch
    # Megatron shuffles the repeated document list in one go: each document appears once per
    # epoch over the whole index, but an epoch-long window is not a permutation.
    assert np.bincount(ds.doc_idx, minlength=n).tolist() == [ds.num_epochs] * n
    assert any(sorted(ds.doc_idx[e * n:(e + 1) * n].tolist()) != list(range(n)) for e in range(ds.num_epochs))
    # A separate last epoch is a permutation of its own, after the others.
    last = gpt(prefix, num_samples=2 * tokens // seq + 2, seq_length=seq, name="valid")
    assert last.separate_last_epoch
    assert sorted(last.doc_idx[-n:].tolist()) == list(range(n))
    assert np.bincount(last.doc_idx[:-n], minlength=n).tolist() == [last.num_epochs - 1] * n
    assert sorted(np.asarray(ds.shuffle_idx).tolist()) == list(range(len(ds)))
    # The samples' non-overlapping parts, put back in stream order, are the stream itself, and
    # the whole stream is every token of the corpus once per epoch.
    order = np.argsort(np.asarray(ds.shuffle_idx))
    joined = np.concatenate([ds[int(i)]["input_ids"].numpy() for i in order])
    stream = stream_of(ds, docs)
    np.testing.assert_array_equal(joined, stream[:len(ds) * seq])
    assert sorted(stream.tolist()) == sorted(np.concatenate(docs).tolist() * ds.num_epochs)


def test_sample_across_epoch_boundary(tmp_path):
    prefix, docs = make_corpus(tmp_path, num_docs=10)
    tokens = sum(len(d) for d in docs)
    seq = 13
    ds = gpt(prefix, num_samples=2 * tokens // seq, seq_length=seq)
    stream = stream_of(ds, docs)
    crossing = [p for p in range(len(ds)) if p * seq < tokens < p * seq + seq]
    assert crossing, "expected a sample that straddles the epoch boundary"
    p = crossing[0]
    i = int(np.nonzero(np.asarray(ds.shuffle_idx) == p)[0][0])
    got = np.concatenate([ds[i]["input_ids"].numpy(), ds[i]["labels"].numpy()[-1:]])
    np.testing.assert_array_equal(got, stream[p * seq:p * seq + seq + 1])


def test_separate_last_epoch_is_shuffled_on_its_own(tmp_path):
    prefix, docs = make_corpus(tmp_path, num_docs=30)
    tokens = sum(len(d) for d in docs)
    seq = 4
    per_epoch = (tokens - 1) // seq
    # Two full epochs plus a sliver of the third: the third epoch stays at the end.
    ds = gpt(prefix, num_samples=2 * per_epoch + 3, seq_length=seq)
    assert ds.num_epochs == 3 and ds.separate_last_epoch
    first = (2 * tokens - 1) // seq
    shuffle = np.asarray(ds.shuffle_idx)
    assert sorted(shuffle[:first].tolist()) == list(range(first))
    assert sorted(shuffle[first:].tolist()) == list(range(first, len(ds)))
    # Most of the third epoch needed: one shuffle over everything, as in Megatron.
    ds = gpt(prefix, num_samples=2 * per_epoch + int(0.9 * per_epoch), seq_length=seq)
    assert ds.num_epochs == 3 and not ds.separate_last_epoch
    assert not (np.asarray(ds.shuffle_idx)[:first] < first).all()


def test_documents_with_several_sequences(tmp_path):
    prefix, docs = make_corpus(tmp_path, num_docs=12, sequences_per_doc=3, min_len=0, max_len=9)
    ds = gpt(prefix, num_samples=20, seq_length=7)
    stream = stream_of(ds, docs)
    assert ds.tokens_per_epoch == sum(len(d) for d in docs)
    for i in range(len(ds)):
        p = int(ds.shuffle_idx[i])
        np.testing.assert_array_equal(ds[i]["input_ids"].numpy(), stream[p * 7:p * 7 + 7])


def test_same_seed_same_indices_other_seed_different(tmp_path):
    prefix, _ = make_corpus(tmp_path)
    a = gpt(prefix, 50, 8, seed=7, cache_dir=tmp_path / "a")
    b = gpt(prefix, 50, 8, seed=7, cache_dir=tmp_path / "b")
    c = gpt(prefix, 50, 8, seed=8, cache_dir=tmp_path / "c")
    for kind in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(getattr(a, kind), getattr(b, kind))
    assert not np.array_equal(a.doc_idx, c.doc_idx)
    assert not np.array_equal(a.shuffle_idx, c.shuffle_idx)
    assert all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in range(len(a)))


# ----------------------------------------------------------------------------------------------
# caching
# ----------------------------------------------------------------------------------------------
def test_index_files_cached_reused_and_named_like_megatron(tmp_path, monkeypatch):
    prefix, _ = make_corpus(tmp_path)
    ds = gpt(prefix, 40, 8, seed=3, name="train")
    stem = f"{prefix}_train_indexmap_40ns_8sl_3s"
    for kind in ("doc", "sample", "shuffle"):
        assert os.path.isfile(f"{stem}_{kind}_idx.npy")
    # Memory-mapped, not read into memory: a plain ndarray view whose base is the file's map.
    assert isinstance(ds.shuffle_idx.base, np.memmap) and not ds.shuffle_idx.flags.owndata
    mtimes = {p: os.stat(p).st_mtime_ns for p in glob.glob(f"{stem}_*")}

    def must_not_rebuild(*args, **kwargs):
        raise AssertionError("index rebuilt although a valid cache exists")

    monkeypatch.setattr(gd, "build_sample_idx", must_not_rebuild)
    again = gpt(prefix, 40, 8, seed=3, name="train")
    np.testing.assert_array_equal(ds.shuffle_idx, again.shuffle_idx)
    assert {p: os.stat(p).st_mtime_ns for p in glob.glob(f"{stem}_*")} == mtimes
    assert not glob.glob(str(tmp_path / "*tmp*"))


def test_changed_split_under_same_name_rebuilds(tmp_path):
    prefix, _ = make_corpus(tmp_path, num_docs=40)
    first = gpt(prefix, 40, 8, documents=np.arange(0, 20))
    second = gpt(prefix, 40, 8, documents=np.arange(20, 40))
    assert np.asarray(first.doc_idx).max() < 20
    assert np.asarray(second.doc_idx).min() >= 20


def test_cache_dir_and_read_only_data_dir(tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    prefix, _ = make_corpus(data_dir)
    ds = gpt(prefix, 10, 8, cache_dir=tmp_path / "cache")
    assert all(str(p).startswith(str(tmp_path / "cache")) for p in ds.index_paths.values())
    assert sorted(os.listdir(data_dir)) == ["corpus.bin", "corpus.idx"]
    # A data directory nobody may write to is never written to, even by root.
    monkeypatch.setenv("LIBAI_LITE_CACHE_DIR", str(tmp_path / "fallback"))
    os.chmod(data_dir, 0o555)
    try:
        ds = gpt(prefix, 10, 8)
    finally:
        os.chmod(data_dir, 0o755)
    assert sorted(os.listdir(data_dir)) == ["corpus.bin", "corpus.idx"]
    assert ds.index_paths["doc"].startswith(str(tmp_path / "fallback"))


def test_max_token_id_recorded_and_checked(tmp_path):
    prefix, docs = make_corpus(tmp_path, vocab=300)
    ds = gpt(prefix, 10, 8)
    # A corpus under the sampling budget is read whole: the range is exact, and nothing is written for it.
    assert ds.max_token_id == max(int(d.max()) for d in docs)
    assert ds.min_token_id == min(int(d.min()) for d in docs)
    assert not glob.glob(f"{prefix}_token_range*")
    check_token_ids(ds, ds.max_token_id + 1)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        check_token_ids(ds, ds.max_token_id)
    # The slow path (no contiguous token buffer) agrees with the fast one.
    indexed = MMapIndexedDataset(prefix)

    class SequencesOnly:
        sizes = indexed.sizes

        def __getitem__(self, index):
            return indexed[index]

    assert gd._scan_token_range(SequencesOnly()) == (ds.min_token_id, ds.max_token_id)


def test_pickles_small_and_reopens(tmp_path):
    prefix, _ = make_corpus(tmp_path, num_docs=3000, max_len=20)
    for documents in (np.arange(3000), np.arange(0, 3000, 2)):
        ds = gpt(prefix, 500, 16, documents=documents, cache_dir=tmp_path / str(len(documents)))
        blob = pickle.dumps(ds)
        # Memory maps are reopened by path, not copied; a contiguous split travels as a range.
        assert len(blob) < (5_000 if len(documents) == 3000 else 20_000)
        clone = pickle.loads(blob)
        assert len(clone) == len(ds)
        np.testing.assert_array_equal(clone.documents, ds.documents)
        for i in (0, 7, len(ds) - 1):
            assert torch.equal(clone[i]["input_ids"], ds[i]["input_ids"])


# ----------------------------------------------------------------------------------------------
# splits
# ----------------------------------------------------------------------------------------------
def test_split_strings_follow_megatron():
    assert get_train_valid_test_split("949,50,1", 1000) == [0, 949, 999, 1000]
    assert get_train_valid_test_split("0.98,0.02,0", 1000) == [0, 980, 1000, 1000]
    assert get_train_valid_test_split("98/2/0", 100) == [0, 98, 100, 100]
    assert get_train_valid_test_split("1", 37) == [0, 37, 37, 37]
    assert get_train_valid_test_split("8,2", 10) == [0, 8, 10, 10]
    rng = np.random.RandomState(0)
    for _ in range(300):
        size = int(rng.randint(0, 5000))
        shares = rng.randint(0, 5, size=3)
        if shares.sum() == 0:
            continue
        b = get_train_valid_test_split(",".join(map(str, shares)), size)
        assert b[0] == 0 and b[3] == size and b[0] <= b[1] <= b[2] <= b[3]
        for share, lo, hi in zip(shares, b, b[1:]):
            if share == 0:
                assert lo == hi


@pytest.mark.parametrize("bad", ["", "a,b,c", "1,2,3,4", "-1,2,0", "0,0,0", "1,,2", "nan,1,1"])
def test_bad_split_string_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="splits string") as info:
        get_train_valid_test_split(bad, 100)
    assert "\n" not in str(info.value) and "949,50,1" in str(info.value)


def test_split_datasets_use_contiguous_disjoint_documents(tmp_path):
    prefix, docs = make_corpus(tmp_path, num_docs=100)
    train, valid, test = build_gpt_train_valid_test_datasets(prefix, "80,15,5", [50, 10, 5], 8, 1)
    ranges = [(int(np.min(d.doc_idx)), int(np.max(d.doc_idx))) for d in (train, valid, test)]
    assert ranges == [(0, 79), (80, 94), (95, 99)]
    assert [d.name for d in (train, valid, test)] == ["train", "valid", "test"]
    assert len(train) >= 50 and len(valid) >= 10 and len(test) >= 5


def test_empty_split_asked_for_samples_is_a_clear_error(tmp_path, caplog):
    prefix, _ = make_corpus(tmp_path, num_docs=20)
    # A valid share too small for one of the 20 documents.
    with pytest.raises(ValueError, match="valid split .* has 0 of its 20 documents .*valid needs at least 1/20 of "
                                         "the total"):
        build_gpt_train_valid_test_datasets(prefix, "89,1,10", [10, 5, 5], 8, 1)
    # A test share too small: Megatron-LM goes on without a test split (a small corpus under '949,50,1'), said once.
    with caplog.at_level(logging.WARNING, logger="libai_lite"):
        train, valid, test = build_gpt_train_valid_test_datasets(prefix, "89,10,1", [10, 5, 5], 8, 1)
    assert test is None and train is not None and valid is not None
    said = {r.getMessage() for r in caplog.records if "test split" in r.getMessage()}
    assert said == {f"the test split of {prefix} has 0 of its 20 documents (splits_string '89,10,1'): no test "
                    f"dataset, as in Megatron-LM (test needs at least 1/20 of the total to hold a document)"}, said
    # No share at all ("90,10,0"): the split is not built, as in Megatron-LM and LiBai, whatever is asked.
    for test_samples in (0, 5):
        train, valid, test = build_gpt_train_valid_test_datasets(prefix, "90,10,0", [10, 5, test_samples], 8, 1)
        assert test is None and train is not None and valid is not None


def test_missing_prefix_is_one_clear_line(tmp_path):
    missing = str(tmp_path / "nope" / "my_text_document")
    with pytest.raises(IndexedDatasetError) as info:
        build_gpt_train_valid_test_datasets(missing, "949,50,1", [10, 0, 0], 8, 1)
    msg = str(info.value)
    assert missing in msg and "tools/preprocess_data.py" in msg and "current directory" in msg
    assert "\n" not in msg
    with pytest.raises(IndexedDatasetError, match="without the .bin/.idx suffix"):
        build_gpt_train_valid_test_loaders(missing + ".bin", train_valid_test_num_samples=[1, 0, 0],
                                           micro_batch_size=1, seq_length=8)


# ----------------------------------------------------------------------------------------------
# samplers
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dp", [1, 2])
def test_pretraining_sampler_layout_and_resume(dp):
    total, mbs = 103, 4
    full = [list(MegatronPretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)]
    steps = len(full[0])
    assert steps == total // (mbs * dp) and all(len(f) == steps for f in full)
    # Each step the ranks' slices are one run of consecutive indices, rank order.
    for step in range(steps):
        joined = sum((full[r][step] for r in range(dp)), [])
        start = step * mbs * dp
        assert joined == list(range(start, start + mbs * dp))
    for done in (0, 1, 5, steps):
        consumed = done * mbs * dp
        for r in range(dp):
            resumed = MegatronPretrainingSampler(total, consumed, mbs, r, dp)
            assert list(resumed) == full[r][done:]
            assert len(resumed) == steps - done


def test_pretraining_sampler_resume_on_a_different_dp_size():
    total, mbs = 96, 2
    single = [i for batch in MegatronPretrainingSampler(total, 0, mbs * 2, 0, 1) for i in batch]
    consumed = 5 * 4
    ranks = [list(MegatronPretrainingSampler(total, consumed, mbs, r, 2)) for r in range(2)]
    resumed = [i for step in zip(*ranks) for batch in step for i in batch]
    assert resumed == single[consumed:]


def test_pretraining_sampler_drop_last_false_and_errors():
    batches = list(MegatronPretrainingSampler(10, 0, 3, 1, 2, drop_last=False))
    assert batches == [[3, 4, 5], [9]]
    assert list(MegatronPretrainingSampler(10, 0, 3, 0, 2, drop_last=False))[-1] == [6, 7, 8]
    assert len(MegatronPretrainingSampler(10, 0, 3, 1, 2, drop_last=False)) == 2
    assert list(MegatronPretrainingSampler(10, 10, 3, 0, 2)) == []
    with pytest.raises(ValueError, match="consumed_samples"):
        MegatronPretrainingSampler(10, 11, 3, 0, 2)
    with pytest.raises(ValueError, match="data_parallel_rank"):
        MegatronPretrainingSampler(10, 0, 3, 2, 2)


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_eval_sampler_sees_every_sample_once_and_keeps_ranks_in_step(dp):
    total, mbs = 23, 4
    per_rank = [list(SequentialEvalSampler(total, 0, mbs, r, dp)) for r in range(dp)]
    assert len({len(p) for p in per_rank}) == 1
    assert all(len(b) == mbs for p in per_rank for b in p)
    seen = sorted(i for p in per_rank for b in p for i in b)
    assert [i for i in seen if i < total] == list(range(total))
    sampler = SequentialEvalSampler(total, 0, mbs, 0, dp)
    assert len([i for i in seen if i >= total]) == sampler.num_padding
    assert list(SequentialEvalSampler(total, 0, mbs, 0, dp, drop_last=True)) == per_rank[0][:total // (mbs * dp)]


def test_padded_eval_dataset_masks_padding_labels(tmp_path):
    prefix, _ = make_corpus(tmp_path)
    ds = gpt(prefix, 10, 8)
    padded = PaddedEvalDataset(ds, 5)
    assert len(padded) == 5 and padded.max_token_id == ds.max_token_id
    assert torch.equal(padded[4]["labels"], ds[4]["labels"])
    pad = padded[6]
    assert pad["input_ids"].shape == (8,) and (pad["labels"] == IGNORE_INDEX).all()


# ----------------------------------------------------------------------------------------------
# blending
# ----------------------------------------------------------------------------------------------
def test_blending_indices_are_proportional_and_deterministic():
    weights = [0.5, 0.3, 0.2]
    index, sample = build_blending_indices(weights, 10_000)
    again = build_blending_indices(weights, 10_000)
    np.testing.assert_array_equal(index, again[0])
    np.testing.assert_array_equal(sample, again[1])
    counts = np.zeros(3)
    for n, i in enumerate(index):
        counts[i] += 1
        assert np.all(np.abs(counts - np.array(weights) * (n + 1)) <= 1.0 + 1e-9)
    for i in range(3):
        assert np.array_equal(sample[index == i], np.arange((index == i).sum()))
    # Megatron's first picks: the heaviest dataset, then whoever lags most.
    assert index[:6].tolist() == [0, 1, 2, 0, 1, 0]


def test_blended_datasets_draw_in_proportion(tmp_path):
    a, docs_a = make_corpus(tmp_path, name="a", seed=1, vocab=1000)
    b, docs_b = make_corpus(tmp_path, name="b", seed=2, vocab=1000)
    assert parse_data_prefix([0.7, a, 0.3, b]) == ([a, b], [0.7, 0.3])
    train, valid, test = build_gpt_train_valid_test_datasets(["7", a, "3", b], "8,2,0", [400, 40, 0], 8, 5)
    assert isinstance(train, BlendableDataset) and len(train) == 400 and test is None
    share = np.bincount(train.dataset_index, minlength=2) / len(train)
    assert abs(share[0] - 0.7) < 0.02 and abs(share[1] - 0.3) < 0.02
    # Each blended sample is the right sample of the right part.
    for idx in (0, 1, 2, 199, 399):
        part = train.datasets[int(train.dataset_index[idx])]
        want = part[int(train.dataset_sample_index[idx])]["input_ids"]
        assert torch.equal(train[idx]["input_ids"], want)
    assert train.max_token_id == max(int(d.max()) for d in docs_a + docs_b)
    with pytest.raises(ValueError, match="blend list"):
        parse_data_prefix([0.5, a, 0.5])
    with pytest.raises(ValueError, match="blend list"):
        parse_data_prefix([a, b])


# ----------------------------------------------------------------------------------------------
# loaders
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_loaders_batch_shapes_and_resume(tmp_path, num_workers):
    prefix, _ = make_corpus(tmp_path, num_docs=60)
    kwargs = dict(splits_string="90,7,3", seq_length=8, seed=11, num_workers=num_workers,
                  train_valid_test_num_samples=[64, 10, 0], micro_batch_size=4)
    train, valid, test = build_gpt_train_valid_test_loaders(prefix, **kwargs)
    assert test is None
    batches = list(train)
    assert all(b["input_ids"].shape == (4, 8) and b["labels"].shape == (4, 8) for b in batches)
    assert torch.equal(batches[0]["labels"][:, :-1], batches[0]["input_ids"][:, 1:])
    resumed = list(build_gpt_train_valid_test_loaders(prefix, consumed_samples=12, **kwargs)[0])
    assert len(resumed) == len(batches) - 3
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(resumed, batches[3:]))
    eval_batches = list(valid)
    assert len(eval_batches) == 3 and all(b["input_ids"].shape == (4, 8) for b in eval_batches)
    real = torch.cat([b["labels"] for b in eval_batches])
    assert (real[:10] != IGNORE_INDEX).all() and (real[10:] == IGNORE_INDEX).all()


def test_loaders_for_two_data_parallel_ranks_partition_each_global_batch(tmp_path):
    prefix, _ = make_corpus(tmp_path, num_docs=60)
    kwargs = dict(splits_string="1,0,0", seq_length=8, seed=3, num_workers=0,
                  train_valid_test_num_samples=[48, 0, 0], micro_batch_size=3)
    single = list(build_gpt_train_valid_test_loaders(
        prefix, **{**kwargs, "micro_batch_size": 6})[0])
    ranks = [list(build_gpt_train_valid_test_loaders(prefix, data_parallel_rank=r, data_parallel_size=2,
                                                     **kwargs)[0]) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(single)
    for s, r0, r1 in zip(single, *ranks):
        assert torch.equal(s["input_ids"], torch.cat([r0["input_ids"], r1["input_ids"]]))


# ----------------------------------------------------------------------------------------------
# Megatron-LM's own files
# ----------------------------------------------------------------------------------------------
@pytest.mark.skipif(not (FIXTURES / "gpt2_mmap_text_document.idx").exists(),
                    reason="Megatron fixtures not present")
def test_dataset_over_megatron_preprocessed_corpus(tmp_path):
    prefix = str(FIXTURES / "gpt2_mmap_text_document")
    before = sorted(os.listdir(FIXTURES))
    train, valid, _ = build_gpt_train_valid_test_datasets(prefix, "949,50,1", [200, 20, 0], 128, 1234,
                                                          cache_dir=str(tmp_path), vocab_size=8000)
    indexed = MMapIndexedDataset(prefix)
    docs = [indexed.get(i).astype(np.int64) for i in range(len(indexed))]
    stream = stream_of(train, docs)
    for i in (0, 1, 100, len(train) - 1):
        p = int(train.shuffle_idx[i])
        np.testing.assert_array_equal(train[i]["input_ids"].numpy(), stream[p * 128:p * 128 + 128])
    assert train.max_token_id < 8000
    assert sorted(os.listdir(FIXTURES)) == before


# ----------------------------------------------------------------------------------------------
# several processes
# ----------------------------------------------------------------------------------------------
def _two_rank_worker(rank, world_size, init_file, prefix, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        builds = []
        original = GPTDataset._build_indices

        def counting(self):
            builds.append(self.name)
            original(self)

        GPTDataset._build_indices = counting
        train, valid, _ = build_gpt_train_valid_test_datasets(prefix, "9,1,0", [64, 8, 0], 8, 42)
        np.save(os.path.join(out_dir, f"shuffle{rank}.npy"), np.asarray(train.shuffle_idx))
        with open(os.path.join(out_dir, f"builds{rank}.txt"), "w") as f:
            f.write(",".join(builds))
    finally:
        dist.destroy_process_group()


def test_rank0_builds_and_other_ranks_wait(tmp_path):
    prefix, _ = make_corpus(tmp_path, num_docs=50)
    # fork: the children need no fresh interpreter, which keeps this test at about a second.
    spawn_ranks(_two_rank_worker, 2, (2, str(tmp_path / "init"), prefix, str(tmp_path)), start_method="fork")
    assert (tmp_path / "builds0.txt").read_text() == "train,valid"
    assert (tmp_path / "builds1.txt").read_text() == ""
    np.testing.assert_array_equal(np.load(tmp_path / "shuffle0.npy"), np.load(tmp_path / "shuffle1.npy"))
    assert not glob.glob(str(tmp_path / "*.tmp"))


def megatron_indices(documents, sizes, num_samples, seq_length, seed):
    """Line-by-line port of Megatron-LM's ``_build_index_mappings`` (legacy gpt_dataset.py), the reference."""
    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs, total = 0, 0
    while True:
        num_epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            break
    rng = np.random.RandomState(seed=seed)
    if num_epochs == 1:
        separate = False
    else:
        from_full = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = (num_samples - from_full) < int(0.80 * per_epoch)

    def doc_idx_of(epochs, separate_last):
        if not separate_last or epochs == 1:
            idx = np.mgrid[0:epochs, 0:len(documents)][1]
            idx[:] = documents
            idx = idx.reshape(-1).astype(np.int32)
            rng.shuffle(idx)
            return idx
        return np.concatenate((doc_idx_of(epochs - 1, False), doc_idx_of(1, False)))

    doc_idx = doc_idx_of(num_epochs, separate)
    sample_idx = megatron_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    n = from_full if separate else sample_idx.shape[0] - 1
    first = np.arange(0, n, dtype=np.uint32)
    rng.shuffle(first)
    if n == sample_idx.shape[0] - 1:
        return doc_idx, sample_idx, first
    last = np.arange(n, sample_idx.shape[0] - 1, dtype=np.uint32)
    rng.shuffle(last)
    return doc_idx, sample_idx, np.concatenate((first, last))


@pytest.mark.parametrize("num_samples", [110, 117, 215, 397])
def test_tiny_splits_needing_ten_or_more_epochs_match_megatron(tmp_path, num_samples):
    # 6 short documents (82 tokens): valid/test-sized splits of this kind need many epochs, with and without a
    # separate last epoch; the Megatron port above is the reference.
    prefix, docs = make_corpus(tmp_path, num_docs=9, max_len=20, seed=3)
    documents = np.arange(3, 9)
    ds = gpt(prefix, num_samples, 7, seed=11, documents=documents, name="valid")
    assert ds.num_epochs >= 10
    sizes = np.array([len(d) for d in docs], dtype=np.int32)
    doc_idx, sample_idx, shuffle_idx = megatron_indices(documents, sizes, num_samples, 7, 11)
    np.testing.assert_array_equal(ds.doc_idx, doc_idx)
    np.testing.assert_array_equal(ds.sample_idx, sample_idx)
    np.testing.assert_array_equal(ds.shuffle_idx, shuffle_idx)


def test_separate_last_epoch_cases_are_both_exercised_by_the_tiny_split_test(tmp_path):
    prefix, _ = make_corpus(tmp_path, num_docs=9, max_len=20, seed=3)
    seen = {gpt(prefix, n, 7, seed=11, documents=np.arange(3, 9), name="valid").separate_last_epoch
            for n in (110, 117, 215, 397)}
    assert seen == {True, False}


def test_truncated_cache_file_is_rebuilt_with_a_log_line(tmp_path, caplog):
    prefix, _ = make_corpus(tmp_path)
    ds = gpt(prefix, 60, 8)
    want = np.array(ds.shuffle_idx)
    path = ds.index_paths["sample"]
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])  # a copy or a write cut short
    with caplog.at_level("WARNING", logger="libai_lite.data.gpt_dataset"):
        again = gpt(prefix, 60, 8)
    assert any("rebuilding the train indices" in r.message and "unreadable" in r.message for r in caplog.records)
    np.testing.assert_array_equal(again.shuffle_idx, want)
    assert os.path.getsize(path) == len(data)


_RACE = r"""
import sys, time, numpy as np
sys.path.insert(0, {root!r})
from tests.data.test_gpt_dataset import gpt
from libai_lite.data import gpt_dataset as gd
write = gd._atomic_write
def slow_write(path, data):  # widen the window between the cache's files, as a slow disk does
    time.sleep(0.2)
    write(path, data)
gd._atomic_write = slow_write
time.sleep(float(sys.argv[2]))
ds = gpt({prefix!r}, {n}, 8)
np.save(sys.argv[1], np.asarray(ds.shuffle_idx))
print(sum(int(ds.get_tokens(i).sum()) for i in range(len(ds))))
"""


def test_two_processes_building_one_cache_at_once_read_whole_identical_arrays(tmp_path):
    # Two jobs start together on one corpus with no cache, the second while the first is writing:
    # each must end with the complete arrays (one builds under the lock, the other waits and
    # reads), never a half-written or removed file.
    prefix, _ = make_corpus(tmp_path, num_docs=100, max_len=100)
    code = _RACE.format(root=str(ROOT), prefix=prefix, n=2000)
    for delay in (0.3, 0.6):
        for p in Path(tmp_path).glob("corpus_train_indexmap_*"):
            p.unlink()
        procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / f"out{i}.npy"), str(i * delay)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env())
                 for i in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err[-2000:]
        assert outs[0][0] == outs[1][0]
        np.testing.assert_array_equal(np.load(tmp_path / "out0.npy"), np.load(tmp_path / "out1.npy"))
    assert not list(Path(tmp_path).glob("*.tmp"))


@pytest.mark.parametrize("damage", ["pointer_past_bin", "negative_size", "doc_index_unordered"])
def test_index_not_describing_its_bin_is_refused_at_open_in_one_line(tmp_path, damage):
    # A .idx whose pointers run past the .bin used to pass the start checks and fail at the first
    # sample reading there (iteration 130 of a real run), with advice that did not fix it.
    prefix, _ = make_corpus(tmp_path, num_docs=40)
    n = len(MMapIndexedDataset(prefix))
    header = 9 + 8 + 1 + 8 + 8
    with open(prefix + ".idx", "r+b") as f:
        if damage == "pointer_past_bin":
            f.seek(header + n * 4 + 17 * 8)
            f.write(np.int64(10 ** 9).tobytes())
        elif damage == "negative_size":
            f.seek(header + 5 * 4)
            f.write(np.int32(-3).tobytes())
        else:
            f.seek(header + n * 12 + 8 * 8)
            f.write(np.int64(2).tobytes())
    with pytest.raises(IndexedDatasetError) as e:
        MMapIndexedDataset(prefix)
    msg = str(e.value)
    assert "\n" not in msg and f"{prefix}.idx is corrupt" in msg and "re-run tools/preprocess_data.py" in msg
    where = {"pointer_past_bin": "sequence 17 ", "negative_size": "sequence 5 ", "doc_index_unordered": "document index"}
    assert where[damage] in msg


def test_split_rounding_core_by_default_legacy_by_key_and_a_bad_value_refused():
    # Megatron core rounds cumulative shares, legacy rounds each share then shifts to the end.
    assert get_train_valid_test_split("949,50,1", 10010) == [0, 9499, 10000, 10010]
    assert get_train_valid_test_split("949,50,1", 10010, "legacy") == [0, 9500, 10000, 10010]
    with pytest.raises(UsageError, match="split_rounding must be one of core, legacy"):
        get_train_valid_test_split("949,50,1", 100, "nearest")
