"""tools/preprocess_data.py: byte-identical to Megatron-LM, bad input handled, demo data consistent."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from libai_lite.data.indexed_dataset import MMapIndexedDataset
from libai_lite.tokenizer import GPT2Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO = REPO_ROOT / "data_test"


def _load_tool():
    name = "libai_lite_tools_preprocess_data"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tools/preprocess_data.py")
        module = importlib.util.module_from_spec(spec)
        # Worker processes unpickle references to the module's functions by this name.
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


preprocess = _load_tool()

GPT2_FLAGS = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", str(DEMO / "gpt2/vocab.json"),
    "--merge-file", str(DEMO / "gpt2/merges.txt"),
]


def _fixture_flags(fx: Path, name: str):
    tok = fx / "tokenizers"
    if name == "gpt2":
        return [
            "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(tok / "gpt2/vocab.json"),
            "--merge-file", str(tok / "gpt2/merges.txt"),
            "--append-eod",
        ]
    if name == "bert":
        return ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(tok / "bert/vocab.txt")]
    return [
        "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", str(tok / "spm/spiece.model"),
        "--append-eod",
    ]


@pytest.mark.parametrize("name,workers", [("gpt2", 2), ("bert", 1), ("spm", 2)])
def test_byte_identical_to_megatron(shared_fixtures, tmp_path, name, workers):
    prefix = tmp_path / f"{name}_mmap"
    argv = [
        "--input", str(shared_fixtures / "corpus.jsonl"),
        "--json-keys", "text",
        "--output-prefix", str(prefix),
        "--dataset-impl", "mmap",
        "--workers", str(workers),
    ] + _fixture_flags(shared_fixtures, name)
    assert preprocess.main(argv) == 0
    for ext in ("bin", "idx"):
        ours = (tmp_path / f"{name}_mmap_text_document.{ext}").read_bytes()
        megatron = (shared_fixtures / f"megatron/{name}_mmap_text_document.{ext}").read_bytes()
        assert ours == megatron, f"{name} .{ext} differs from Megatron-LM's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"{name}_mmap_text_document.bin",
        f"{name}_mmap_text_document.idx",
        f"{name}_mmap_text_document.tokenizer.json",
    ]


def _write_jsonl(path: Path, rows) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return path


def test_documents_sentences_and_keys(tmp_path):
    """Empty texts become empty documents, lists become one sequence per sentence (Megatron's rules)."""
    src = _write_jsonl(
        tmp_path / "in.jsonl",
        [
            {"text": "First document.", "title": "One"},
            {"text": "", "title": "Two"},
            "",  # blank line: skipped
            {"text": ["Sentence one.", "", "Sentence two."], "title": "Three"},
        ],
    )
    out = tmp_path / "out" / "demo"
    argv = ["--input", str(src), "--output-prefix", str(out), "--json-keys", "text", "title", "--append-eod"]
    assert preprocess.main(argv + GPT2_FLAGS) == 0
    tok = GPT2Tokenizer(DEMO / "gpt2/vocab.json", DEMO / "gpt2/merges.txt")
    eod = tok.eod_id

    ds = MMapIndexedDataset(str(out) + "_text_document")
    assert ds.doc_idx.tolist() == [0, 1, 1, 3]
    assert ds[0].tolist() == tok.encode("First document.") + [eod]
    assert ds[1].tolist() == tok.encode("Sentence one.")
    assert ds[2].tolist() == tok.encode("Sentence two.") + [eod]

    titles = MMapIndexedDataset(str(out) + "_title_document")
    assert titles.doc_idx.tolist() == [0, 1, 2, 3]
    assert [titles[i].tolist() for i in range(3)] == [tok.encode(t) + [eod] for t in ("One", "Two", "Three")]


def _assert_failed_cleanly(capsys, rc, out_dir: Path, *needles):
    err = capsys.readouterr().err.strip()
    assert rc == 1
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    assert not out_dir.exists() or not any(out_dir.iterdir()), list(out_dir.iterdir())


def test_missing_input(tmp_path, capsys):
    out = tmp_path / "out"
    rc = preprocess.main(["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(out / "x")] + GPT2_FLAGS)
    _assert_failed_cleanly(capsys, rc, out, "missing.jsonl", "--input")
    assert not out.exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_malformed_json_line(tmp_path, capsys, workers):
    rows = [{"text": f"document number {i}"} for i in range(600)]
    rows[420] = '{"text": "unterminated'
    src = _write_jsonl(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "out"
    argv = ["--input", str(src), "--output-prefix", str(out / "x"), "--workers", str(workers)]
    rc = preprocess.main(argv + GPT2_FLAGS)
    _assert_failed_cleanly(capsys, rc, out, "bad.jsonl line 421", "not valid JSON")
    assert not out.exists()


def test_missing_key(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}, {"body": "no text key"}])
    out = tmp_path / "out"
    rc = preprocess.main(["--input", str(src), "--output-prefix", str(out / "x")] + GPT2_FLAGS)
    _assert_failed_cleanly(capsys, rc, out, "line 2", "'text'", "--json-keys")


@pytest.mark.parametrize("row, needle", [({"text": 123}, "key 'text' holds a number"),
                                         ({"text": None}, "key 'text' holds null"),
                                         ({"text": ["a", 7]}, "key 'text' holds a list with a number in it"),
                                         ([1, 2], "line 2 holds a list with a number in it, not an object")])
def test_a_text_that_is_not_a_string_is_named_by_its_json_kind(tmp_path, capsys, row, needle):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}, row])
    out = tmp_path / "out"
    rc = preprocess.main(["--input", str(src), "--output-prefix", str(out / "x")] + GPT2_FLAGS)
    _assert_failed_cleanly(capsys, rc, out, "in.jsonl line 2", needle)


