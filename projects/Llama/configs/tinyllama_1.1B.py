"""TinyLlama 1.1B: 22 layers, hidden 2048, 32 heads over 4 key/value heads, ffn 5632, vocab 32000, seq 2048."""
from .llama_real_size import dataloader, model, optim, tokenization, train

model.cfg.update(hidden_layers=22, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000, max_seq_length=2048, rope_theta=10000.0)
train.output_dir = "output/tinyllama_1.1B"
