"""torch's NCCL flight recorder: turned on for NCCL runs (dumping into the run folder) where the user has not
configured it, named by the collective-timeout error line; nothing set on gloo."""
import os

import pytest

from libai_lite.utils import distributed as D

NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
         "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)


def test_nccl_sets_exactly_the_flight_recorder_variables_into_the_run_folder(tmp_path):
    env = D.flight_recorder_env("nccl", str(tmp_path / "run"), {})
    assert env == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "run" / "flight_recorder" / "rank_")}


def test_gloo_sets_nothing(tmp_path):
    assert D.flight_recorder_env("gloo", str(tmp_path), {}) == {}


def test_a_users_setting_is_kept_under_either_of_torchs_names(tmp_path):
    env = D.flight_recorder_env("nccl", str(tmp_path), {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
                                                         "TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr_"})
    assert env == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def test_a_gloo_process_group_leaves_the_environment_untouched(tmp_path, clean_env):
    before = dict(os.environ)
    D.setup_dist({"backend": "gloo"}, output_dir=str(tmp_path))
    try:
        assert dict(os.environ) == before
        assert D.flight_recorder_dir() is None
    finally:
        D.destroy()


def test_the_timeout_line_names_the_dump_folder_under_nccl(tmp_path, clean_env, monkeypatch):
    for name, value in D.flight_recorder_env("nccl", str(tmp_path), {}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(D._MONITOR, "backend", "nccl")
    monkeypatch.setitem(D._MONITOR, "timeout_s", 5.0)
    line = D.describe_collective_timeout(RuntimeError("timed out"))
    folder = tmp_path / "flight_recorder"
    assert f"NCCL's flight recorder dumps each rank's last collectives to {folder}{os.sep}rank_<N>" in line, line
    assert f"`torchfrtrace {folder}`" in line, line
    monkeypatch.setitem(D._MONITOR, "backend", "gloo")
    assert "flight recorder" not in D.describe_collective_timeout(RuntimeError("timed out"))
