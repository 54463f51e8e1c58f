"""The model families these projects offer to Megatron-LM ``pretrain_gpt.py`` command lines.

``tools/from_megatron.py`` (and ``tools/train_net.py --megatron-args``) hand this table to
``libai_lite.config.megatron_args``, which picks the family that builds the model the flags describe
(``--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear``: Llama) and sets
its keys; the core names no model. A project that builds another Megatron architecture adds its entry.
"""
from libai_lite.config.megatron_args import MegatronModel

_SHAPE = {
    "num_layers": "hidden_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "max_position_embeddings": "max_seq_length",
    "attention_dropout": "attention_dropout_prob",
    "init_method_std": "initializer_range",
    "layernorm_epsilon": "layernorm_epsilon",
}

MEGATRON_MODELS = [
    # Megatron-LM's default GPT: pre-LayerNorm, learned positions, GeLU, biases, the head tied to the embedding.
    MegatronModel(
        name="projects/GPT",
        config="projects.GPT.configs.gpt2_pretrain",
        builds=dict(normalization="LayerNorm", position_embedding_type="learned_absolute",
                    mlp=("gelu", "gelu_tanh"), add_bias_linear=True, qkv_bias=True,
                    share_embeddings_and_output_weights=True),
        keys=dict(_SHAPE, hidden_dropout="output_dropout_prob", embedding_dropout="embedding_dropout_prob",
                  mlp="activation"),
    ),
    # --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear: Llama (with
    # grouped-query attention, --add-qkv-bias for Qwen2, a tied or untied head). Llama drops out nothing
    # after the embeddings, where Megatron applies --hidden-dropout too: it must be 0 here.
    MegatronModel(
        name="projects/Llama",
        config="projects.Llama.configs.llama_demo",
        builds=dict(normalization="RMSNorm", position_embedding_type="rope", mlp="swiglu", add_bias_linear=False,
                    embedding_dropout=0.0, rotary_percent=1.0),
        keys=dict(_SHAPE, hidden_dropout="output_dropout_prob", num_query_groups="num_key_value_heads",
                  kv_channels="head_size", rotary_base="rope_theta", rope_scaling="rope_scaling",
                  qkv_bias="qkv_bias", share_embeddings_and_output_weights="tie_word_embeddings"),
    ),
]
