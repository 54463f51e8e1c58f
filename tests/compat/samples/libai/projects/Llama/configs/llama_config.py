# LiBai's Llama project: Llama-2-7B's keys (and LiBai's generation settings) for LlamaForCausalLM.
from omegaconf import DictConfig, OmegaConf

from libai.config import LazyCall
from projects.Llama.llama import LlamaForCausalLM
from projects.Llama.tokenizer import LlamaTokenizer
from configs.common.train import train  # noqa: F401

cfg = dict(
    hidden_act="silu",
    hidden_size=4096,
    initializer_range=0.02,
    intermediate_size=11008,
    max_position_embeddings=2048,
    num_attention_heads=32,
    hidden_layers=32,
    pretraining_tp=1,
    rms_norm_eps=1e-05,
    rope_scaling=None,
    tie_word_embeddings=False,
    vocab_size=32000,
    use_scaled_init_for_output_weights=False,
    scale_mask_softmax_fusion=False,
    amp_enabled=True,
    # generation
    is_encoder_decoder=False,
    max_length=256,
    min_length=0,
    do_sample=False,
    num_beams=1,
    temperature=0.9,
    top_k=50,
    top_p=0.6,
    repetition_penalty=1.0,
    use_cache=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    # weights to start from
    pretrained_model_path="meta-llama/Llama-2-7b-hf",
)
cfg = DictConfig(cfg)

model = LazyCall(LlamaForCausalLM)(cfg=cfg)
tokenization = OmegaConf.create()
tokenization.make_vocab_size_divisible_by = 1
tokenization.tokenizer = LazyCall(LlamaTokenizer)()
