"""Index arrays are sized before they are built: a split the machine cannot hold is one `error:` line
(naming the epochs it asks for and the key to change) with nothing written; evaluation batches beyond
one pass over the valid split are capped in one warning line."""
import logging

import pytest

from libai_lite.config import LazyCall
from libai_lite.data import build_gpt_train_valid_test_loaders
from libai_lite.data.build import cap_eval_iter, valid_samples_per_epoch
from libai_lite.data.index_budget import check_index_budget, index_bytes
from libai_lite.utils.errors import UsageError
from tests.launch import DATA, ROOT, one_error_line, tiny, train_net


def test_index_bytes_counts_megatron_arrays():
    # 10 documents x 2 epochs of 1000 tokens at seq 100: 20 doc entries, 19 samples (+1 row).
    memory, disk = index_bytes(10, 2, 1000, 100)
    assert disk == 20 * 4 + 20 * 2 * 4 + 19 * 4
    assert memory >= disk


def test_a_split_beyond_memory_is_one_line_naming_epochs_and_the_key(tmp_path, monkeypatch, caplog):
    import libai_lite.data.index_budget as budget

    args = ("train", "corpus", 10**9, 128, 10**6, 1000, 128001, str(tmp_path / "x_sample_idx.npy"))
    monkeypatch.setattr(budget, "available_memory", lambda: 2**30)
    with pytest.raises(UsageError) as e:
        check_index_budget(*args)
    msg = str(e.value)
    assert "\n" not in msg and "128,001 epochs" in msg and "lower train.train_iter" in msg
    # Enough memory, too little disk where the indices go: the line names the cache directory.
    monkeypatch.setattr(budget, "available_memory", lambda: 2**50)
    monkeypatch.setattr(budget, "free_disk", lambda path: 2**20)
    with pytest.raises(UsageError, match="free where they are cached .*dataloader.train.cache_dir"):
        check_index_budget(*args)
    # It fits: many epochs are one warning line, not a refusal.
    monkeypatch.setattr(budget, "free_disk", lambda path: 2**50)
    with caplog.at_level(logging.WARNING):
        check_index_budget(*args)
    assert "the corpus is small for this run" in caplog.text


def test_train_iter_1e18_is_one_error_line_and_writes_nothing(tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    r = train_net(tiny(out, cache, "train.train_iter=1e18"))
    assert r.returncode == 1
    line = one_error_line(r)
    assert "the train split of" in line and "epochs of its" in line and "train.train_iter" in line
    assert not out.exists()
    assert not list(cache.glob("*indexmap*")) if cache.exists() else True


def test_eval_iter_beyond_the_valid_split_is_capped_in_one_warning(caplog):
    loader = LazyCall(build_gpt_train_valid_test_loaders)(data_prefix=str(ROOT / DATA), splits_string="949,50,1",
                                                          seq_length=128)
    per_epoch = valid_samples_per_epoch(str(ROOT / DATA), "949,50,1", 128)
    assert per_epoch > 16
    with caplog.at_level(logging.WARNING):
        assert cap_eval_iter(loader, 10**9, 8) == per_epoch // 8
        assert cap_eval_iter(loader, 2, 8) == 2
    lines = [r for r in caplog.records if "eval_iter" in r.getMessage()]
    assert len(lines) == 1 and "capped to" in lines[0].getMessage()


def test_t5_loaders_cap_eval_iter_by_their_valid_split():
    from projects.MT5.data.t5_dataset import build_t5_train_valid_test_loaders, t5_valid_samples_per_epoch

    prefix = str(ROOT / "data_test/bert/demo_bert_text_document")
    loader = LazyCall(build_t5_train_valid_test_loaders)(data_prefix=prefix, max_seq_length=64)
    per_epoch = t5_valid_samples_per_epoch(prefix, max_seq_length=64)
    assert 0 < per_epoch < valid_samples_per_epoch(prefix, "949,50,1", 64)  # raw windows are longer
    assert cap_eval_iter(loader, 10**9, 4) == max(1, per_epoch // 4)


def test_a_blend_beyond_memory_is_one_line_and_a_long_blend_shows_progress(monkeypatch, caplog):
    import libai_lite.data.build as build
    import libai_lite.data.index_budget as budget

    monkeypatch.setattr(build, "available_memory", lambda: 10**6)
    with pytest.raises(UsageError, match="blending 1,000,000 samples needs about .* lower train.train_iter"):
        build.BlendableDataset([list(range(10**6))] * 2, [0.5, 0.5], 10**6)
    monkeypatch.setattr(build, "available_memory", lambda: 2**40)
    monkeypatch.setattr(build, "_BLEND_CHUNK", 4)
    monkeypatch.setattr(budget, "_LOG_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO):
        index, _ = build.build_blending_indices([0.5, 0.5], 10)
    assert index.tolist() == [0, 1, 0, 1, 0, 1, 0, 1, 0, 1]
    assert "blending datasets: 8/10 (80%), ETA" in caplog.text
