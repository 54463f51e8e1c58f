"""Tokenizers: parity with Megatron-LM's preprocessed files and with reference implementations."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from libai_lite.data.indexed_dataset import MMapIndexedDataset
from libai_lite.tokenizer import (
    BertTokenizer,
    GPT2Tokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    pad_vocab_size,
)
from libai_lite.utils.errors import UsageError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO = REPO_ROOT / "data_test"

SAMPLES = [
    "Return the number of items in a container.",
    "  Leading spaces, trailing spaces  ",
    "Tabs\tand\nnew lines\n\nand   runs of   spaces",
    "It's what we'll do; they're done, I'd say -- isn't it?",
    "Numbers 3.14159, 2**31-1 and 0xDEADBEEF",
    "Unicode: café, naïve, Ünïcödé, 東京, Ελληνικά, emoji 🙂",
    "def f(x):\n    return x[::-1]  # reverse",
]


def _fixture_tokenizer(shared_fixtures: Path, name: str):
    tok = shared_fixtures / "tokenizers"
    if name == "gpt2":
        return build_tokenizer(
            "GPT2BPETokenizer", vocab_file=tok / "gpt2/vocab.json", merge_file=tok / "gpt2/merges.txt"
        )
    if name == "bert":
        return build_tokenizer("BertWordPieceLowerCase", vocab_file=tok / "bert/vocab.txt")
    return build_tokenizer("SentencePieceTokenizer", tokenizer_model=tok / "spm/spiece.model")


def _corpus(path: Path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="module")
def demo_gpt2():
    return GPT2Tokenizer(DEMO / "gpt2/vocab.json", DEMO / "gpt2/merges.txt")


@pytest.fixture(scope="module")
def demo_bert():
    return BertTokenizer(DEMO / "bert/vocab.txt")


@pytest.fixture(scope="module")
def demo_spm():
    return SentencePieceTokenizer(DEMO / "spm/spiece.model")


# ------------------------------------------------------------ Megatron parity


@pytest.mark.parametrize("name,append_eod", [("gpt2", True), ("bert", False), ("spm", True)])
def test_megatron_files_read_back_as_our_ids(shared_fixtures, name, append_eod):
    tokenizer = _fixture_tokenizer(shared_fixtures, name)
    texts = _corpus(shared_fixtures / "corpus.jsonl")
    ds = MMapIndexedDataset(str(shared_fixtures / f"megatron/{name}_mmap_text_document"))
    assert ds.dtype == np.uint16
    assert len(ds) == len(texts)
    np.testing.assert_array_equal(ds.doc_idx, np.arange(len(texts) + 1))
    ours = tokenizer.encode_batch(texts)
    for i, ids in enumerate(ours):
        expected = ids + [tokenizer.eod_id] if append_eod else ids
        assert ds[i].tolist() == expected, f"document {i} differs from Megatron's ids"


def test_megatron_sentencepiece_ids(shared_fixtures):
    """The ids Megatron's SentencePieceTokenizer gives a T5-style 4,000-piece model."""
    tok = _fixture_tokenizer(shared_fixtures, "spm")
    assert tok.vocab_size == len(tok) == 4005
    assert (tok.cls_token_id, tok.sep_token_id, tok.eod_id, tok.mask_token_id) == (4000, 4001, 4002, 4003)
    assert tok.bos_token_id == 4004  # the model has no bos, so Megatron adds <BOS>
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    # Megatron's file ends every document with <EOD> = 4002 and never uses a higher id.
    ds = MMapIndexedDataset(str(shared_fixtures / "megatron/spm_mmap_text_document"))
    assert {int(ds[i][-1]) for i in range(len(ds))} == {4002}
    assert max(int(ds[i].max()) for i in range(len(ds))) == 4002


def test_megatron_bert_vocab_size(shared_fixtures):
    tok = _fixture_tokenizer(shared_fixtures, "bert")
    lines = (shared_fixtures / "tokenizers/bert/vocab.txt").read_text(encoding="utf-8").splitlines()
    # Megatron appends [BOS] and [EOS] to a vocab that lacks them.
    assert tok.vocab_size == len(lines) + 2
    assert (tok.bos_token_id, tok.eos_token_id) == (len(lines), len(lines) + 1)
    assert (tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id) == (
        0,
        1,
        2,
        3,
        4,
    )


# ------------------------------------------------------------ GPT-2


