"""Llama 3 70B: 80 layers, hidden 8192, 64 heads over 8 key/value heads, ffn 28672, vocab 128256, rope theta 5e5."""
from .llama_real_size import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                 num_key_value_heads=8, vocab_size=128256, max_seq_length=8192, rope_theta=500000.0)
train.output_dir = "output/llama3_70B"
