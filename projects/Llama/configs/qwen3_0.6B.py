"""Qwen3 0.6B: 28 layers, hidden 1024, 16 heads over 8 key/value heads of 128 (wider than hidden / heads), ffn 3072,
vocab 151936, theta 1e6, per-head q/k RMS norms, the LM head tied to the embedding (as 1.7B and 4B)."""
from .llama_real_size import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_layers=28, hidden_size=1024, ffn_hidden_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_size=128, vocab_size=151936, rope_theta=1000000.0,
                 qk_norm=True, tie_word_embeddings=True, layernorm_epsilon=1e-6)
train.output_dir = "output/qwen3_0.6B"
