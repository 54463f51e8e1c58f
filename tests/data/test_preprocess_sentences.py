"""tools/preprocess_data.py --split-sentences / --keep-newlines, and GPT samples from sentence corpora.

nltk is an optional extra and its punkt model is never downloaded here, so the tests write a tiny
punkt_tab model of their own (two abbreviations) and point nltk at it: the splitting is nltk's own.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from libai_lite.data import GPTDataset
from libai_lite.data.indexed_dataset import MMapIndexedDataset
from libai_lite.tokenizer import GPT2Tokenizer
from tests.data.test_preprocess_data import DEMO, GPT2_FLAGS, _assert_failed_cleanly, _write_jsonl, preprocess

DOCS = [
    "Dr. Smith went to Washington. He arrived on time! Did he stay?",
    "One sentence only",
    "",
    "First line.\nSecond line.\n\nThird paragraph, Mr. Jones said.",
]


@pytest.fixture
def punkt(tmp_path, monkeypatch):
    """nltk reading a hand-made english punkt_tab model (abbreviations dr and mr) and nothing else."""
    nltk = pytest.importorskip("nltk", reason="nltk is the optional 'sentences' extra")
    from nltk.tokenize import punkt as punkt_module

    if not hasattr(punkt_module, "PunktTokenizer"):
        pytest.skip("this nltk predates punkt_tab (nltk < 3.8.2)")
    model = tmp_path / "nltk_data" / "tokenizers" / "punkt_tab" / "english"
    model.mkdir(parents=True)
    (model / "abbrev_types.txt").write_text("dr\nmr\n")
    for name in ("collocations.tab", "sent_starters.txt", "ortho_context.tab"):
        (model / name).write_text("")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "nltk_data")])
    return punkt_module


def _tok():
    return GPT2Tokenizer(DEMO / "gpt2/vocab.json", DEMO / "gpt2/merges.txt")


@pytest.mark.parametrize("workers", [1, 2])
def test_split_sentences_writes_one_sequence_per_sentence(punkt, tmp_path, workers):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in DOCS])
    out = tmp_path / "out" / "ss"
    argv = ["--input", str(src), "--output-prefix", str(out), "--split-sentences", "--append-eod",
            "--workers", str(workers)]
    assert preprocess.main(argv + GPT2_FLAGS) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "ss_text_sentence.bin", "ss_text_sentence.idx", "ss_text_sentence.tokenizer.json"]
    splitter = punkt.PunktTokenizer("english")
    sentences = [splitter.tokenize(d) for d in DOCS]
    # The abbreviation model is in use: "Dr." and "Mr." end no sentence.
    assert sentences[0] == ["Dr. Smith went to Washington.", "He arrived on time!", "Did he stay?"]
    assert sentences[3] == ["First line.", "Second line.", "Third paragraph, Mr. Jones said."]
    tok, ds = _tok(), MMapIndexedDataset(str(out) + "_text_sentence")
    expected = []
    for doc in sentences:
        ids = [tok.encode(s) for s in doc if tok.encode(s)]
        if ids:
            ids[-1] = ids[-1] + [tok.eod_id]
        expected.append(ids)
    assert [ds[i].tolist() for i in range(len(ds))] == [s for doc in expected for s in doc]
    assert ds.doc_idx.tolist() == [0, 3, 4, 4, 7]  # the empty text is an empty document


def test_keep_newlines_keeps_the_text(punkt, tmp_path):
    """With --keep-newlines every sentence keeps the whitespace after it: the text is their concatenation."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in DOCS])
    out = tmp_path / "kn"
    assert preprocess.main(["--input", str(src), "--output-prefix", str(out), "--split-sentences",
                            "--keep-newlines"] + GPT2_FLAGS) == 0
    tok, ds = _tok(), MMapIndexedDataset(str(out) + "_text_sentence")
    texts = [tok.decode(ds[i].tolist()) for i in range(len(ds))]
    assert texts[4:7] == ["First line.\n", "Second line.\n\n", "Third paragraph, Mr. Jones said."]
    docs = ["".join(texts[a:b]) for a, b in zip(ds.doc_idx[:-1], ds.doc_idx[1:])]
    assert docs == DOCS


