"""T5/mT5 span-corruption data: BERT WordPiece vocabulary with 100 sentinels on the demo corpus.

As LiBai's T5 demo: ``BertTokenizer(vocab.txt, vocab_extra_ids=100)``; the decoder starts with [BOS] and
labels end with [EOS]. The encoder gets ``max_seq_length`` tokens (512) cut from a raw window of 568;
``max_seq_length_dec=None`` computes the label length (114). These are dataset keys, as in LiBai, so the
model config need not know them. ``tokenizer="${tokenization.tokenizer}"`` hands the loader the trainer's
tokenizer node, so an override of it reaches both. mT5 style (SentencePiece):

    tokenization.tokenizer = LazyCall(SentencePieceTokenizer)(
        model_file="data_test/spm/spiece.model", extra_ids=100, style="t5")
    dataloader.train.data_prefix = "data_test/spm/demo_spm_text_document"
    dataloader.train.eod_token_id = 4002  # data_test/spm ends documents with Megatron's <EOD>
"""
from libai_lite.config import LazyCall
from libai_lite.tokenizer import BertTokenizer

from ..data.t5_dataset import build_t5_train_valid_test_loaders

tokenization = dict(
    tokenizer=LazyCall(BertTokenizer)(
        vocab_file="data_test/bert/vocab.txt",
        do_lower_case=True,
        vocab_extra_ids=100,
    ),
    make_vocab_size_divisible_by=128,
)

dataloader = dict(
    # The trainer adds the sample counts, batch sizes and data position of this run.
    train=LazyCall(build_t5_train_valid_test_loaders)(
        data_prefix="data_test/bert/demo_bert_text_document",
        tokenizer="${tokenization.tokenizer}",
        splits_string="949,50,1",
        max_seq_length=512,
        max_seq_length_dec=None,
        masked_lm_prob=0.15,
        mean_span_length=3.0,
        seed="${train.seed}",
        num_workers=1,
        # Where the index caches go; null writes them next to the data.
        cache_dir=None,
        # Document-end id dropped from the data; null: the tokenizer's eod_id ([SEP] for BERT).
        eod_token_id=None,
    ),
)
