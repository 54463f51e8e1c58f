"""mT5-large: hidden 1024, 24 layers per stack, 16 heads of 64, gated-GELU feed-forward 2816, vocab 250112.

Pretraining recipe of `mt5_pretrain.py` at the published mT5-large dimensions. The vocabulary comes
from the tokenizer (data_test's BERT vocab + 100 sentinels as shipped; mT5's SentencePiece
model for real runs, see projects/MT5/README.md).
"""
from .mt5_pretrain import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_size=1024, hidden_layers=24, num_attention_heads=16, head_size=64, intermediate_size=2816)
train.output_dir = "output/mt5_large"
