"""T5/mT5 span-corruption data: span statistics, exact reconstruction, padding, determinism,
resume, both vocabularies (BERT WordPiece + sentinels, SentencePiece mT5 style), the config and
the errors users can fix."""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import open_dict

from libai_lite.config import LazyCall, LazyConfig
from libai_lite.data import IGNORE_INDEX, MMapIndexedDatasetBuilder
from projects.MT5.data.t5_dataset import (
    T5Dataset,
    build_t5_train_valid_test_datasets,
    build_t5_train_valid_test_loaders,
    random_spans_helper,
    random_spans_noise_mask,
    t5_train_samples_per_epoch,
)
from libai_lite.tokenizer import BertTokenizer, GPT2Tokenizer, SentencePieceTokenizer
from libai_lite.utils.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
BERT_VOCAB = str(REPO / "data_test" / "bert" / "vocab.txt")
BERT_DATA = str(REPO / "data_test" / "bert" / "demo_bert_text_document")
SPM_MODEL = str(REPO / "data_test" / "spm" / "spiece.model")
SPM_DATA = str(REPO / "data_test" / "spm" / "demo_spm_text_document")
MEGATRON_SPM_EOD = 4002  # <EOD> of data_test/spm (Megatron-style preprocessing)


# ----------------------------------------------------------------------------------------------
# fixtures and helpers
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bert_tok():
    return BertTokenizer(BERT_VOCAB, vocab_extra_ids=100)


@pytest.fixture(scope="module")
def spm_tok():
    return SentencePieceTokenizer(SPM_MODEL, extra_ids=100, style="t5")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("t5_cache"))


@pytest.fixture(scope="module")
def bert_train(bert_tok, cache):
    train, _, _ = build_t5_train_valid_test_datasets(BERT_DATA, bert_tok, "949,50,1", (600, 0, 0),
                                                     cache_dir=cache, vocab_size=bert_tok.vocab_size)
    return train


@pytest.fixture(scope="module")
def spm_train(spm_tok, cache):
    train, _, _ = build_t5_train_valid_test_datasets(SPM_DATA, spm_tok, "949,50,1", (300, 0, 0), cache_dir=cache,
                                                     eod_token_id=MEGATRON_SPM_EOD, vocab_size=spm_tok.vocab_size)
    return train


def decompose(sample, sentinel_ids, eos):
    """Split a sample back into (encoder body, label spans) and check its structure on the way.

    Checks: EOS ends the encoder input and the labels; the encoder's sentinels are
    <extra_id_0>, <extra_id_1>, ... in order, and so are the labels'; labels start with
    <extra_id_0>; every span is non-empty.
    """
    enc_len = int(sample["encoder_attn_mask"].sum())
    enc = sample["encoder_input_ids"][:enc_len].numpy()
    labels = sample["labels"].numpy()
    labels = labels[labels != IGNORE_INDEX]
    assert enc[-1] == eos and labels[-1] == eos
    enc, labels = enc[:-1], labels[:-1]
    sentinel_ids = np.asarray(sentinel_ids)
    enc_sentinels = enc[np.isin(enc, sentinel_ids)]
    k = enc_sentinels.size
    assert k >= 1
    np.testing.assert_array_equal(enc_sentinels, sentinel_ids[:k])
    label_sentinel_pos = np.flatnonzero(np.isin(labels, sentinel_ids))
    np.testing.assert_array_equal(labels[label_sentinel_pos], sentinel_ids[:k])
    assert label_sentinel_pos[0] == 0
    bounds = list(label_sentinel_pos) + [labels.size]
    spans = [labels[a + 1:b] for a, b in zip(bounds, bounds[1:])]
    assert all(s.size >= 1 for s in spans)
    return enc, spans


def reconstruct(enc, spans, sentinel_ids):
    """Original tokens: each sentinel in the encoder body replaced by its span."""
    position = {int(s): i for i, s in enumerate(sentinel_ids)}
    out = []
    for t in enc.tolist():
        if t in position:
            out.extend(spans[position[t]].tolist())
        else:
            out.append(t)
    return np.asarray(out, dtype=np.int64)


def expected_raw(ds: T5Dataset, idx: int, eod: int | None) -> np.ndarray:
    """The window the GPT token index gives sample ``idx``, document ends removed."""
    window = ds.dataset[idx]["input_ids"].numpy().astype(np.int64)
    assert window.size == ds.raw_length
    return window if eod is None else window[window != eod]


