"""GPT-2 117M: 12 layers, hidden 768, 12 heads, sequence 1024 (Megatron-LM's published shape).

Point `dataloader.train.data_prefix` and `tokenization.tokenizer` at your corpus; the defaults
train on data_test/ so the config runs as shipped.
"""
from .gpt2_real_size import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_layers=12, hidden_size=768, ffn_hidden_size=4 * 768, num_attention_heads=12)
train.output_dir = "output/gpt2_117M"