def _reference_gpt2(vocab_file, merges_file):
    """Megatron-LM's / OpenAI's GPT-2 encoder (gpt2_tokenization.py), reduced to encode()."""
    regex = pytest.importorskip("regex")
    encoder = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    merges = Path(merges_file).read_text(encoding="utf-8").split("\n")[1:-1]
    ranks = {tuple(m.split()): i for i, m in enumerate(merges)}
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_encoder = dict(zip(bs, map(chr, cs)))
    pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def bpe(token):
        word = list(token)
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
            if best not in ranks:
                break
            out, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            word = out
        return word

    def encode(text):
        ids = []
        for token in pat.findall(text):
            ids.extend(encoder[t] for t in bpe("".join(byte_encoder[b] for b in token.encode("utf-8"))))
        return ids

    return encode


def test_gpt2_matches_reference_bpe(demo_gpt2):
    reference = _reference_gpt2(DEMO / "gpt2/vocab.json", DEMO / "gpt2/merges.txt")
    for text in SAMPLES:
        assert demo_gpt2.encode(text) == reference(text), text


def test_gpt2_round_trip_and_specials(demo_gpt2):
    for text in SAMPLES:
        assert demo_gpt2.decode(demo_gpt2.encode(text)) == text
    assert demo_gpt2.encode_batch(SAMPLES) == [demo_gpt2.encode(t) for t in SAMPLES]
    assert demo_gpt2.vocab_size == len(demo_gpt2) == 8000
    eod = demo_gpt2.token_to_id("<|endoftext|>")
    assert demo_gpt2.eod_id == demo_gpt2.bos_token_id == demo_gpt2.eos_token_id == eod
    assert demo_gpt2.pad_token_id is None
    assert demo_gpt2.additional_special_tokens_ids == []
    # As in Megatron, the literal string is text, not a document boundary.
    assert eod not in demo_gpt2.encode("a <|endoftext|> b")
    assert demo_gpt2.decode([eod]) == "<|endoftext|>"
    assert demo_gpt2.decode(np.array(demo_gpt2.encode("numpy ids"))) == "numpy ids"


# ------------------------------------------------------------ BERT


def _reference_bert(vocab_file, do_lower_case):
    """Google's / Megatron's BERT tokenizer (BasicTokenizer + 200-char WordpieceTokenizer)."""
    legacy = pytest.importorskip("transformers.models.bert.tokenization_bert_legacy")
    vocab = {}
    for i, line in enumerate(Path(vocab_file).read_text(encoding="utf-8").splitlines()):
        vocab[line.strip()] = i
    basic = legacy.BasicTokenizer(do_lower_case=do_lower_case, never_split=[], tokenize_chinese_chars=True)
    wordpiece = legacy.WordpieceTokenizer(vocab, unk_token="[UNK]", max_input_chars_per_word=200)
    return lambda text: [vocab[t] for w in basic.tokenize(text) for t in wordpiece.tokenize(w)]


@pytest.mark.parametrize("do_lower_case", [True, False])
def test_bert_matches_reference_wordpiece(do_lower_case):
    tok = BertTokenizer(DEMO / "bert/vocab.txt", do_lower_case=do_lower_case)
    reference = _reference_bert(DEMO / "bert/vocab.txt", do_lower_case)
    texts = SAMPLES + [
        "control\x00chars\x07 and \ufffd replacement",
        "x" * 150,  # split into pieces: Megatron only gives up on words over 200 characters
        "y" * 201,
        "[SEP] in text is not a special token",
    ]
    for text in texts:
        assert tok.encode(text) == reference(text), text
    assert tok.encode("y" * 201) == [tok.unk_token_id]


