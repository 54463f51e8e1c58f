"""mT5-base: hidden 768, 12 layers per stack, 12 heads of 64, gated-GELU feed-forward 2048, vocab 250112.

Pretraining recipe of `mt5_pretrain.py` at the published mT5-base dimensions. The vocabulary comes
from the tokenizer (data_test's BERT vocab + 100 sentinels as shipped; mT5's SentencePiece
model for real runs, see projects/MT5/README.md).
"""
from .mt5_pretrain import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_size=768, hidden_layers=12, num_attention_heads=12, head_size=64, intermediate_size=2048)
train.output_dir = "output/mt5_base"