def write_corpus(prefix, docs):
    builder = MMapIndexedDatasetBuilder(str(prefix), dtype=np.uint16)
    for doc in docs:
        builder.add_item(np.asarray(doc, dtype=np.uint16))
        builder.end_document()
    builder.finalize()
    return str(prefix)


# ----------------------------------------------------------------------------------------------
# span arithmetic
# ----------------------------------------------------------------------------------------------
def _t5_lengths(n, density, mean):
    """T5's _tokens_length_to_inputs_length_targets_length, restated independently."""
    noise = min(max(int(round(n * density)), 1), n - 1)
    spans = max(int(round(noise / mean)), 1)
    return n - noise + spans + 1, noise + spans + 1


def test_default_lengths_come_from_t5_random_spans_helper():
    # The numbers of T5's C4 span-corruption task: 568 raw tokens -> 512 inputs, 114 targets.
    assert random_spans_helper(512, 0.15, 3.0) == (568, 114)
    for inputs, density, mean in [(512, 0.15, 3.0), (1024, 0.15, 3.0), (128, 0.3, 2.0), (256, 0.15, 8.0)]:
        raw, targets = random_spans_helper(inputs, density, mean)
        enc, dec = _t5_lengths(raw, density, mean)
        assert enc <= inputs and dec == targets
        assert _t5_lengths(raw + 1, density, mean)[0] > inputs  # the longest window that fits


def test_noise_mask_counts_and_layout():
    rng = np.random.default_rng(0)
    lengths = []
    for _ in range(200):
        mask = random_spans_noise_mask(568, 0.15, 3.0, rng)
        assert mask.shape == (568,) and mask.dtype == bool
        assert mask.sum() == 85 and not mask[0] and mask[-1]  # kept tokens first, noise last
        starts = np.flatnonzero(mask & ~np.r_[False, mask[:-1]])
        ends = np.flatnonzero(mask & ~np.r_[mask[1:], False])
        assert starts.size == 28
        lengths.extend((ends - starts + 1).tolist())
    lengths = np.asarray(lengths)
    # Random segmentation, not fixed-length spans: a spread of lengths around 3.
    assert lengths.min() == 1 and lengths.max() >= 8 and 1.5 < lengths.std() < 3.5
    assert random_spans_noise_mask(1, 0.15, 3.0, rng).tolist() == [False]
    assert random_spans_noise_mask(2, 0.15, 3.0, rng).tolist() == [False, True]


# ----------------------------------------------------------------------------------------------
# sample contents
# ----------------------------------------------------------------------------------------------
def test_default_shapes_dtypes_and_bert_special_ids(bert_train, bert_tok):
    assert (bert_train.raw_length, bert_train.max_seq_length, bert_train.max_seq_length_dec) == (568, 512, 114)
    s = bert_train[0]
    assert set(s) == {"encoder_input_ids", "decoder_input_ids", "labels", "encoder_attn_mask",
                      "decoder_attn_mask", "encoder_decoder_attn_mask"}
    for key, length in [("encoder_input_ids", 512), ("decoder_input_ids", 114), ("labels", 114)]:
        assert s[key].shape == (length,) and s[key].dtype == torch.int64
    for key, length in [("encoder_attn_mask", 512), ("decoder_attn_mask", 114), ("encoder_decoder_attn_mask", 512)]:
        assert s[key].shape == (length,) and s[key].dtype == torch.bool
    # LiBai's and Megatron's BERT-vocabulary T5: decoder starts with [BOS], labels end with [EOS].
    assert s["decoder_input_ids"][0] == bert_tok.token_to_id("[BOS]") == bert_train.decoder_start_id
    assert bert_train.eos_id == bert_tok.token_to_id("[EOS]")
    assert s["labels"][0] == bert_tok.token_to_id("<extra_id_0>")
    # The BERT demo data has no document-end ids, so every window is full: no padding at all.
    assert bool(s["encoder_attn_mask"].all() and s["decoder_attn_mask"].all())
    torch.testing.assert_close(s["decoder_input_ids"][1:], s["labels"][:-1])


def test_masked_fraction_and_mean_span_length_over_many_samples(bert_train):
    noise_tokens = raw_tokens = spans = 0
    first_half = second_half = 0
    for i in range(0, 600, 2):
        s = bert_train[i]
        enc, label_spans = decompose(s, bert_train.sentinel_ids, bert_train.eos_id)
        n_noise = sum(x.size for x in label_spans)
        noise_tokens += n_noise
        spans += len(label_spans)
        raw_tokens += enc.size - len(label_spans) + n_noise
        mask = bert_train.noise_mask(i, bert_train.raw_length)
        first_half += mask[:284].sum()
        second_half += mask[284:].sum()
    assert abs(noise_tokens / raw_tokens - 0.15) < 0.15 * 0.03
    assert abs(noise_tokens / spans - 3.0) < 3.0 * 0.03
    # Noise is spread over the window, not piled at one end.
    assert abs(first_half / (300 * 284) - 0.15) < 0.02 and abs(second_half / (300 * 284) - 0.15) < 0.02


