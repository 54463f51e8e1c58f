"""Mistral 7B (v0.3): 32 layers, hidden 4096, 32 heads over 8 key/value heads, ffn 14336, vocab 32768, theta 1e6.

v0.1 attends through a sliding window: model.cfg.sliding_window=4096 (and vocab_size=32000, rope_theta=10000).
"""
from .llama_real_size import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=32768, rope_theta=1000000.0)
train.output_dir = "output/mistral_7B"
