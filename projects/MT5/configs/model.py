"""T5-family model settings, mT5-base by default; projects change `model.cfg` keys, never the code.

mT5 sizes (hidden_size / hidden_layers per stack / num_attention_heads / intermediate_size, all
with head_size 64): small 512/8/6/1024 (300M), base 768/12/12/2048 (580M), large 1024/24/16/2816
(1.2B). T5 v1.0 (ReLU, tied and scaled head): model_type="t5", vocab_size=32128, e.g. t5-small
512/6/8/2048. Pipeline layouts count both stacks: pipeline_num_layers = 2 x hidden_layers.
"""
from libai_lite.config import LazyCall

# Imported relatively, so a copy of this project folder trains its own model.
from ..modeling import MT5ForPreTraining, MT5Model

cfg = dict(
    # Replaced at startup by the tokenizer's size padded to a multiple of make_vocab_size_divisible_by
    # (whatever the layout).
    vocab_size=250112,
    hidden_size=768,
    hidden_layers=12,
    num_attention_heads=12,
    head_size=64,
    intermediate_size=2048,
    embedding_dropout_prob=0.1,
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    # T5's initializer_factor: scales each weight's fan-in std, so 1.0 (not GPT's 0.02).
    initializer_range=1.0,
    layernorm_eps=1e-6,
    model_type="mt5",
    # mT5 unties the LM head; None would derive it from model_type (tied only for "t5").
    tie_word_embeddings=False,
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

mt5_model = LazyCall(MT5Model)(cfg=cfg)
pretrain_model = LazyCall(MT5ForPreTraining)(cfg=cfg)