@pytest.mark.parametrize("which", ["bert", "spm"])
def test_encoder_and_labels_reconstruct_the_raw_tokens_exactly(which, bert_train, spm_train):
    ds = bert_train if which == "bert" else spm_train
    eod = None if which == "bert" else MEGATRON_SPM_EOD
    stripped = 0
    for i in range(0, len(ds) if which == "spm" else 300):
        s = ds[i]
        enc, spans = decompose(s, ds.sentinel_ids, ds.eos_id)
        raw = expected_raw(ds, i, eod)
        stripped += ds.raw_length - raw.size
        np.testing.assert_array_equal(reconstruct(enc, spans, ds.sentinel_ids), raw)
        # Every masked token appears exactly once in the labels, in order: the concatenated
        # spans are the raw tokens under this sample's noise mask.
        mask = ds.noise_mask(i, raw.size)
        np.testing.assert_array_equal(np.concatenate(spans), raw[mask])
    if which == "spm":
        assert stripped > 0  # the Megatron <EOD> ids were really there, and dropped


@pytest.mark.parametrize("which", ["bert128", "spm"])
def test_padding_positions_are_pad_ids_and_ignored_labels(which, bert_tok, spm_train, cache):
    if which == "bert128":
        ds, _, _ = build_t5_train_valid_test_datasets(BERT_DATA, bert_tok, "949,50,1", (100, 0, 0),
                                                      max_seq_length_dec=128, cache_dir=cache)
        assert ds.max_seq_length_dec == 128
    else:
        ds = spm_train
    padded_encoders = padded_decoders = 0
    for i in range(min(len(ds), 200)):
        s = ds[i]
        enc_mask, dec_mask = s["encoder_attn_mask"], s["decoder_attn_mask"]
        n_enc, n_dec = int(enc_mask.sum()), int(dec_mask.sum())
        # Masks are a prefix of True then False; padding holds pad ids and -100 labels only.
        assert enc_mask[:n_enc].all() and not enc_mask[n_enc:].any()
        assert dec_mask[:n_dec].all() and not dec_mask[n_dec:].any()
        assert torch.equal(s["encoder_decoder_attn_mask"], enc_mask)
        assert (s["encoder_input_ids"][n_enc:] == ds.pad_id).all()
        assert (s["decoder_input_ids"][n_dec:] == ds.pad_id).all()
        assert (s["labels"][n_dec:] == IGNORE_INDEX).all() and (s["labels"][:n_dec] != IGNORE_INDEX).all()
        padded_encoders += n_enc < ds.max_seq_length
        padded_decoders += n_dec < ds.max_seq_length_dec
    assert padded_decoders > 0 if which == "bert128" else padded_encoders > 0


def test_sentencepiece_mt5_special_ids(spm_train, spm_tok):
    s = spm_train[3]
    # mT5 / Hugging Face T5: decoder starts with pad (0), eos is 1, <extra_id_0> is the top id.
    assert spm_train.decoder_start_id == spm_tok.pad_token_id == 0 and s["decoder_input_ids"][0] == 0
    assert spm_train.eos_id == spm_tok.eos_token_id == 1
    assert s["labels"][0] == spm_tok.vocab_size - 1 == spm_tok.token_to_id("<extra_id_0>")
    assert not (s["encoder_input_ids"] == MEGATRON_SPM_EOD).any()
    assert not (s["labels"] == MEGATRON_SPM_EOD).any()


def test_document_ends_are_dropped_and_windows_are_disjoint(tmp_path, bert_tok):
    # Every token id appears once in the corpus, each document ends with [SEP] (the BERT
    # tokenizer's eod): one epoch's samples must hold each non-[SEP] token at most once.
    sep = bert_tok.eod_id
    ids = np.arange(10, 10 + 40 * 99)
    docs = [np.r_[ids[i * 99:(i + 1) * 99], sep] for i in range(40)]
    prefix = write_corpus(tmp_path / "unique", docs)
    train, _, _ = build_t5_train_valid_test_datasets(prefix, bert_tok, "1,0,0", (6, 0, 0), cache_dir=str(tmp_path))
    assert len(train) == (40 * 100 - 1) // 568 == 7
    seen = []
    for i in range(len(train)):
        s = train[i]
        enc, spans = decompose(s, train.sentinel_ids, train.eos_id)
        tokens = reconstruct(enc, spans, train.sentinel_ids)
        assert sep not in tokens.tolist()
        assert tokens.size == 568 - np.isin(train.dataset[i]["input_ids"].numpy(), [sep]).sum()
        seen.extend(tokens.tolist())
    assert len(seen) == len(set(seen))