def test_sentence_corpus_gives_the_same_gpt_samples(punkt, tmp_path):
    """A document's sentences are read back to back, so where splitting changes no token (sentences
    separated by newlines, kept) the GPT samples equal those of the unsplit corpus. Where sentences
    are separated by a space, GPT-2 BPE gives " He" unsplit but "He" after a split, as in Megatron."""
    rng = np.random.RandomState(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    docs = ["\n".join(" ".join(rng.choice(words, rng.randint(2, 8))).capitalize() + "."
                      for _ in range(rng.randint(1, 6))) for _ in range(30)]
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs])
    common = ["--input", str(src), "--append-eod"] + GPT2_FLAGS
    assert preprocess.main(common + ["--output-prefix", str(tmp_path / "doc")]) == 0
    assert preprocess.main(common + ["--output-prefix", str(tmp_path / "sent"), "--split-sentences",
                                     "--keep-newlines"]) == 0
    whole, split = (MMapIndexedDataset(str(tmp_path / p)) for p in ("doc_text_document", "sent_text_sentence"))
    assert len(split) > len(whole) == whole.num_documents == split.num_documents == len(docs)

    def samples(ds, prefix):
        gpt = GPTDataset("train", ds, np.arange(ds.num_documents), 40, 16, 1234, str(tmp_path / prefix),
                         cache_dir=str(tmp_path / f"cache_{prefix}"))
        return [gpt[i]["input_ids"].tolist() for i in range(len(gpt))]

    assert samples(split, "sent") == samples(whole, "doc")


def test_keep_newlines_needs_split_sentences(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "x"}])
    with pytest.raises(SystemExit):
        preprocess.main(["--input", str(src), "--output-prefix", str(tmp_path / "x"), "--keep-newlines"]
                        + GPT2_FLAGS)
    assert "--keep-newlines only applies with --split-sentences" in capsys.readouterr().err


def test_refused_without_nltk(tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "nltk" or m.startswith("nltk.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nltk", None)  # import nltk now raises ImportError
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "One. Two."}])
    out = tmp_path / "out"
    rc = preprocess.main(["--input", str(src), "--output-prefix", str(out / "x"), "--split-sentences"] + GPT2_FLAGS)
    _assert_failed_cleanly(capsys, rc, out, "needs nltk", "pip install 'libai_lite[sentences]'")
    assert not out.exists()


def test_refused_without_the_punkt_model(tmp_path, capsys, monkeypatch):
    nltk = pytest.importorskip("nltk", reason="nltk is the optional 'sentences' extra")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "empty")])
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": "One. Two."}])
    out = tmp_path / "out"
    rc = preprocess.main(["--input", str(src), "--output-prefix", str(out / "x"), "--split-sentences"] + GPT2_FLAGS)
    _assert_failed_cleanly(capsys, rc, out, "punkt", "python -m nltk.downloader", "--lang english")
    assert not out.exists()


def test_t5_dataset_reads_a_sentence_corpus(punkt, tmp_path):
    """The T5 dataset (span corruption over the token stream of whole documents, not Megatron's
    sentence-pair sampler) reads a sentence corpus's documents as their sentences back to back:
    with WordPiece, which drops the spaces between sentences, its samples equal the unsplit corpus's."""
    from libai_lite.tokenizer import BertTokenizer
    from projects.MT5.data.t5_dataset import build_t5_train_valid_test_datasets

    rng = np.random.RandomState(1)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "home"]
    docs = [" ".join(" ".join(rng.choice(words, rng.randint(3, 9))).capitalize() + rng.choice([".", "!", "?"])
                     for _ in range(rng.randint(1, 5))) for _ in range(40)]
    src = _write_jsonl(tmp_path / "in.jsonl", [{"text": d} for d in docs])
    vocab = str(DEMO / "bert/vocab.txt")
    common = ["--input", str(src), "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab,
              "--vocab-extra-ids", "100"]
    assert preprocess.main(common + ["--output-prefix", str(tmp_path / "doc")]) == 0
    assert preprocess.main(common + ["--output-prefix", str(tmp_path / "sent"), "--split-sentences"]) == 0
    split = MMapIndexedDataset(str(tmp_path / "sent_text_sentence"))
    assert len(split) > split.num_documents == len(docs)
    tok = BertTokenizer(vocab, vocab_extra_ids=100)

    def samples(prefix):
        train, _, _ = build_t5_train_valid_test_datasets(
            str(tmp_path / prefix), tok, "1,0,0", (20, 0, 0), max_seq_length=32, seed=7,
            cache_dir=str(tmp_path / f"cache_{prefix}"))
        return [{k: v.tolist() for k, v in train[i].items()} for i in range(len(train))]

    assert samples("sent_text_sentence") == samples("doc_text_document")
