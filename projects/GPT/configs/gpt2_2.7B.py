"""GPT-2 2.7B: 32 layers, hidden 2560, 32 heads, sequence 1024 (Megatron-LM's published shape).

Point `dataloader.train.data_prefix` and `tokenization.tokenizer` at your corpus; the defaults
train on data_test/ so the config runs as shipped.
"""
from .gpt2_real_size import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_layers=32, hidden_size=2560, ffn_hidden_size=4 * 2560, num_attention_heads=32)
train.output_dir = "output/gpt2_2.7B"