def test_bert_specials_and_round_trip(demo_bert):
    assert [demo_bert.token_to_id(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")] == [0, 1, 2, 3, 4]
    assert demo_bert.eod_id == demo_bert.sep_token_id == 3
    assert demo_bert.vocab_size == 8002  # 8,000 lines + Megatron's [BOS], [EOS]
    assert demo_bert.decode(demo_bert.encode("Hello, World: tokenizers!")) == "hello, world : tokenizers!"
    assert demo_bert.encode("Café") == demo_bert.encode("cafe")
    assert demo_bert.encode_batch(SAMPLES) == [demo_bert.encode(t) for t in SAMPLES]

    sentinels = BertTokenizer(DEMO / "bert/vocab.txt", vocab_extra_ids=3)
    assert sentinels.additional_special_tokens_ids == [8002, 8003, 8004]
    assert sentinels.vocab_size == 8005
    assert sentinels.decode([8002] + sentinels.encode("the end")) == "<extra_id_0> the end"


# ------------------------------------------------------------ SentencePiece


def test_spm_megatron_style(demo_spm):
    sp = demo_spm.sp
    assert demo_spm.vocab_size == 4005
    assert demo_spm.eod_id == 4002
    text = "Split around <EOD> and </s> but not <eod>."
    expected = sp.encode("Split around ") + [4002] + sp.encode(" and ") + [1] + sp.encode(" but not <eod>.")
    assert demo_spm.encode(text) == expected
    assert demo_spm.decode(demo_spm.encode("Return the value.")) == "Return the value."
    assert demo_spm.decode(expected, skip_special_tokens=True) == sp.decode(
        sp.encode("Split around ") + sp.encode(" and ") + sp.encode(" but not <eod>.")
    )
    assert demo_spm.encode_batch(SAMPLES + [text]) == [demo_spm.encode(t) for t in SAMPLES + [text]]

    tok = SentencePieceTokenizer(DEMO / "spm/spiece.model", extra_ids=11)
    assert tok.additional_special_tokens_ids == list(range(4005, 4016))
    assert tok.vocab_size == 4016
    assert tok.encode("<extra_id_3>") == [4008]
    assert tok.encode("x<extra_id_10><extra_id_1>") == sp.encode("x") + [4015, 4006]


def test_spm_t5_style():
    tok = SentencePieceTokenizer(DEMO / "spm/spiece.model", extra_ids=100, style="t5")
    assert tok.vocab_size == 4100
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.bos_token_id) == (0, 1, 2, None)
    assert tok.eod_id == 1
    assert tok.additional_special_tokens_ids[0] == 4099 and tok.additional_special_tokens_ids[-1] == 4000
    assert tok.token_to_id("<extra_id_0>") == 4099
    assert tok.id_to_token(4000) == "<extra_id_99>"
    ids = tok.encode("Mask <extra_id_0> here and <extra_id_12> there")
    assert 4099 in ids and 4087 in ids
    assert tok.decode(ids) == "Mask <extra_id_0> here and <extra_id_12> there"


def test_spm_t5_style_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "spiece.model").write_bytes((DEMO / "spm/spiece.model").read_bytes())
    try:
        hf = transformers.T5Tokenizer.from_pretrained(str(tmp_path), extra_ids=100)
    except Exception as e:  # transformers versions differ in how they load a bare spiece.model
        pytest.skip(f"transformers cannot load a bare spiece.model here: {e}")
    ours = SentencePieceTokenizer(DEMO / "spm/spiece.model", extra_ids=100, style="t5")
    assert len(hf) == ours.vocab_size
    texts = SAMPLES + ["Mask <extra_id_0> here and <extra_id_12> there </s> end"]
    for text in texts:
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text), text
    assert hf.convert_tokens_to_ids([f"<extra_id_{i}>" for i in range(100)]) == ours.additional_special_tokens_ids


# ------------------------------------------------------------ helpers and errors


def test_pad_vocab_size():
    assert pad_vocab_size(50257) == 50304
    assert pad_vocab_size(8064, 128) == 8064
    assert pad_vocab_size(4005, 1) == 4005
    assert pad_vocab_size(4005, 256) == 4096
    with pytest.raises(ValueError, match="make_vocab_size_divisible_by"):
        pad_vocab_size(8000, 0)
    # No layout argument: the padded vocabulary cannot depend on the tensor-parallel size.
    with pytest.raises(TypeError):
        pad_vocab_size(50257, 128, 8)


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_missing_and_bad_files(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError) as e:
        GPT2Tokenizer(missing, DEMO / "gpt2/merges.txt")
    assert str(missing) in _one_line(e) and "--vocab-file" in str(e.value)
    with pytest.raises(FileNotFoundError) as e:
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=tmp_path / "x.model")
    assert "--tokenizer-model" in _one_line(e)
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(ValueError) as e:
        SentencePieceTokenizer(garbage)
    assert str(garbage) in _one_line(e)
    with pytest.raises(ValueError) as e:
        GPT2Tokenizer(garbage, garbage)
    assert str(garbage) in _one_line(e)
    with pytest.raises(ValueError) as e:
        BertTokenizer(DEMO / "gpt2/merges.txt")
    assert "[PAD]" in _one_line(e)
    with pytest.raises(ValueError) as e:
        build_tokenizer("GPT2BPETokenizer", vocab_file=DEMO / "gpt2/vocab.json")
    assert "--merge-file" in _one_line(e)
    with pytest.raises(ValueError) as e:
        build_tokenizer("HFTokenizer")
    assert "GPT2BPETokenizer" in _one_line(e)
    with pytest.raises(ValueError):
        SentencePieceTokenizer(DEMO / "spm/spiece.model", style="llama")


