"""Checkpoints checksummed as they are written (issue 25): the manifest's CRC-32s come from the bytes on
their way to disk, no file is read back to make it, and its format is the one every loader checks."""
import io
import json
import os
import zlib

import pytest
import torch


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 32)).sum().backward()
    opt.step()  # Adam's moments exist: the optimizer state is saved too
    return model, opt


def _file_crc(path) -> str:
    with open(path, "rb") as f:
        return f"{zlib.crc32(f.read()):08x}"


@pytest.fixture
def reads(monkeypatch):
    """Every read of a checkpoint file's bytes during the test: the manifest's read-back path and any
    open() for reading of a file (not a directory, which fsyncs open) under the checkpoint directory."""
    from libai_lite.checkpoint import integrity as module

    seen = []
    record, real_open = module._file_record, io.open

    def spy_record(path):
        seen.append(("read back", path))
        return record(path)

    def spy_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and "r" in mode and "+" not in mode and os.path.isfile(file) \
                and os.path.basename(os.path.dirname(os.fspath(file))).startswith("model_"):
            seen.append(("open", os.fspath(file)))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(module, "_file_record", spy_record)
    monkeypatch.setattr(io, "open", spy_open)
    monkeypatch.setattr("builtins.open", spy_open)
    return seen


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_checksums_every_file_as_it_writes_it_and_reads_none_back(tmp_path, reads, async_save):
    from libai_lite.checkpoint import Checkpointer

    model, opt = _model_and_optimizer()
    ck = Checkpointer(model, opt, str(tmp_path), async_save=async_save)
    ck.save("model_0000001", {"iteration": 1})
    ck.wait()
    assert reads == []
    path = tmp_path / "model_0000001"
    with open(path / "manifest.json") as f:
        manifest = json.load(f)
    # The format every version writes and loads: each other file's size and CRC-32, as on disk.
    assert manifest["checksum"] == "crc32"
    files = sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == files
    assert ".metadata" in files and "trainer_state.json" in files and "rng_state_0.pt" in files
    for name in files:
        assert manifest["files"][name] == {"bytes": (path / name).stat().st_size, "crc32": _file_crc(path / name)}


def test_writer_threads_write_one_file_each_and_the_checkpoint_loads_back_exactly(tmp_path):
    from libai_lite.checkpoint import Checkpointer
    from libai_lite.checkpoint.integrity import verify_checkpoint

    model, opt = _model_and_optimizer()
    Checkpointer(model, opt, str(tmp_path), writer_threads=3).save("model_0000001", {"iteration": 1})
    path = tmp_path / "model_0000001"
    assert sorted(p.name for p in path.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    verify_checkpoint(str(path))
    other, other_opt = _model_and_optimizer(seed=1)
    Checkpointer(other, other_opt, str(tmp_path)).load(str(path))
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), other_opt.state.values()):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_a_flipped_byte_is_still_refused_at_load(tmp_path):
    """The CRC computed while writing is that of the bytes the loader reads: corruption after the save shows."""
    from libai_lite.checkpoint import Checkpointer
    from libai_lite.checkpoint.integrity import verify_checkpoint
    from libai_lite.utils.errors import UsageError

    model, opt = _model_and_optimizer()
    Checkpointer(model, opt, str(tmp_path)).save("model_0000001", {"iteration": 1})
    shard = tmp_path / "model_0000001" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(UsageError, match="CRC-32 mismatch"):
        verify_checkpoint(str(tmp_path / "model_0000001"))


def test_verification_is_the_loaders_argument_not_a_setting_of_the_process(tmp_path):
    """verify=False (--no-verify) loads changed bytes for that checkpointer only: the next one still refuses them."""
    from libai_lite.checkpoint import Checkpointer
    from libai_lite.utils.errors import UsageError

    model, opt = _model_and_optimizer()
    Checkpointer(model, opt, str(tmp_path)).save("model_0000001", {"iteration": 1})
    state = tmp_path / "model_0000001" / "trainer_state.json"
    state.write_text(state.read_text().replace('"iteration": 1', '"iteration": 7'))  # same size, other CRC
    assert Checkpointer(model, opt, verify=False).load(str(state.parent))["iteration"] == 7
    with pytest.raises(UsageError, match="trainer_state.json differ from those saved"):
        Checkpointer(model, opt).load(str(state.parent))


def test_files_no_rank_checksummed_or_whose_size_changed_are_read_back_for_the_manifest(tmp_path):
    from libai_lite.checkpoint.integrity import write_manifest

    (tmp_path / "a.bin").write_bytes(b"a" * 1000)
    (tmp_path / "b.bin").write_bytes(b"b" * 10)
    (tmp_path / "c.bin").write_bytes(b"c" * 7)
    # c's record is trusted (its size matches); a's size does not match; b has no record.
    known = {"a.bin": {"bytes": 999, "crc32": "00000000"}, "c.bin": {"bytes": 7, "crc32": "0badc0de"}}
    assert write_manifest(str(tmp_path), known=known) == ""
    files = json.loads((tmp_path / "manifest.json").read_text())["files"]
    assert files == {"a.bin": {"bytes": 1000, "crc32": _file_crc(tmp_path / "a.bin")},
                     "b.bin": {"bytes": 10, "crc32": _file_crc(tmp_path / "b.bin")},
                     "c.bin": {"bytes": 7, "crc32": "0badc0de"}}


def test_a_stream_that_seeks_records_nothing_and_a_rename_carries_the_record(tmp_path):
    from libai_lite.checkpoint.crc_writer import CrcFileSystemWriter

    writer = CrcFileSystemWriter(str(tmp_path))
    fs = writer.fs
    with fs.create_stream(tmp_path / "plain.tmp", "wb") as f:
        f.write(b"hello ")
        f.write(memoryview(torch.arange(10, dtype=torch.float32).numpy()))
    fs.rename(tmp_path / "plain.tmp", tmp_path / "plain")
    with fs.create_stream(tmp_path / "seeked", "wb") as f:
        f.write(b"xxxx")
        f.seek(0)
        f.write(b"yy")
    assert writer.records == {"plain": {"bytes": 46, "crc32": _file_crc(tmp_path / "plain")}}


@pytest.mark.parametrize("value, device, expected", [(None, "cuda", True), (None, "cpu", False),
                                                     (False, "cuda", False), (True, "cpu", True)])
def test_async_save_defaults_to_on_for_a_gpu_run_and_off_on_the_cpu(value, device, expected):
    from libai_lite.checkpoint.dcp_io import async_save_wanted

    assert async_save_wanted(value, torch.device(device)) is expected


def test_the_shipped_default_is_auto():
    from libai_lite.config import LazyConfig
    from tests.launch import ROOT

    cfg = LazyConfig.load(str(ROOT / "configs" / "common" / "train.py"))
    assert cfg.train.checkpointer.async_save is None