@pytest.mark.parametrize("damage", ["truncated", "not gzip inside"])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_damaged_gzip_corpus_is_one_line_and_leaves_nothing(tmp_path, capsys, damage, workers):
    """A download cut short (EOFError) or a file that is gzip by its magic only (BadGzipFile) was a traceback."""
    import gzip

    data = gzip.compress(b"".join(b'{"text": "document %d is here"}\n' % i for i in range(5000)))
    data = data[: len(data) // 2] if damage == "truncated" else data[:2] + bytes(range(256)) * 2
    src = tmp_path / "corpus.jsonl.gz"
    src.write_bytes(data)
    out = tmp_path / "out"
    rc = preprocess.main(["--input", str(src), "--output-prefix", str(out / "x"), "--workers", str(workers)]
                         + GPT2_FLAGS)
    _assert_failed_cleanly(capsys, rc, out, "corpus.jsonl.gz is a damaged gzip file", "compress it again")
    assert not out.exists()


def test_missing_tokenizer_file(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}])
    out = tmp_path / "out"
    argv = [
        "--input", str(src), "--output-prefix", str(out / "x"),
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "gone.model"),
    ]
    rc = preprocess.main(argv)
    _assert_failed_cleanly(capsys, rc, out, "gone.model", "--tokenizer-model")


def test_tokenizer_record_beside_the_outputs(tmp_path):
    """Each key's .bin/.idx gets PREFIX.tokenizer.json naming the tokenizer; a rewrite of the prefix replaces it."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "One.", "title": "A"}, {"text": "Two.", "title": "B"}])
    out = tmp_path / "out" / "x"
    argv = ["--input", str(src), "--output-prefix", str(out), "--json-keys", "text", "title", "--append-eod"]
    assert preprocess.main(argv + GPT2_FLAGS) == 0
    tok = GPT2Tokenizer(DEMO / "gpt2/vocab.json", DEMO / "gpt2/merges.txt")
    for key in ("text", "title"):
        record = json.loads((tmp_path / "out" / f"x_{key}_document.tokenizer.json").read_text())
        assert record["tokenizer_type"] == "GPT2BPETokenizer" and record["class"] == "GPT2Tokenizer"
        assert record["vocab_fingerprint"] == tok.vocab_fingerprint() and record["vocab_size"] == 8000
        assert record["eod_id"] == tok.eod_id and record["append_eod"] is True
        assert record["files"] == {"vocab_file": GPT2_FLAGS[3], "merges_file": GPT2_FLAGS[5]}
        assert "preprocess_data.py" in record["tool"]
    bert = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(DEMO / "bert/vocab.txt")]
    assert preprocess.main(argv[:-1] + bert) == 0
    record = json.loads((tmp_path / "out" / "x_text_document.tokenizer.json").read_text())
    assert record["tokenizer_type"] == "BertWordPieceLowerCase" and record["append_eod"] is False
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        f"x_{k}_document.{e}" for k in ("text", "title") for e in ("bin", "idx", "tokenizer.json"))


@pytest.mark.parametrize("workers", [1, 2])
def test_corpus_of_empty_texts_is_refused(tmp_path, capsys, workers):
    """Megatron writes a 0-token .bin for it and exits 0; the training that reads it fails far later."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "", "title": "A title"}] * 300)
    out = tmp_path / "out"
    argv = ["--input", str(src), "--output-prefix", str(out / "x"), "--workers", str(workers), "--append-eod"]
    rc = preprocess.main(argv + GPT2_FLAGS)
    _assert_failed_cleanly(capsys, rc, out, "no documents with tokens in", str(src), "'text'", "--json-keys")
    assert not out.exists()
    # One key with text beside one without: still refused, naming the empty one.
    rc = preprocess.main(argv + ["--json-keys", "title", "text"] + GPT2_FLAGS)
    _assert_failed_cleanly(capsys, rc, out, "'text'", "--json-keys")
    assert not out.exists()