def test_build_tokenizer_types():
    assert isinstance(build_tokenizer("BertWordPieceCase", vocab_file=DEMO / "bert/vocab.txt"), BertTokenizer)
    assert not build_tokenizer("BertWordPieceCase", vocab_file=DEMO / "bert/vocab.txt").do_lower_case
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=DEMO / "spm/spiece.model", vocab_extra_ids=2)
    assert tok.additional_special_tokens_ids == [4005, 4006]
    t5 = build_tokenizer(
        "SentencePieceTokenizer", tokenizer_model=DEMO / "spm/spiece.model", vocab_extra_ids=2, spm_style="t5"
    )
    assert t5.additional_special_tokens_ids == [4001, 4000]


# ------------------------------------------------------------ Hugging Face tokenizer.json

# Llama 3's pre-tokeniser regex; Qwen2's reads \p{N} where Llama 3 reads \p{N}{1,3}.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
HF_SPECIALS = {"llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"],
               "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "bos_eos": ["<s>", "</s>"]}
HF_TEXTS = SAMPLES + ["<|begin_of_text|>marked text<|end_of_text|> and <|eot_id|>", "", " ", "<s> a line </s>",
                      "<|im_start|>user\nhi there<|im_end|>\n<|endoftext|>",
                      "decomposed e\u0301 vs \u00e9, ZWJ 👩\u200d👩\u200d👧, 𝔘𝔫𝔦, control \x00\x7f"]


