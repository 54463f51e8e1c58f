"""tools/preprocess_data.py under contention and a full disk: never a success without its files."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

from libai_lite.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from tests.data.test_preprocess_data import DEMO, GPT2_FLAGS, REPO_ROOT, _write_jsonl, preprocess


def test_two_builders_on_one_prefix_keep_their_own_temporaries(tmp_path):
    """Both writers finish and the prefix holds one complete dataset (with shared temporary names the
    second writer truncated the first one's file and then found its own renamed away)."""
    prefix = str(tmp_path / "shared")
    first, second = MMapIndexedDatasetBuilder(prefix), MMapIndexedDatasetBuilder(prefix)
    assert first._bin_tmp != second._bin_tmp and first._idx_tmp != second._idx_tmp
    for builder in (first, second):
        builder.add_doc(np.arange(10), [4, 6])
        builder.add_item([7, 8, 9])
        builder.end_document()
    first.finalize()
    second.finalize()
    ds = MMapIndexedDataset(prefix)
    assert ds.doc_idx.tolist() == [0, 2, 3] and ds[2].tolist() == [7, 8, 9]
    assert sorted(os.listdir(tmp_path)) == ["shared.bin", "shared.idx"]


def test_two_concurrent_runs_on_one_prefix(tmp_path):
    """Two processes writing one prefix at once both succeed and leave the one right dataset."""
    with open(DEMO / "corpus.jsonl", "rb") as f:
        lines = f.readlines()[:800]
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(lines))
    assert preprocess.main(["--input", str(src), "--output-prefix", str(tmp_path / "alone"), "--append-eod"]
                           + GPT2_FLAGS) == 0
    prefix = tmp_path / "out" / "both"
    cmd = [sys.executable, "tools/preprocess_data.py", "--input", str(src),
           "--output-prefix", str(prefix), "--append-eod", "--workers", "1"] + GPT2_FLAGS
    procs = [subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    for rc, out, err in results:
        assert rc == 0 and "wrote" in out, err
    assert sorted(os.listdir(prefix.parent)) == ["both_text_document.bin", "both_text_document.idx",
                                                 "both_text_document.tokenizer.json"]
    for ext in ("bin", "idx", "tokenizer.json"):
        got = (prefix.parent / f"both_text_document.{ext}").read_bytes()
        assert got == (tmp_path / f"alone_text_document.{ext}").read_bytes()


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 256 kB tmpfs (needs root and mount permission; skipped otherwise), unmounted afterwards."""
    mnt = tmp_path / f"tmpfs_{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e})")
    if proc.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {proc.stderr.strip() or proc.returncode}")
    try:
        yield mnt
    finally:
        # Busy means a process still holds a file there: the test fails on that below, but the
        # mount must not outlive the test either way.
        busy = subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode != 0
        if busy:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)
    assert not busy, "a process of the failed run still holds files on the full disk"


@pytest.mark.parametrize("workers", [1, 2])
def test_full_disk_is_one_error_line_and_leaves_nothing(tiny_tmpfs, tmp_path, capsys, workers):
    # ~1.8 MB of text is ~0.9 MB of uint16 tokens: four times the disk.
    out = tiny_tmpfs / "new" / "deeper"
    argv = ["--input", str(DEMO / "corpus.jsonl"), "--output-prefix", str(out / "x"), "--append-eod",
            "--workers", str(workers)] + GPT2_FLAGS
    rc = preprocess.main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 1
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "No space left on device" in err and "--output-prefix" in err, err
    # Temporaries removed and the folders the run made gone: the disk is as it was.
    assert os.listdir(tiny_tmpfs) == []


def test_full_disk_while_writing_the_index(tiny_tmpfs, capsys):
    """The .bin fits, the .idx does not: still one line, nothing left, no old file touched."""
    keep = tiny_tmpfs / "keep.txt"
    keep.write_text("untouched")
    # Many tiny documents: a small .bin and an index of 12 bytes per sentence plus 8 per document.
    rows = [{"text": "a"} for _ in range(9000)]
    src = _write_jsonl(tiny_tmpfs.parent / "many.jsonl", rows)
    fill = tiny_tmpfs / "fill"
    with open(fill, "wb") as f:  # leave ~100 kB free: enough for the .bin (18 kB), not the .idx (~180 kB)
        f.write(b"\0" * (150 * 1024))
    rc = preprocess.main(["--input", str(src), "--output-prefix", str(tiny_tmpfs / "x"), "--workers", "1"]
                         + GPT2_FLAGS)
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "No space left on device" in err, err
    assert sorted(os.listdir(tiny_tmpfs)) == ["fill", "keep.txt"]
    assert keep.read_text() == "untouched"
