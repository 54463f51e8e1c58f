"""Mixtral 8x7B: Mistral 7B's attention (32 heads over 8 key/value heads, theta 1e6) with every feed-forward a
mixture of 8 SwiGLU experts (ffn 14336), top-2 routed, no token dropped; vocab 32000."""
from .llama_real_size import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=32000, rope_theta=1000000.0)
model.cfg.moe.update(enabled=True, num_experts=8, top_k=2, capacity_factor=None, every_n_layers=1,
                     aux_loss_weight=0.02)
train.output_dir = "output/mixtral_8x7B"
