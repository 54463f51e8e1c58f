"""tools/preprocess_data.py on text, compressed, Parquet, datasets and fairseq corpora: the same .bin/.idx
bytes as from the equivalent JSON lines; a missing optional reader is refused in one line."""
from __future__ import annotations

import gzip
import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.data.test_preprocess_data import GPT2_FLAGS, preprocess

DEMO = Path(__file__).resolve().parents[2] / "data_test"


def _documents(n: int = 40) -> list:
    """Demo documents without blank lines (so every format can hold them), one with non-ASCII text."""
    docs = []
    with open(DEMO / "corpus.jsonl", encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            lines = [x.rstrip() for x in text.split("\n") if x.strip()]
            if lines:
                docs.append("\n".join(lines))
            if len(docs) == n - 1:
                break
    return docs + ["naïve café — 日本語 text"]


def _run(tmp_path, input_path, name, *extra):
    prefix = tmp_path / name
    code = preprocess.main(["--input", str(input_path), "--output-prefix", str(prefix), *GPT2_FLAGS,
                            "--append-eod", "--workers", "1", *extra])
    assert code == 0
    key = extra[extra.index("--json-keys") + 1] if "--json-keys" in extra else "text"
    out = Path(f"{prefix}_{key}_document")
    return out.with_suffix(".bin").read_bytes(), out.with_suffix(".idx").read_bytes()


def _reference(tmp_path, texts, key="text"):
    path = tmp_path / "ref.jsonl"
    path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts), encoding="utf-8")
    return _run(tmp_path, path, "ref", "--json-keys", key)


def test_plain_text_one_document_per_line(tmp_path):
    texts = [d.replace("\n", " ") for d in _documents()]
    src = tmp_path / "corpus.txt"
    # Blank lines between documents are skipped, as blank JSON lines are.
    src.write_text("\n".join(texts[:5]) + "\n\n" + "\n".join(texts[5:]) + "\n", encoding="utf-8")
    assert _run(tmp_path, src, "txt") == _reference(tmp_path, texts)


def test_blank_line_separated_documents_fairseq_style(tmp_path):
    texts = _documents()
    src = tmp_path / "corpus.raw"
    src.write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    assert _run(tmp_path, src, "blank", "--text-docs", "blank-line") == _reference(tmp_path, texts)


def test_gzip_and_zstd_json_lines_and_text(tmp_path):
    texts = _documents()
    ref = _reference(tmp_path, texts)
    jsonl = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(jsonl))
    assert _run(tmp_path, tmp_path / "c.jsonl.gz", "gz") == ref
    zstd = pytest.importorskip("zstandard")
    (tmp_path / "c.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(jsonl))
    assert _run(tmp_path, tmp_path / "c.jsonl.zst", "zst") == ref
    lines = [t.replace("\n", " ") for t in texts]
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    assert _run(tmp_path, tmp_path / "c.txt.gz", "txtgz") == _reference(tmp_path, lines)


def test_parquet_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = _documents()
    table = pa.table({"id": list(range(len(texts))), "content": texts})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=7)
    assert _run(tmp_path, tmp_path / "c.parquet", "pq", "--json-keys", "content") == _reference(tmp_path, texts,
                                                                                                   "content")


def test_huggingface_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = _documents()
    folder = tmp_path / "hf"
    datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))}).save_to_disk(str(folder))
    assert _run(tmp_path, folder, "hf") == _reference(tmp_path, texts)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(str(tmp_path / "dd"))
    assert _run(tmp_path, tmp_path / "dd", "dd") == _reference(tmp_path, texts)


