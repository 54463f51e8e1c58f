"""The W&B writer (libai_lite/engine/wandb_writer.py): an offline run holds metrics.json's scalars and the
resolved config, read back from the run's .wandb file; a missing package or a bad mode is one line."""
import inspect
import json
import struct
import sys
import zlib
from pathlib import Path

import pytest
import yaml

from libai_lite.config import LazyConfig
from libai_lite.engine import default as engine_default
from libai_lite.engine.wandb_writer import WandbWriter, build_wandb_writer
from libai_lite.run_sections import wandb_settings
from libai_lite.utils.errors import UsageError
from tests.launch import CONFIG, ROOT, one_error_line, tiny, train_net

wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install -e .[wandb])")

# W&B's own bookkeeping keys in every history row.
WANDB_KEYS = {"_step", "_runtime", "_timestamp"}


def wandb_records(path):
    """The protobuf records of a .wandb file.

    wandb no longer ships a Python reader of its transaction log, so this follows its format (the
    LevelDB log layout: a 7-byte ':W&B' header, 32 KiB blocks, records of crc32/length/type chunks).
    """
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), "not a .wandb file"
    block, header, pos, parts = 32768, 7, 7, b""
    while pos + header <= len(data):
        left = block - pos % block
        if left < header:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        if (crc, length, kind) == (0, 0, 0):
            pos += left
            continue
        chunk = data[pos + header:pos + header + length]
        pos += header + length
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, "corrupt .wandb record"
        parts = chunk if kind in (1, 2) else parts + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def read_offline_run(output_dir):
    """(step -> history row, config) of the one offline W&B run under ``output_dir/wandb``."""
    files = list(Path(output_dir, "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history, config = {}, {}
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in row.items() if k not in WANDB_KEYS}
        updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else ()
        for item in updates:
            config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    config.pop("_wandb", None)  # W&B's own entry
    return history, config


def metrics_rows(output_dir):
    """iteration -> every scalar metrics.json holds for it (rows of one iteration merged, later ones winning)."""
    rows = {}
    for line in open(Path(output_dir) / "metrics.json"):
        row = json.loads(line)
        rows.setdefault(row.pop("iteration"), {}).update(row)
    return rows


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real 3-iteration run: a log row per iteration, validation at 2 and 3 (the last in a row of its own)."""
    tmp = tmp_path_factory.mktemp("wandb_train")
    out = tmp / "out"
    r = train_net(tiny(out, tmp / "cache", "train.train_iter=3", "train.evaluation.eval_period=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    # No network, no account, and nothing written to ~/.config/wandb or the working directory.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))


def test_offline_run_holds_the_metrics_json_scalars_and_the_resolved_config(trained, tmp_path):
    """metrics.json's rows fed as PeriodicWriter feeds its writers: the W&B history equals them, row for row."""
    rows = [json.loads(line) for line in open(trained / "metrics.json")]
    assert len(rows) == 4 and rows[-1]["iteration"] == rows[-2]["iteration"] == 3  # the merge is exercised
    config = yaml.safe_load(open(trained / "config.yaml"))
    writer = WandbWriter(str(tmp_path), config, project="libai_lite_test", name="tiny", mode="offline")
    for row in rows:
        it = row.pop("iteration")
        for k, v in row.items():
            writer.add_scalar(k, v, it)
        writer.flush()
    writer.close()

    history, logged_config = read_offline_run(tmp_path)
    expected = metrics_rows(trained)
    assert sorted(history) == [1, 2, 3]
    for it, row in expected.items():
        # Exact: both sides are the same float64 values written as JSON.
        assert history[it] == row, it
    assert "valid/PPL" in history[2] and "valid/PPL" in history[3]
    assert logged_config == config
    assert logged_config["train"]["train_iter"] == 3


def test_build_wandb_writer_reads_train_wandb_and_config_yaml(trained, tmp_path):
    cfg = LazyConfig.load(str(ROOT / CONFIG))
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text((trained / "config.yaml").read_text())
    assert build_wandb_writer(wandb_settings(cfg), str(out)) is None  # off by default
    assert not (out / "wandb").exists()
    cfg.train.wandb.enabled = True
    writer = build_wandb_writer(wandb_settings(cfg), str(out))
    writer.add_scalar("total_loss", 1.5, 1)
    writer.close()
    history, config = read_offline_run(out)
    assert history == {1: {"total_loss": 1.5}}
    assert config == yaml.safe_load(open(trained / "config.yaml"))
    cfg.train.wandb.mode = "ofline"
    with pytest.raises(UsageError, match="^train.wandb.mode must be one of"):
        build_wandb_writer(wandb_settings(cfg), str(tmp_path / "other"))
    assert not (tmp_path / "other").exists()


def test_disabled_mode_writes_nothing(tmp_path):
    writer = WandbWriter(str(tmp_path), {"a": 1}, mode="disabled")
    writer.add_scalar("total_loss", 1.0, 1)
    writer.close()
    assert not (tmp_path / "wandb").exists()


def test_missing_wandb_is_one_line_naming_the_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(UsageError) as e:
        WandbWriter(str(tmp_path), mode="offline")
    assert str(e.value) == ("train.wandb.enabled=True needs the wandb package: "
                            "pip install -e .[wandb] (or pip install wandb)")


def test_bad_mode_is_one_line(tmp_path):
    with pytest.raises(UsageError, match=r"^train.wandb.mode must be one of 'online', 'offline', 'disabled', "
                                         r"not 'ofline'$"):
        WandbWriter(str(tmp_path), mode="ofline")
    assert not (tmp_path / "wandb").exists()


def test_online_without_a_login_is_one_line_pointing_to_offline(monkeypatch, tmp_path):
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login either
    with pytest.raises(UsageError) as e:
        WandbWriter(str(tmp_path / "out"), {"a": 1}, mode="online")
    message = str(e.value)
    assert message.startswith("W&B could not start a run (") and "\n" not in message
    assert message.endswith("; train.wandb.mode=offline writes it under the output directory with no network, "
                            "for `wandb sync` later")


@pytest.mark.skipif("build_wandb_writer" not in inspect.getsource(engine_default),
                    reason="train.wandb is not wired into the trainer's PeriodicWriter yet")
def test_training_with_train_wandb_writes_the_run(tmp_path):
    out = tmp_path / "out"
    r = train_net(tiny(out, tmp_path / "cache", "train.train_iter=3", "train.evaluation.eval_period=2",
                       "train.wandb.enabled=True", "train.wandb.mode=offline"))
    assert r.returncode == 0, r.stderr[-3000:]
    history, config = read_offline_run(out)
    assert history == metrics_rows(out)
    assert config == yaml.safe_load(open(out / "config.yaml"))


@pytest.mark.slow
def test_a_resumed_training_continues_its_wandb_run(tmp_path):
    """--resume keeps the W&B run id: the second offline run holds the later iterations of the same run."""
    out = tmp_path / "out"
    args = tiny(out, tmp_path / "cache", "train.evaluation.enabled=False", "train.wandb.enabled=True")
    r = train_net([*args, "train.train_iter=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = train_net([*args, "train.train_iter=4", "--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(Path(out, "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    run_id = (out / "wandb" / "run_id").read_text().strip()
    assert [p.name.rsplit("-", 1)[-1] for p in runs] == [run_id, run_id]
    steps = []
    for run in runs:
        (log,) = run.glob("run-*.wandb")
        steps.append(sorted(r.history.step.num for r in wandb_records(log) if r.WhichOneof("record_type") == "history"))
    assert steps == [[1, 2], [3, 4]]
    # Training it again without --resume is refused, its W&B run untouched; where --resume finds no checkpoint
    # the run starts again from iteration 0 with a W&B run of its own.
    r = train_net([*args, "train.train_iter=1"])
    assert r.returncode == 1 and "already holds a run" in one_error_line(r)
    assert (out / "wandb" / "run_id").read_text().strip() == run_id
    (out / "last_checkpoint").unlink()
    r = train_net([*args, "train.train_iter=1", "--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "wandb" / "run_id").read_text().strip() != run_id
