"""The Llama model and its settings (TinyLlama 1.1B's shape by default); recipes change `model.cfg` keys only.

The class is imported relatively, so a copy of this project folder trains its own model.
"""
from libai_lite.config import LazyCall

from ..modeling.llama_model import LlamaForPreTraining

cfg = dict(
    hidden_layers=22,
    # Replaced at startup by the tokenizer's size padded to a multiple of make_vocab_size_divisible_by
    # (whatever the layout).
    vocab_size=32000,
    hidden_size=2048,
    ffn_hidden_size=5632,
    num_attention_heads=32,
    # Fewer than num_attention_heads: grouped-query attention (1: multi-query).
    num_key_value_heads=4,
    head_size=None,
    max_seq_length=2048,
    rope_theta=10000.0,
    # Llama 3.1's frequency scaling: dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
    # high_freq_factor=4.0, original_max_position_embeddings=8192).
    rope_scaling=None,
    attention_dropout_prob=0.0,
    output_dropout_prob=0.0,
    layernorm_epsilon=1e-5,
    initializer_range=0.02,
    use_scaled_init_for_output_weights=True,
    tie_word_embeddings=False,
    # Qwen2 biases q, k and v (and nothing else).
    qkv_bias=False,
    # Qwen3 RMS-normalises each query and key head (over head_size) before the rotary embedding.
    qk_norm=False,
    # Mistral 7B v0.1's 4096: each position attends to itself and the window - 1 before it; None: all.
    sliding_window=None,
    # LM head + loss in one step without the [tokens, vocab] logits tensor.
    fused_cross_entropy=True,
    # Mixture-of-experts feed-forward layers (libai_lite.layers.MoEConfig); Mixtral: every layer, top-2 of 8,
    # no capacity limit (capacity_factor=None).
    moe=dict(
        enabled=False,
        num_experts=8,
        top_k=2,
        ep_size=1,
        capacity_factor=None,
        aux_loss_weight=0.02,
        every_n_layers=1,
        jitter_noise=0.0,
    ),
)

pretrain_model = LazyCall(LlamaForPreTraining)(cfg=cfg)
