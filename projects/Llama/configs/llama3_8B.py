"""Llama 3 8B: 32 layers, hidden 4096, 32 heads over 8 key/value heads, ffn 14336, vocab 128256, rope theta 5e5."""
from .llama_real_size import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_seq_length=8192, rope_theta=500000.0)
train.output_dir = "output/llama3_8B"
