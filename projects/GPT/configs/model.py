"""The GPT model and its settings (GPT-2 117M by default); recipes change `model.cfg` keys, never the code.

The class is imported relatively, so a copy of this project folder trains its own model.
"""
from libai_lite.config import LazyCall

from ..modeling.gpt_model import GPTForPreTraining

cfg = dict(
    hidden_layers=12,
    # Replaced at startup by the tokenizer's size padded to a multiple of make_vocab_size_divisible_by
    # (whatever the layout).
    vocab_size=50304,
    hidden_size=768,
    ffn_hidden_size=3072,
    num_attention_heads=12,
    max_seq_length=1024,
    embedding_dropout_prob=0.1,
    attention_dropout_prob=0.1,
    output_dropout_prob=0.1,
    layernorm_epsilon=1e-5,
    initializer_range=0.02,
    use_scaled_init_for_output_weights=True,
    activation="gelu_tanh",
    # LM head + loss in one step without the [tokens, vocab] logits tensor (tensor-parallel heads use loss_parallel).
    fused_cross_entropy=True,
    # Mixture-of-experts feed-forward layers (libai_lite.layers.MoEConfig; README "Mixture of experts").
    moe=dict(
        enabled=False,
        num_experts=8,
        top_k=1,
        ep_size=1,
        capacity_factor=1.25,
        aux_loss_weight=0.01,
        every_n_layers=2,
        jitter_noise=0.0,
    ),
)

pretrain_model = LazyCall(GPTForPreTraining)(cfg=cfg)
