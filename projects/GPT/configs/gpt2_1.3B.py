"""GPT-2 1.3B: 24 layers, hidden 2048, 16 heads, sequence 1024 (Megatron-LM's published shape).

Point `dataloader.train.data_prefix` and `tokenization.tokenizer` at your corpus; the defaults
train on data_test/ so the config runs as shipped.
"""
from .gpt2_real_size import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_layers=24, hidden_size=2048, ffn_hidden_size=4 * 2048, num_attention_heads=16)
train.output_dir = "output/gpt2_1.3B"
