"""``model.cfg.vocab_size`` is sized from the tokenizer (its ids padded to tokenization.make_vocab_size_divisible_by,
as Megatron-LM and LiBai do): a value smaller than the tokenizer is refused in one line, since its ids would not
fit; a larger one is replaced, and the run says so in one log line."""
import logging

import pytest

from libai_lite.config import LazyConfig
from libai_lite.run_spec import resolve_run, tokenizer_from_config
from libai_lite.utils.errors import UsageError
from libai_lite.utils.parallel_dims import ParallelDims
from tests.launch import CONFIG, ROOT, one_error_line, tiny, train_net, tree_snapshot

TOO_SMALL = ("model.cfg.vocab_size=100 is smaller than the tokenizer's 8000 ids, which would not fit the model's "
             "vocabulary; drop model.cfg.vocab_size=100 (the run sizes the vocabulary from the tokenizer: 8064 rows) "
             "or set tokenization.tokenizer to one of at most 100 ids")


def _resolve(tmp_path, *extra):
    cfg = LazyConfig.load(str(ROOT / CONFIG))
    cfg = LazyConfig.apply_overrides(cfg, tiny(tmp_path / "out", tmp_path / "cache", "train.evaluation.enabled=False",
                                               *extra))
    return resolve_run(cfg, ParallelDims.resolve(1, cfg.train.dist), tokenizer_from_config(cfg.tokenization))


def test_a_vocab_size_smaller_than_the_tokenizer_is_refused(tmp_path):
    with pytest.raises(UsageError) as e:
        _resolve(tmp_path, "model.cfg.vocab_size=100")
    assert str(e.value) == TOO_SMALL


def test_train_net_refuses_a_vocab_size_smaller_than_the_tokenizer_before_it_writes(tmp_path):
    """It trained a model of 8064 rows before, without a word about the 100 asked for."""
    before = tree_snapshot(tmp_path)
    r = train_net(tiny(tmp_path / "out", tmp_path / "cache", "train.train_iter=1", "train.evaluation.enabled=False",
                       "model.cfg.vocab_size=100"))
    assert r.returncode == 1
    assert one_error_line(r) == f"error: {TOO_SMALL}"
    assert tree_snapshot(tmp_path) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("given", [8000, 8192, 50304])
def test_a_vocab_size_the_tokenizer_replaces_is_said_in_one_line(tmp_path, caplog, given):
    with caplog.at_level(logging.INFO, logger="libai_lite"):
        spec = _resolve(tmp_path, f"model.cfg.vocab_size={given}")
    assert spec.vocab_size == 8064 and spec.cfg.model.cfg.vocab_size == 8064
    said = [r.getMessage() for r in caplog.records if "model.cfg.vocab_size" in r.getMessage()]
    assert said == [f"model.cfg.vocab_size={given} replaced by 8064: the tokenizer's 8000 ids padded to a multiple of "
                    f"tokenization.make_vocab_size_divisible_by=128"]


def test_the_padded_size_itself_is_taken_without_a_line(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="libai_lite"):
        assert _resolve(tmp_path, "model.cfg.vocab_size=8064").vocab_size == 8064
    assert not [r for r in caplog.records if "model.cfg.vocab_size" in r.getMessage()]
