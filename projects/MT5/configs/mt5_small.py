"""mT5-small: hidden 512, 8 layers per stack, 6 heads of 64, gated-GELU feed-forward 1024, vocab 250112.

Pretraining recipe of `mt5_pretrain.py` at the published mT5-small dimensions. The vocabulary comes
from the tokenizer (data_test's BERT vocab + 100 sentinels as shipped; mT5's SentencePiece
model for real runs, see projects/MT5/README.md).
"""
from .mt5_pretrain import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_size=512, hidden_layers=8, num_attention_heads=6, head_size=64, intermediate_size=1024)
train.output_dir = "output/mt5_small"
