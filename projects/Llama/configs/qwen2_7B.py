"""Qwen2 7B: 28 layers, hidden 3584, 28 heads over 4 key/value heads, ffn 18944, vocab 152064, theta 1e6, q/k/v bias."""
from .llama_real_size import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0,
                 qkv_bias=True, layernorm_epsilon=1e-6)
train.output_dir = "output/qwen2_7B"
