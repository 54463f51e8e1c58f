"""The per-word id cache gives exactly the tokenizer's own ids (GPT-2 BPE, BERT WordPiece)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from libai_lite.tokenizer import build_tokenizer
from libai_lite.tokenizer.word_cache import GPT2_SPLIT, GPT2_SPLIT_ASCII, WordCache

DEMO = Path(__file__).resolve().parents[2] / "data_test"
TOKENIZERS = {
    "gpt2": dict(tokenizer_type="GPT2BPETokenizer", vocab_file=DEMO / "gpt2/vocab.json",
                 merge_file=DEMO / "gpt2/merges.txt"),
    "bert_lower": dict(tokenizer_type="BertWordPieceLowerCase", vocab_file=DEMO / "bert/vocab.txt"),
    "bert_cased": dict(tokenizer_type="BertWordPieceCase", vocab_file=DEMO / "bert/vocab.txt"),
}
# Where a hand-written split could drift from the library's: contractions in any case, whitespace
# runs before words and at the ends, Unicode whitespace and letters, CJK, emoji, combining marks,
# control characters, words past WordPiece's 200-character limit, special-token look-alikes.
TRICKY = [
    "I'M HERE'S we'll 'S 'sx don't  \n\n  x\t\ty  ", "  leading and trailing  ", "", " ", "\n", "a",
    "café 東京 🙂 naïve\u00a0x \u2028y\u3000z \x1c\x1d a\u0085b", "[SEP] <|endoftext|> [CLS]x ##a",
    "x" * 250 + " short", "Ǆemo ½ ① ٣ x\u200bz \u0301a e\u0301", "Tab\tand\x0bvertical\x0cfeed\r\nCRLF",
    "numbers 3.14159 and 1,000,000 and 2nd", "ÀÉÎÕÜ ß ǅ ﬁ ＡＢＣ", "\x00nul\x7fdel", "¿Qué? ¡Sí! «quoted» “curly”",
]


def _texts():
    with open(DEMO / "corpus.jsonl", "rb") as f:
        corpus = [json.loads(line)["text"] for line in f][:400]
    return corpus + TRICKY


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_cached_ids_equal_the_tokenizers(name):
    tok = build_tokenizer(**TOKENIZERS[name])
    texts = _texts()
    expected = tok.encode_batch(texts)
    assert tok.enable_word_cache()
    cache = tok._word_cache
    # The fast ASCII split was checked against the library and kept.
    assert cache._ascii_findall != cache._findall and cache._ascii_ok
    assert tok.encode_batch(texts) == expected  # cold: every word a miss
    assert tok.encode_batch(texts) == expected  # warm: every word from the cache
    assert [tok.encode_batch([t])[0] for t in TRICKY] == expected[-len(TRICKY):]


def test_a_character_the_regex_splits_differently_takes_the_tokenizers_path():
    """A wrong split pattern is caught per character; those texts still get the exact ids."""
    tok = build_tokenizer(**TOKENIZERS["gpt2"])
    texts = ["plain ascii text", "café crème", "Ελληνικά κείμενα", "mixed ascii and ü"]
    expected = tok.encode_batch(texts)
    # Letters limited to ASCII: every non-ASCII letter splits differently from the library's.
    wrong = GPT2_SPLIT.replace(r"[^\W\d_]", "[A-Za-z]")
    assert wrong != GPT2_SPLIT
    cache = WordCache(tok._tok, wrong, GPT2_SPLIT_ASCII)
    assert cache.encode_batch(texts) == expected
    assert {"é", "ü", "λ"} <= cache._bad and "é" not in cache._good


def test_bounded_cache_stays_exact():
    tok = build_tokenizer(**TOKENIZERS["bert_lower"])
    texts = _texts()[:100]
    expected = tok.encode_batch(texts)
    cache = WordCache(tok._tok, *tok._word_split, max_words=50)
    assert cache.encode_batch(texts) == expected
    longest = max(len(cache._findall(tok._tok.normalizer.normalize_str(t))) for t in texts)
    assert len(cache._cache) <= 50 + longest


def test_no_cache_for_sentencepiece_or_templates():
    spm = build_tokenizer("SentencePieceTokenizer", tokenizer_model=DEMO / "spm/spiece.model")
    assert not hasattr(spm, "enable_word_cache")
    tok = build_tokenizer(**TOKENIZERS["gpt2"])
    from tokenizers import processors

    tok._tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                            special_tokens=[("<|endoftext|>", tok.eod_id)])
    assert not tok.enable_word_cache()


@pytest.mark.parametrize("name", ["gpt2", "bert_lower"])
def test_split_piece_cache_gives_the_tokenizers_bytes(name):
    """encode_batch_bytes caches whole str.split pieces: on random texts built from the characters where a
    piece boundary could matter (spaces beside other whitespace, contractions, digits, punctuation), it gives
    the tokenizer's own ids, cold and warm."""
    import random

    import numpy as np

    tok = build_tokenizer(**TOKENIZERS[name])
    rng = random.Random(0)
    alphabet = ["a", "Bc", "the", "'s", "'", "s", "9", "12", ".", ",!", "_", "-", " ", " ", " ", "  ", "\n",
                "\t", "\r\n", "\x0b", "\x0c", "\x1c", "é"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(3000)]
    texts += _texts() + [" leading", "trailing ", "a  b", "a \nb", "a\n b", "'s 's", "x 'll y"]
    # U+FFFF marks a piece's key: a text holding it is cut before each whitespace run instead.
    texts += ["a \uffffb", "\uffff \uffff", "é\uffff  \n x"]
    expected = tok.encode_batch(texts)
    assert tok.enable_word_cache()
    assert tok._word_cache._units == {"gpt2": "space", "bert_lower": "whitespace"}[name]
    for _ in range(2):  # cold, then every piece from the cache
        got = tok.encode_batch_bytes(texts, np.uint16)
        assert [np.frombuffer(b, np.uint16).tolist() for b in got] == expected
    if name == "gpt2":  # both cuts were taken: str.split pieces and runs with a space inside
        assert any(k[1:].isspace() and " " in k[2:] for k in tok._word_cache._bytes)


def test_every_short_text_of_the_cut_characters_gives_the_tokenizers_bytes():
    """GPT-2's pieces are cut at spaces unless a space lies inside a whitespace run: every text of up to 5
    symbols from words, digits, punctuation, a contraction, ASCII and Unicode whitespace and a non-ASCII
    letter (each whitespace run, at the start, inside and at the end) gives the tokenizer's own ids."""
    import itertools

    import numpy as np

    tok = build_tokenizer(**TOKENIZERS["gpt2"])
    alphabet = ["ab", " ", "\n", "\t", "'s", "7", "!", "é", "\u00a0", "\u3000"]
    texts = ["".join(p) for n in range(6) for p in itertools.product(alphabet, repeat=n)]
    expected = tok.encode_batch(texts)
    assert tok.enable_word_cache()
    cache = tok._word_cache
    for _ in range(2):  # cold, then every piece from the cache
        got = tok.encode_batch_bytes(texts, np.uint16)
        assert [np.frombuffer(b, np.uint16).tolist() for b in got] == expected
    # Non-ASCII texts took both cuts too: space pieces and runs with a space inside.
    assert any(not k.isascii() for k in cache._bytes if not k.startswith("\uffff"))
    assert any(k[1:].isspace() and " " in k[2:] and not k.isascii() for k in cache._bytes)