# ----------------------------------------------------------------------------------------------
# determinism and resume
# ----------------------------------------------------------------------------------------------
def test_same_seed_and_index_give_the_same_sample(bert_train, bert_tok, cache):
    again, _, _ = build_t5_train_valid_test_datasets(BERT_DATA, bert_tok, "949,50,1", (600, 0, 0), cache_dir=cache)
    revived = pickle.loads(pickle.dumps(bert_train))  # what a DataLoader worker gets
    for i in (0, 7, 599):
        a, b, c = bert_train[i], again[i], revived[i]
        for key in a:
            assert torch.equal(a[key], b[key]) and torch.equal(a[key], c[key])
    masks = [bert_train.noise_mask(i, 568) for i in range(20)]
    assert all(not np.array_equal(masks[0], m) for m in masks[1:])
    other_seed, _, _ = build_t5_train_valid_test_datasets(BERT_DATA, bert_tok, "949,50,1", (600, 0, 0), seed=99,
                                                          cache_dir=cache)
    assert not np.array_equal(other_seed.noise_mask(0, 568), masks[0])


def _batches(loader):
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def test_resume_with_consumed_samples_continues_the_stream(bert_tok, cache):
    kwargs = dict(max_seq_length=128, num_workers=0, cache_dir=cache, micro_batch_size=2,
                  train_valid_test_num_samples=[40, 0, 0], data_parallel_size=2)
    for rank in (0, 1):
        full, _, _ = build_t5_train_valid_test_loaders(BERT_DATA, bert_tok, data_parallel_rank=rank, **kwargs)
        tail, _, _ = build_t5_train_valid_test_loaders(BERT_DATA, bert_tok, data_parallel_rank=rank,
                                                       consumed_samples=12, **kwargs)
        full, tail = _batches(full), _batches(tail)
        assert len(tail) == len(full) - 3 and len(tail) > 0
        for a, b in zip(full[3:], tail):
            for key in a:
                assert torch.equal(a[key], b[key])
    # A worker process builds the same batches as the main process.
    workers, _, _ = build_t5_train_valid_test_loaders(BERT_DATA, bert_tok, **dict(kwargs, num_workers=1))
    inline, _, _ = build_t5_train_valid_test_loaders(BERT_DATA, bert_tok, **kwargs)
    for a, b in zip(_batches(workers)[:3], _batches(inline)[:3]):
        for key in a:
            assert torch.equal(a[key], b[key])


def test_eval_loaders_cover_their_samples_with_ignored_padding(bert_tok, cache):
    _, valid, test = build_t5_train_valid_test_loaders(
        BERT_DATA, bert_tok, max_seq_length=128, num_workers=0, cache_dir=cache,
        train_valid_test_num_samples=[0, 5, 3], micro_batch_size=4, eval_micro_batch_size=2)
    batches = _batches(valid)
    assert [b["encoder_input_ids"].shape for b in batches] == [(2, 128)] * 3
    assert (batches[-1]["labels"][1] == IGNORE_INDEX).all()
    assert sum(int((b["labels"] != IGNORE_INDEX).any(dim=1).sum()) for b in batches) == 5
    assert len(_batches(test)) == 2
    assert t5_train_samples_per_epoch(BERT_DATA, "949,50,1", 128) > 0


# ----------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------
def _load_config(tmp_path, overrides=()):
    from libai_lite.config.instantiate import instantiate_with

    cfg = LazyConfig.load(REPO / "projects" / "MT5" / "configs" / "t5_dataset.py")
    with open_dict(cfg):
        cfg.train = {"seed": 1234}
    LazyConfig.apply_overrides(cfg, [f"dataloader.train.cache_dir={tmp_path}", "dataloader.train.num_workers=0",
                                     *overrides])

    def loaders():
        return instantiate_with(cfg.dataloader.train, train_valid_test_num_samples=[4, 0, 0], micro_batch_size=2,
                                eval_micro_batch_size=2, consumed_samples=0, data_parallel_rank=0,
                                data_parallel_size=1, vocab_size=None)
    return cfg, loaders


