"""The tokenizer record beside a corpus: a run whose tokenizer is not the corpus's is refused before it trains."""
from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from libai_lite.data.build import check_data_tokenizer
from libai_lite.data.indexed_dataset import MMapIndexedDatasetBuilder
from libai_lite.data.tokenizer_record import make_record, record_path
from libai_lite.tokenizer import BertTokenizer, GPT2Tokenizer, SentencePieceTokenizer
from libai_lite.utils.errors import UsageError
from tests.launch import ROOT, kept_logger, tiny, train_net

DEMO = ROOT / "data_test"
GPT2_DATA, BERT_DATA, SPM_DATA = (str(DEMO / f"{n}/demo_{n}_text_document") for n in ("gpt2", "bert", "spm"))


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer(DEMO / "gpt2/vocab.json", DEMO / "gpt2/merges.txt")


def test_demo_corpora_carry_their_records(gpt2):
    for prefix in (GPT2_DATA, BERT_DATA, SPM_DATA):
        assert json.loads(open(record_path(prefix)).read())["tool"].endswith("preprocess_data.py")
    check_data_tokenizer(GPT2_DATA, gpt2)


def test_corpus_of_another_tokenizer_is_refused(gpt2):
    """BERT WordPiece ids under the GPT-2 tokenizer: both have 8,000 ids, so every id fits and nothing else notices."""
    assert np.fromfile(BERT_DATA + ".bin", np.uint16).max() < gpt2.vocab_size == 8000
    for data_prefix in (BERT_DATA, [0.5, GPT2_DATA, 0.5, BERT_DATA]):
        with pytest.raises(UsageError) as e:
            check_data_tokenizer(data_prefix, gpt2)
        message = str(e.value)
        assert "\n" not in message
        assert message.startswith(f"{BERT_DATA} was tokenized with BertWordPieceLowerCase (data_test/bert/vocab.txt")
        assert "this run's tokenizer is GPT2Tokenizer (" in message and str(DEMO / "gpt2/vocab.json") in message
        assert "preprocess the corpus with this tokenizer" in message and "set tokenization.tokenizer" in message


def test_extra_ids_and_the_end_of_document_id():
    """T5's BERT vocabulary with 100 sentinels reads the BERT corpus alike; mT5's SentencePiece style ends
    documents with eos, not the corpus's Megatron <EOD> (4002), unless dataloader.train.eod_token_id says 4002."""
    check_data_tokenizer(BERT_DATA, BertTokenizer(DEMO / "bert/vocab.txt", vocab_extra_ids=100))
    t5 = SentencePieceTokenizer(DEMO / "spm/spiece.model", extra_ids=100, style="t5")
    with pytest.raises(UsageError) as e:
        check_data_tokenizer(SPM_DATA, t5)
    assert "ends its documents with id 4002" in str(e.value) and "but this run's is 1" in str(e.value)
    assert "set dataloader.train.eod_token_id=4002" in str(e.value)
    check_data_tokenizer(SPM_DATA, t5, eod_token_id=4002)
    check_data_tokenizer(SPM_DATA, SentencePieceTokenizer(DEMO / "spm/spiece.model"))


def test_corpus_without_record_is_named_once_and_accepted(tmp_path, gpt2, caplog):
    """Megatron-LM's own outputs have no record: one log line names them, and training goes on."""
    prefixes = []
    for name in ("a", "b"):
        prefix = tmp_path / name
        for ext in (".bin", ".idx"):
            shutil.copy(GPT2_DATA + ext, str(prefix) + ext)
        prefixes.append(str(prefix))
    with kept_logger(), caplog.at_level(logging.INFO, logger="libai_lite"):
        logging.getLogger("libai_lite").propagate = True
        check_data_tokenizer([1, prefixes[0], 1, GPT2_DATA, 1, prefixes[1]], gpt2)
    # pytest 9 also hands its capture to loggers that did not propagate at the test's start: one record can be
    # captured twice here, so records are counted once each.
    records = {id(r): r for r in caplog.records}.values()
    lines = [r.getMessage() for r in records if "no tokenizer record" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"{prefixes[0]}, {prefixes[1]}: no tokenizer record"), lines


def test_unreadable_record_is_one_line(tmp_path, gpt2):
    prefix = tmp_path / "x"
    for ext in (".bin", ".idx"):
        shutil.copy(GPT2_DATA + ext, str(prefix) + ext)
    (tmp_path / "x.tokenizer.json").write_text("{not json")
    with pytest.raises(UsageError) as e:
        check_data_tokenizer(str(prefix), gpt2)
    assert "is not a readable tokenizer record" in str(e.value) and "\n" not in str(e.value)


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


def test_megatron_corpus_without_record_trains(shared_fixtures, tmp_path):
    """Megatron-LM's GPT-2 corpus with its tokenizer: one log line says it is unchecked, and it trains."""
    tok = shared_fixtures / "tokenizers" / "gpt2"
    prefix = shared_fixtures / "megatron" / "gpt2_mmap_text_document"
    out = tmp_path / "out"
    r = train_net(tiny(out, tmp_path / "cache", "train.train_iter=2", "train.evaluation.enabled=False",
                       f"dataloader.train.data_prefix={prefix}", f"tokenization.tokenizer.vocab_file={tok / 'vocab.json'}",
                       f"tokenization.tokenizer.merges_file={tok / 'merges.txt'}"))
    assert r.returncode == 0, r.stderr[-3000:]
    log = (out / "log.txt").read_text()
    assert log.count("no tokenizer record") == 1 and f"{prefix}: no tokenizer record" in log
