"""Refusals that named another cause than the real one now name the real one (issue: an override without a key
was an "Unknown config key ''", a NaN blend weight "not a path", a config path that is a directory "not found",
an unquoted splits_string=100 "expected up to three numbers" although its quoted form is accepted)."""
import math
import sys

import pytest

from libai_lite.config import LazyConfig
from tests.launch import CONFIG, ROOT, one_error_line, python_tool


def _demo():
    return LazyConfig.load(str(ROOT / CONFIG))


def test_an_override_without_a_key_says_so():
    with pytest.raises(Exception, match=r"Override '=x' names no key; write KEY=VALUE"):
        LazyConfig.apply_overrides(_demo(), ["=x"])


def test_a_blend_weight_that_is_not_finite_is_named_as_such():
    from libai_lite.config.validate import check_paths
    from libai_lite.run_sections import PATHS
    from libai_lite.utils.errors import UsageError

    for weight in ("nan", "inf"):
        cfg = LazyConfig.apply_overrides(
            _demo(), [f"dataloader.train.data_prefix=[{weight},data_test/gpt2/demo_gpt2_text_document]"])
        with pytest.raises(UsageError, match="a blend weight is not a finite number; give each prefix a finite weight"):
            check_paths(cfg, PATHS)


def test_a_bare_number_as_splits_string_reads_as_its_quoted_form():
    from libai_lite.data.build import parse_splits_string

    assert parse_splits_string(100) == parse_splits_string("100") == [1.0, 0.0, 0.0]
    assert parse_splits_string(0.5) == [1.0, 0.0, 0.0]
    assert not math.isnan(sum(parse_splits_string("949,50,1")))


def test_a_config_path_that_is_a_directory_says_so(tmp_path):
    r = python_tool([sys.executable, "tools/train_net.py", "--config-file", "projects/GPT/configs"])
    line = one_error_line(r)
    assert r.returncode != 0 and line == ("error: config file projects/GPT/configs is a directory; pass one of its .py "
                                          "or .yaml config files"), line


def test_a_data_file_that_is_a_directory_says_so(tmp_path):
    from libai_lite.data.build import open_indexed_dataset

    (tmp_path / "x.bin").mkdir()
    (tmp_path / "x.idx").write_bytes(b"")
    with pytest.raises(Exception, match=r"x.bin is a directory, not the corpus file; point the prefix at a .bin/.idx"):
        open_indexed_dataset(str(tmp_path / "x"))


def test_a_lock_that_is_a_directory_names_the_lock(tmp_path):
    from libai_lite.utils.errors import UsageError
    from libai_lite.utils.process import OutputDirLock

    (tmp_path / ".lock").mkdir()
    with pytest.raises(UsageError, match=r"\.lock is a directory where the run's lock file goes; no run made it: "
                                         r"remove it"):
        OutputDirLock(str(tmp_path)).acquire()