def _write_fairseq_data_bin(folder: Path, docs_as_symbols: list) -> None:
    """A data-bin laid out as fairseq-preprocess writes it (fairseq/data/indexed_dataset.py, mmap impl): dict.txt
    'symbol count' lines (ids from 4 after <s> <pad> </s> <unk>), each item's ids then </s> (2), int32 in
    train.bin, and train.idx = magic, version 1, dtype code, item count, int32 sizes, int64 byte pointers."""
    folder.mkdir()
    vocab = sorted({s for doc in docs_as_symbols for s in doc})
    ids = {s: i + 4 for i, s in enumerate(vocab)}
    (folder / "dict.txt").write_text("".join(f"{s} 1\n" for s in vocab), encoding="utf-8")
    items = [np.array([ids[s] for s in doc] + [2], dtype=np.int32) for doc in docs_as_symbols]
    (folder / "train.bin").write_bytes(b"".join(x.tobytes() for x in items))
    sizes = np.array([len(x) for x in items], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1]) * 4]).astype(np.int64)
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQ", 1, 4, len(items))
    (folder / "train.idx").write_bytes(header + sizes.tobytes() + pointers.tobytes())


def test_fairseq_data_bin_of_words_and_of_gpt2_ids(tmp_path):
    texts = [" ".join(d.split()) for d in _documents()]
    _write_fairseq_data_bin(tmp_path / "words", [t.split() for t in texts])
    assert _run(tmp_path, tmp_path / "words", "fsw") == _reference(tmp_path, texts)

    from libai_lite.tokenizer import GPT2Tokenizer

    tok = GPT2Tokenizer(DEMO / "gpt2/vocab.json", DEMO / "gpt2/merges.txt")
    # fairseq's GPT-2 data: dict.txt symbols are GPT-2 BPE ids.
    _write_fairseq_data_bin(tmp_path / "bpe", [[str(i) for i in tok.encode(t)] for t in _documents()])
    assert _run(tmp_path, tmp_path / "bpe", "fsb") == _reference(tmp_path, _documents())
    # Handed to training as it is, it reads in place: its dict.txt ids, one document per item (fairseq's line).
    from libai_lite.data.indexed_dataset import MMapIndexedDataset

    ds = MMapIndexedDataset(str(tmp_path / "bpe" / "train"))
    items = np.fromfile(tmp_path / "bpe" / "train.bin", dtype=np.int32)
    assert ds.num_documents == len(_documents()) and np.array_equal(np.concatenate([ds[i] for i in range(len(ds))]),
                                                                     items)
    assert all(ds.get_document(d)[-1] == 2 for d in range(ds.num_documents))  # each ends in </s>


def _fake_input(tmp_path: Path, module: str) -> Path:
    """An input only ``module`` would read (its magic bytes or folder layout): the refusal comes first."""
    if module == "datasets":
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "state.json").write_text("{}")
        return tmp_path / "hf"
    path = tmp_path / ("c.jsonl.zst" if module == "zstandard" else "c.parquet")
    path.write_bytes((b"\x28\xb5\x2f\xfd" if module == "zstandard" else b"PAR1") + b"\x00" * 8)
    return path


@pytest.mark.parametrize("module", ["zstandard", "pyarrow", "datasets"])
def test_missing_optional_reader_is_one_line_naming_the_install(tmp_path, monkeypatch, capsys, module):
    for name in list(sys.modules):
        if name == module or name.startswith(module + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError, as when not installed
    src = _fake_input(tmp_path, module)
    code = preprocess.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), *GPT2_FLAGS])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("error: ") and f"pip install {module}" in err[0], err
    assert not list(tmp_path.glob("o_*"))


def test_unknown_directory_and_non_json_text_are_refused(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    assert preprocess.main(["--input", str(tmp_path / "d"), "--output-prefix", str(tmp_path / "o"), *GPT2_FLAGS]) == 1
    assert "neither a Hugging Face datasets folder" in capsys.readouterr().err
    (tmp_path / "c.dat").write_text("just text\n")
    assert preprocess.main(["--input", str(tmp_path / "c.dat"), "--output-prefix", str(tmp_path / "o"),
                            *GPT2_FLAGS]) == 1
    assert "--text-docs line" in capsys.readouterr().err
