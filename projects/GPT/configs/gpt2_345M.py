"""GPT-2 345M: 24 layers, hidden 1024, 16 heads, sequence 1024 (Megatron-LM's published shape).

Point `dataloader.train.data_prefix` and `tokenization.tokenizer` at your corpus; the defaults
train on data_test/ so the config runs as shipped.
"""
from .gpt2_real_size import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_layers=24, hidden_size=1024, ffn_hidden_size=4 * 1024, num_attention_heads=16)
train.output_dir = "output/gpt2_345M"
