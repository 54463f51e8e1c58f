"""Qwen3 8B: 36 layers, hidden 4096, 32 heads over 8 key/value heads of 128, ffn 12288, vocab 151936, theta 1e6,
per-head q/k RMS norms, untied head."""
from .llama_real_size import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32,
                 num_key_value_heads=8, head_size=128, vocab_size=151936, rope_theta=1000000.0,
                 qk_norm=True, layernorm_epsilon=1e-6)
train.output_dir = "output/qwen3_8B"
