"""GPT-2 BPE tokenizer and Megatron-format `.bin/.idx` data (the demo corpus in data_test/ by default).

`data_prefix` is one prefix or Megatron's blend list `[weight1, prefix1, weight2, prefix2, ...]`;
relative paths start at the directory you launch from (the repository root in the README).
"""
from libai_lite.config import LazyCall
from libai_lite.data import build_gpt_train_valid_test_loaders
from libai_lite.tokenizer import GPT2Tokenizer

tokenization = dict(
    tokenizer=LazyCall(GPT2Tokenizer)(
        vocab_file="data_test/gpt2/vocab.json",
        merges_file="data_test/gpt2/merges.txt",
    ),
    make_vocab_size_divisible_by=128,
)

dataloader = dict(
    # The trainer adds the sample counts, batch sizes and data position of this run.
    train=LazyCall(build_gpt_train_valid_test_loaders)(
        data_prefix="data_test/gpt2/demo_gpt2_text_document",
        splits_string="949,50,1",
        seq_length="${model.cfg.max_seq_length}",
        seed="${train.seed}",
        num_workers=1,
        # Where the index caches go; null writes them next to the data.
        cache_dir=None,
        # Document split boundaries as Megatron core computes them; "legacy" for legacy Megatron-LM/LiBai runs.
        split_rounding="core",
        # Megatron's packed-document options (libai_lite/data/packing.py), for samples that span several
        # documents: positions restart after each end-of-document token, attention never crosses one, and
        # no loss is taken where the input token ends a document. They use eod_token_id, which the trainer
        # fills in with the tokenizer's eod_id when it is left null.
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        eod_token_id=None,
    ),
)