def test_config_builds_bert_loaders_from_the_tokenization_node(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the config's paths are relative to the repository root
    cfg, loaders = _load_config(tmp_path)
    train, valid, test = loaders()
    assert valid is None and test is None
    batch = next(iter(train))
    assert batch["encoder_input_ids"].shape == (2, 512) and batch["labels"].shape == (2, 114)
    assert (batch["decoder_input_ids"][:, 0] == 8000).all()  # [BOS] of data_test/bert/vocab.txt
    assert (batch["labels"][:, 0] == 8002).all()  # <extra_id_0>
    LazyConfig.save(cfg, tmp_path / "config.yaml")
    assert "${tokenization.tokenizer}" in (tmp_path / "config.yaml").read_text()


def test_config_mt5_alternative(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg, loaders = _load_config(tmp_path, [f"dataloader.train.data_prefix={SPM_DATA}",
                                           f"dataloader.train.eod_token_id={MEGATRON_SPM_EOD}"])
    cfg.tokenization.tokenizer = LazyCall(SentencePieceTokenizer)(model_file=SPM_MODEL, extra_ids=100, style="t5")
    batch = next(iter(loaders()[0]))
    assert (batch["decoder_input_ids"][:, 0] == 0).all() and (batch["labels"][:, 0] == 4099).all()


# ----------------------------------------------------------------------------------------------
# errors users can fix
# ----------------------------------------------------------------------------------------------
def _one_line_error(fn, *needles):
    with pytest.raises(UsageError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def test_missing_prefix_is_a_one_line_error(bert_tok, tmp_path):
    _one_line_error(lambda: build_t5_train_valid_test_loaders(
        str(tmp_path / "nope_text_document"), bert_tok, train_valid_test_num_samples=[4, 0, 0],
        micro_batch_size=2), "nope_text_document", "preprocess_data.py")


def test_tokenizer_without_enough_sentinels_is_a_one_line_error(cache):
    few = BertTokenizer(BERT_VOCAB, vocab_extra_ids=10)
    build = lambda tok: build_t5_train_valid_test_datasets(BERT_DATA, tok, "949,50,1", (4, 0, 0), cache_dir=cache)
    _one_line_error(lambda: build(few), "10 sentinel", "28", "vocab_extra_ids=100")
    _one_line_error(lambda: build(BertTokenizer(BERT_VOCAB)), "0 sentinel")
    gpt2 = GPT2Tokenizer(str(REPO / "data_test/gpt2/vocab.json"), str(REPO / "data_test/gpt2/merges.txt"))
    _one_line_error(lambda: build(gpt2), "sentinel")
    # Shorter encoders need fewer sentinels: 10 are enough for 128 tokens (7 spans).
    ds, _, _ = build_t5_train_valid_test_datasets(BERT_DATA, few, "949,50,1", (4, 0, 0), max_seq_length=128,
                                                  cache_dir=cache)
    assert ds[0]["encoder_input_ids"].shape == (128,)


def test_bad_lengths_and_rates_are_one_line_errors(bert_tok, cache):
    build = lambda **kw: build_t5_train_valid_test_datasets(BERT_DATA, bert_tok, "949,50,1", (4, 0, 0),
                                                            cache_dir=cache, **kw)
    _one_line_error(lambda: build(max_seq_length_dec=113), "max_seq_length_dec=113", "114")
    _one_line_error(lambda: build(masked_lm_prob=0.0), "masked_lm_prob")
    _one_line_error(lambda: build(mean_span_length=0.5), "mean_span_length")


def test_data_ids_that_are_sentinels_are_refused(spm_tok, tmp_path, cache):
    # Megatron-style data read with an mT5-style tokenizer: <EOD> 4002 is <extra_id_97> there.
    _one_line_error(lambda: build_t5_train_valid_test_datasets(SPM_DATA, spm_tok, "949,50,1", (4, 0, 0),
                                                               cache_dir=cache),
                    "4002", "<extra_id_97>", "eod_token_id=4002")
    # A sentinel id below the largest id is only seen when its sample is read.
    docs = [np.r_[np.arange(5, 300), 4050] for _ in range(8)]
    docs[0][10] = 4010
    prefix = write_corpus(tmp_path / "clash", docs)
    train, _, _ = build_t5_train_valid_test_datasets(prefix, spm_tok, "1,0,0", (4, 0, 0), eod_token_id=4050,
                                                     cache_dir=str(tmp_path))
    messages = set()
    for i in range(len(train)):
        try:
            train[i]
        except UsageError as e:
            messages.add(str(e))
    assert any("4010" in m and "<extra_id_89>" in m for m in messages)
