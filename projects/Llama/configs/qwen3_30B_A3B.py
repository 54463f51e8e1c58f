"""Qwen3-30B-A3B: Qwen3 8B's attention shape at hidden 2048 (48 layers, 32 heads over 4 key/value heads of 128,
per-head q/k RMS norms) with every feed-forward a mixture of 128 SwiGLU experts of width 768, top-8 routed and
renormalised, no token dropped; vocab 151936, untied head, theta 1e6."""
from .llama_real_size import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                 num_key_value_heads=4, head_size=128, vocab_size=151936, rope_theta=1000000.0,
                 qk_norm=True, layernorm_epsilon=1e-6)
model.cfg.moe.update(enabled=True, num_experts=128, top_k=8, ffn_hidden_size=768, capacity_factor=None,
                     every_n_layers=1, aux_loss_weight=0.001)
train.output_dir = "output/qwen3_30B_A3B"