def write_hf_tokenizer(directory: Path, style: str = "llama3") -> Path:
    """A byte-level BPE ``tokenizer.json`` trained on data_test text, with side files as the family ships them.

    ``llama3``: Llama 3's regex, a BOS template, ``PreTrainedTokenizerFast``. ``qwen2``: NFC, Qwen2's regex, no
    BOS, ``Qwen2Tokenizer`` (which transformers rebuilds from its own class). ``bos_eos``: a ``<s> $A </s>``
    template, specials named only in special_tokens_map.json, a pad token the vocabulary lacks.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    specials = HF_SPECIALS[style]

    def added(token):  # transformers' serialised AddedToken
        return {"content": token, "special": True, "normalized": False}

    tok = Tokenizer(models.BPE(ignore_merges=style == "llama3"))
    tok.normalizer = normalizers.NFC() if style == "qwen2" else None
    split = LLAMA3_SPLIT.replace("{1,3}", "") if style == "qwen2" else LLAMA3_SPLIT
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(DEMO / "corpus.jsonl")[:150], trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if style == "llama3":
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence([tok.post_processor, processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, 0)])])
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": specials[1],
                  "clean_up_tokenization_spaces": True}
        (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 2]}))
    elif style == "qwen2":
        config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                  "pad_token": "<|endoftext|>", "unk_token": None, "additional_special_tokens": specials[1:],
                  "added_tokens_decoder": {str(i): added(t) for i, t in enumerate(specials)}}
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 0), ("</s>", 1)])
        # transformers 5 lets the tokenizer.json template win over these flags.
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False}
        names = {"bos_token": "<s>", "eos_token": added("</s>"), "pad_token": "<pad>"}
        (directory / "special_tokens_map.json").write_text(json.dumps(names))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    return {style: write_hf_tokenizer(tmp_path_factory.mktemp(style), style) for style in HF_SPECIALS}


@pytest.mark.parametrize("style", list(HF_SPECIALS))
def test_hf_tokenizer_matches_transformers(hf_dirs, style):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(hf_dirs[style]))
    ours = HuggingFaceTokenizer(hf_dirs[style])
    assert ours.vocab_size == len(ours) == len(hf)
    names = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    assert [getattr(ours, n) for n in names] == [getattr(hf, n) for n in names]
    for text in HF_TEXTS:
        ids = hf(text).input_ids
        assert ours.encode(text, add_special_tokens=True) == ids, text
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == hf.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
    assert ours.encode_batch(HF_TEXTS, add_special_tokens=True) == hf(HF_TEXTS).input_ids
    assert ours.encode_batch(HF_TEXTS) == [ours.encode(t) for t in HF_TEXTS]


def test_hf_tokenizer_conventions(hf_dirs, tmp_path):
    llama = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dirs["llama3"])
    assert (llama.bos_token_id, llama.eos_token_id, llama.eod_id, llama.pad_token_id) == (0, 1, 1, None)
    assert (llama.add_bos_token, llama.add_eos_token) == (True, False)
    assert llama.encode("Hi", add_special_tokens=True) == [0] + llama.encode("Hi")
    assert llama.encode("a<|eot_id|>b") == llama.encode("a") + [2] + llama.encode("b")
    assert llama.decode(llama.encode(HF_TEXTS[-1])) == HF_TEXTS[-1]  # no clean-up, as transformers for BPE
    qwen = HuggingFaceTokenizer(hf_dirs["qwen2"] / "tokenizer.json")  # the file itself also loads
    assert (qwen.bos_token_id, qwen.eos_token_id, qwen.pad_token_id, qwen.add_bos_token) == (None, 2, 0, False)
    assert qwen.encode("e\u0301") == qwen.encode("\u00e9")  # NFC
    both = HuggingFaceTokenizer(hf_dirs["bos_eos"])
    assert (both.add_bos_token, both.add_eos_token) == (True, True)
    # "<pad>" is named but not in tokenizer.json: appended after it, as transformers does.
    assert both.pad_token_id == both.vocab_size - 1 == 700
    # Without tokenizer_config.json the ids come from generation_config.json (its first eos).
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((hf_dirs["llama3"] / name).read_bytes())
    assert (HuggingFaceTokenizer(tmp_path).bos_token_id, HuggingFaceTokenizer(tmp_path).eos_token_id) == (0, 1)
    (tmp_path / "generation_config.json").unlink()
    assert HuggingFaceTokenizer(tmp_path).eos_token_id is None


def test_hf_tokenizer_errors(hf_dirs, tmp_path):
    def message(path) -> str:
        with pytest.raises(UsageError) as e:
            build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)
        return _one_line(e)

    assert "--tokenizer-model" in message(None)
    assert str(tmp_path / "nowhere") in message(tmp_path / "nowhere")
    assert str(tmp_path / "tokenizer.json") in message(tmp_path)  # a directory without tokenizer.json
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    assert "cannot load" in message(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((hf_dirs["llama3"] / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert "cannot read" in message(tmp_path) and "tokenizer_config.json" in message(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[]")
    assert "not an object" in message(tmp_path)


@pytest.mark.parametrize("content", ["", "#version: 0.2\n", "#version: 0.2\n\n  \n"])
def test_merges_file_without_merges_is_refused(tmp_path, content):
    """tokenizers loads a merges.txt with no merge as a BPE merging nothing: every text became single bytes."""
    merges = tmp_path / "merges.txt"
    merges.write_text(content)
    for build in (lambda: GPT2Tokenizer(DEMO / "gpt2/vocab.json", merges),
                  lambda: build_tokenizer("GPT2BPETokenizer", vocab_file=DEMO / "gpt2/vocab.json", merge_file=merges)):
        with pytest.raises(ValueError) as e:
            build()
        assert str(merges) in _one_line(e) and "holds no merges" in str(e.value)


def test_vocab_fingerprint_names_the_vocabulary(tmp_path, demo_gpt2, demo_bert, demo_spm):
    """One vocabulary, one fingerprint, whatever its file format or the extra ids a wrapper appends; the
    BERT and GPT-2 demo vocabularies (8,000 ids each) differ."""
    assert demo_gpt2.vocab_fingerprint().startswith("sha256:")
    assert demo_gpt2.vocab_fingerprint() != demo_bert.vocab_fingerprint()
    assert demo_gpt2.vocab_size == 8000 and len(demo_bert._file_vocab) == 8000
    demo_gpt2._tok.save(str(tmp_path / "tokenizer.json"))
    assert HuggingFaceTokenizer(tmp_path).vocab_fingerprint() == demo_gpt2.vocab_fingerprint()
    assert BertTokenizer(DEMO / "bert/vocab.txt", vocab_extra_ids=100).vocab_fingerprint() == \
        demo_bert.vocab_fingerprint()
    t5 = SentencePieceTokenizer(DEMO / "spm/spiece.model", extra_ids=100, style="t5")
    assert t5.vocab_fingerprint() == demo_spm.vocab_fingerprint() and t5.vocab_size != demo_spm.vocab_size
    other = tmp_path / "vocab.txt"
    other.write_text((DEMO / "bert/vocab.txt").read_text().replace("[MASK]\n", "[MASK]\nzzz\n", 1))
    assert BertTokenizer(other).vocab_fingerprint() != demo_bert.vocab_fingerprint()