@pytest.mark.parametrize("content", ["", "#version: 0.2\n"])
def test_merges_file_without_merges_is_refused(tmp_path, capsys, content):
    merges = tmp_path / "merges.txt"
    merges.write_text(content)
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}])
    out = tmp_path / "out"
    argv = ["--input", str(src), "--output-prefix", str(out / "x"), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(DEMO / "gpt2/vocab.json"), "--merge-file", str(merges)]
    _assert_failed_cleanly(capsys, preprocess.main(argv), out, str(merges), "holds no merges")
    assert not out.exists()


def test_interrupted_run_leaves_nothing(tmp_path, monkeypatch, capsys):
    import libai_lite.data.corpus_readers as readers

    # JSON lines are read in blocks of CHUNK_BYTES: small blocks make several chunks of a small file.
    monkeypatch.setattr(readers, "CHUNK_BYTES", 256)
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": f"doc {i}"} for i in range(3 * preprocess.CHUNK_LINES)])
    real, calls = preprocess.encode_chunk, []

    def interrupted(task):
        calls.append(task[0])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr(preprocess, "encode_chunk", interrupted)
    out = tmp_path / "out"
    rc = preprocess.main(["--input", str(src), "--output-prefix", str(out / "x"), "--workers", "1"] + GPT2_FLAGS)
    assert rc == 130
    assert "interrupted" in capsys.readouterr().err
    assert not out.exists()


def test_script_runs_from_repo_root(tmp_path):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "Run as a script."}])
    out = tmp_path / "x"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", str(src), "--output-prefix", str(out), "--append-eod"]
        + GPT2_FLAGS,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "docs/s" in proc.stdout and "MB/s" in proc.stdout and "tokens/s" in proc.stdout
    assert MMapIndexedDataset.exists(str(out) + "_text_document")


@pytest.mark.parametrize(
    "name,flags",
    [
        ("gpt2", GPT2_FLAGS + ["--append-eod"]),
        ("bert", ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(DEMO / "bert/vocab.txt")]),
        (
            "spm",
            ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(DEMO / "spm/spiece.model"),
             "--append-eod"],
        ),
    ],
)
def test_demo_data_is_current(tmp_path, name, flags):
    """The committed data_test/ datasets are what the committed corpus and tokenizers give."""
    argv = ["--input", str(DEMO / "corpus.jsonl"), "--output-prefix", str(tmp_path / "d"), "--workers", "2"]
    assert preprocess.main(argv + flags) == 0
    for ext in ("bin", "idx"):
        ours = (tmp_path / f"d_text_document.{ext}").read_bytes()
        committed = (DEMO / f"{name}/demo_{name}_text_document.{ext}").read_bytes()
        assert ours == committed, f"data_test/{name} is stale: run python tools/make_demo_data.py"
    ds = MMapIndexedDataset(str(DEMO / f"{name}/demo_{name}_text_document"))
    assert ds.dtype == np.uint16 and len(ds) > 3000
    # The committed tokenizer record says what the tool says (the paths it names are as each run gave them).
    ours = json.loads((tmp_path / "d_text_document.tokenizer.json").read_text())
    committed = json.loads((DEMO / f"{name}/demo_{name}_text_document.tokenizer.json").read_text())
    same = ("tokenizer_type", "class", "vocab_fingerprint", "vocab_size", "eod_id", "append_eod")
    assert {k: ours[k] for k in same} == {k: committed[k] for k in same}, \
        f"data_test/{name} has a stale tokenizer record: run python tools/make_demo_data.py --datasets-only"
    assert all(os.path.isfile(REPO_ROOT / f) for f in committed["files"].values()), committed["files"]


