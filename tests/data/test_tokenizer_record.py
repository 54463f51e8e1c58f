"""The tokenizer record beside a corpus: a run whose tokenizer is not the corpus's is refused before it trains."""
from __future__ import annotations

import json

import numpy as np
import pytest

from libai_lite.data.indexed_dataset import MMapIndexedDatasetBuilder
from libai_lite.data.tokenizer_record import make_record, record_path
from libai_lite.tokenizer import GPT2Tokenizer
from tests.launch import ROOT

DEMO = ROOT / "data_test"
GPT2_DATA, BERT_DATA, SPM_DATA = (str(DEMO / f"{n}/demo_{n}_text_document") for n in ("gpt2", "bert", "spm"))


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer(DEMO / "gpt2/vocab.json", DEMO / "gpt2/merges.txt")


def test_demo_corpora_carry_their_records(gpt2):
    for prefix in (GPT2_DATA, BERT_DATA, SPM_DATA):
        assert json.loads(open(record_path(prefix)).read())["tool"].endswith("preprocess_data.py")


def test_builder_never_leaves_a_record_beside_data_it_does_not_describe(tmp_path, gpt2):
    """A prefix written again loses its old record (the new one comes last); an aborted write leaves none."""
    prefix = str(tmp_path / "p")
    first = MMapIndexedDatasetBuilder(prefix, record=make_record(gpt2, "GPT2BPETokenizer", True, "test"))
    first.add_item([1, 2, 0])
    first.end_document()
    first.finalize()
    assert json.loads(open(record_path(prefix)).read())["vocab_fingerprint"] == gpt2.vocab_fingerprint()
    second = MMapIndexedDatasetBuilder(prefix, np.int32)  # another tool, writing no record
    second.add_item([5, 6])
    second.end_document()
    second.finalize()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.bin", "p.idx"]
    aborted = MMapIndexedDatasetBuilder(prefix, record=make_record(gpt2, "GPT2BPETokenizer", True, "test"))
    aborted.add_item([1])
    aborted.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.bin", "p.idx"]
