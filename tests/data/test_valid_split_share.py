"""A training run that evaluates needs a valid split with documents: a splits string that gives it none is
refused at start-up in one line, before any index is cached, instead of training without ever evaluating."""
import pytest

from libai_lite.config import LazyConfig
from libai_lite.run_spec import resolve_run, tokenizer_from_config
from libai_lite.utils.errors import UsageError
from libai_lite.utils.parallel_dims import ParallelDims
from tests.launch import CONFIG, ROOT, one_error_line, tiny, train_net, tree_snapshot

NO_VALID_SHARE = ("gives the valid split a share of 0, so train.evaluation.enabled=True would never evaluate; give the "
                  "valid split a share, e.g. '949,50,1', or set train.evaluation.enabled=False")


def _resolve(tmp_path, *extra):
    cfg = LazyConfig.load(str(ROOT / CONFIG))
    cfg = LazyConfig.apply_overrides(cfg, tiny(tmp_path / "out", tmp_path / "cache", "train.train_iter=2", *extra))
    return resolve_run(cfg, ParallelDims.resolve(1, cfg.train.dist), tokenizer_from_config(cfg.tokenization))


@pytest.mark.parametrize("splits", ["1,0,0", "1", "98/0/2"])
def test_a_valid_split_without_a_share_is_refused_when_training_evaluates(tmp_path, splits):
    before = tree_snapshot(tmp_path)
    with pytest.raises(UsageError) as e:
        _resolve(tmp_path, f"dataloader.train.splits_string='{splits}'", "train.evaluation.enabled=True")
    assert str(e.value) == f"dataloader.train.splits_string={splits!r} {NO_VALID_SHARE}"
    assert tree_snapshot(tmp_path) == before
    # Without evaluation the split is not needed: the run resolves.
    _resolve(tmp_path, f"dataloader.train.splits_string='{splits}'", "train.evaluation.enabled=False")


def test_train_net_refuses_a_valid_split_without_a_share_before_it_writes(tmp_path):
    """It trained to the end before, evaluating nothing and saying nothing."""
    before = tree_snapshot(tmp_path)
    r = train_net(tiny(tmp_path / "out", tmp_path / "cache", "train.train_iter=2", "train.evaluation.eval_period=1",
                       "dataloader.train.splits_string='1,0,0'"))
    assert r.returncode == 1
    assert one_error_line(r) == f"error: dataloader.train.splits_string='1,0,0' {NO_VALID_SHARE}"
    assert tree_snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_a_valid_share_too_small_for_one_document_is_refused_before_any_index_is_cached(tmp_path):
    """The train split's index was cached before the valid split was found empty."""
    before = tree_snapshot(tmp_path)
    r = train_net(tiny(tmp_path / "out", tmp_path / "cache", "train.train_iter=2", "train.evaluation.eval_period=1",
                       "dataloader.train.splits_string='100000,1,0'"))
    assert r.returncode == 1
    line = one_error_line(r)
    assert "the valid split of data_test/gpt2/demo_gpt2_text_document has 0 of its 3189 documents (splits_string " \
           "'100000,1,0')" in line, line
    assert "(valid needs at least 1/3189 of the total to hold a document), or ask for 0 valid samples (when " \
           "training: train.evaluation.enabled=False)" in line, line
    assert tree_snapshot(tmp_path) == before and not (tmp_path / "cache").exists()