@pytest.mark.parametrize("style,workers", [("llama3", 2), ("qwen2", 1)])
def test_hugging_face_tokenizer(tmp_path, style, workers):
    """Megatron's HuggingFaceTokenizer ids: transformers' encoding with its template (BOS or not), then the eos."""
    transformers = pytest.importorskip("transformers")
    from tests.tokenizer.test_tokenizer import write_hf_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    write_hf_tokenizer(model, style)
    texts = ["First document, café 東京 🙂.", "A <|eot_id|> and <|im_end|> inside.", "", "Third\n\nline."]
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    out = tmp_path / "out" / "hf"
    argv = [
        "--input", str(src), "--output-prefix", str(out), "--workers", str(workers), "--append-eod",
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(model),
    ]
    assert preprocess.main(argv) == 0
    hf = transformers.AutoTokenizer.from_pretrained(str(model))
    ds = MMapIndexedDataset(str(out) + "_text_document")
    # The empty text is [BOS, eos] under Llama's template and, as in Megatron, an empty document under Qwen2's.
    expected = [hf(t).input_ids + [hf.eos_token_id] for t in texts if hf(t).input_ids]
    assert len(expected) == (4 if style == "llama3" else 3)
    assert ds.dtype == np.uint16 and [ds[i].tolist() for i in range(len(ds))] == expected
    assert len(ds.doc_idx) == len(texts) + 1
    assert (ds[0][0] == hf.bos_token_id) == (style == "llama3")


def test_hugging_face_tokenizer_missing(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}])
    out = tmp_path / "out"
    argv = [
        "--input", str(src), "--output-prefix", str(out / "x"),
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path),
    ]
    rc = preprocess.main(argv)
    _assert_failed_cleanly(capsys, rc, out, str(tmp_path / "tokenizer.json"), "--tokenizer-model")


def _lines_in(path: Path, rows: list) -> Path:
    path.write_bytes(b"".join(r + b"\n" for r in rows))
    return path


def test_block_parse_matches_line_by_line_parse():
    """A block of lines is scanned in one pass; each line's value is json.loads's, and a line the scanner
    does not take whole (blank, two values, trailing junk, an object spread over lines, a BOM) is left to
    the per-line parse."""
    from libai_lite.data.corpus_encoding import _MISS, _scan_block

    rows = [b'{"text": "a"}', b"", b'  {"text": "lead"}', b'{"text": "b"}, {"text": "c"}', b'{"text": "d"} ',
            b'{"text": "e"} x', b'{"text": "f",', b'"g": 1}', b'\xef\xbb\xbf{"text": "bom"}', b'{"text": "h"}\r',
            b'{"text": "\\u00e9\\n"}', b"null"]
    values = _scan_block(b"\n".join(rows) + b"\n")
    assert len(values) == len(rows)
    expected = [{"text": "a"}, _MISS, _MISS, _MISS, {"text": "d"}, _MISS, _MISS, _MISS, _MISS, {"text": "h"},
                {"text": "é\n"}, None]
    assert values == expected


@pytest.mark.parametrize("workers", [1, 2])
def test_a_bad_line_in_the_middle_of_a_block_is_named(tmp_path, capsys, workers):
    rows = [json.dumps({"text": f"fine {i}"}).encode() for i in range(500)]
    rows[321] = b'{"text": "two"}, {"text": "objects"}'
    src = _lines_in(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    rc = preprocess.main(["--input", str(src), "--output-prefix", str(out / "x"), "--workers", str(workers)]
                         + GPT2_FLAGS)
    _assert_failed_cleanly(capsys, rc, out, "line 322 is not valid JSON", "Extra data")


def test_block_parse_writes_what_line_parse_writes(tmp_path):
    """Blank lines, spaces around objects and CRLF ends take the per-line path; the output is the same."""
    rows = [json.dumps({"text": f"doc {i} here"}).encode() for i in range(50)]
    odd = list(rows)
    odd[3], odd[10], odd[20] = b"  " + odd[3], odd[10] + b"\r", b""
    outs = []
    for name, data in (("plain", rows[:20] + rows[21:]), ("odd", odd[:20] + [b""] + odd[21:])):
        src = _lines_in(tmp_path / f"{name}.jsonl", data)
        assert preprocess.main(["--input", str(src), "--output-prefix", str(tmp_path / name)] + GPT2_FLAGS) == 0
        outs.append([(tmp_path / f"{name}_text_document{ext}").read_bytes() for ext in (".bin", ".idx")])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_lone_surrogate_is_one_error_line(tmp_path, capsys, workers):
    """A JSON escape of half a surrogate pair is not Unicode text: one line naming the file and line, no output
    (a whole pair, "\\ud83d\\ude00", is an emoji and fine)."""
    rows = [b'{"text": "ok \\ud83d\\ude00"}', b'{"text": "fine"}', b'{"text": "bad \\ud800 half"}']
    src = _lines_in(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    rc = preprocess.main(["--input", str(src), "--output-prefix", str(out / "x"), "--workers", str(workers)]
                         + GPT2_FLAGS)
    _assert_failed_cleanly(capsys, rc, out, "in.jsonl line 3", "lone surrogate")
