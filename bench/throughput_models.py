"""The model-specific half of ``bench/train_throughput.py``: shapes, our model and transformers' of the same shape.

Everything else (stepping, timing, MFU, the report) is shared, so a model is added here as one
``Family``: its sizes, a builder for ours, a builder for the reference, and which of the reference's
weights is a lookup that costs no matmul (dropped from the FLOPs' parameter count, as ours drops it).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch

# GPT: GPT-2's published sizes plus the demo config (projects/GPT/configs/gpt2_pretrain.py).
# Defaults for steps and micro batch are sized to finish in a few minutes on a 2-core CPU;
# the GPU sizes are meant to be run with --device cuda. Short blocks, many of them: on a shared
# machine the load changes within seconds, and a ratio taken over two neighbouring short
# blocks sees nearly the same load on both sides.
GPT_SIZES = {
    "smoke": dict(layers=2, hidden=64, heads=2, seq=32, vocab=128, micro_batch=2, steps=2, blocks=2, warmup=1),
    "demo": dict(layers=4, hidden=256, heads=4, seq=128, vocab=8064, micro_batch=8, steps=2, blocks=15, warmup=2),
    "117M": dict(layers=12, hidden=768, heads=12, seq=1024, vocab=50304, micro_batch=1, steps=1, blocks=7, warmup=1),
    "345M": dict(layers=24, hidden=1024, heads=16, seq=1024, vocab=50304, micro_batch=8, steps=10, blocks=5, warmup=5),
    "1.3B": dict(layers=24, hidden=2048, heads=16, seq=1024, vocab=50304, micro_batch=4, steps=10, blocks=5, warmup=5),
}
# Llama: the demo is projects/Llama/configs/llama_demo.py (vocab: data_test's GPT-2 tokenizer, 8000,
# padded to 128 as the run pads it; tests/bench checks the shape against the config); 100M is a
# GPT-2-small-like depth and width with grouped-query attention and Llama's 32000 vocabulary
# (100M parameters without the input embedding, the N of 6N); 1.1B is TinyLlama's shape
# (projects/Llama/configs/tinyllama_1.1B.py), for a GPU in bf16.
LLAMA_SIZES = {
    "smoke": dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, seq=32, vocab=128, micro_batch=2, steps=2,
                  blocks=2, warmup=1),
    "demo": dict(layers=4, hidden=256, heads=8, kv_heads=4, ffn=688, seq=128, vocab=8064, micro_batch=8, steps=2,
                 blocks=15, warmup=2),
    "100M": dict(layers=12, hidden=768, heads=12, kv_heads=4, ffn=2048, seq=1024, vocab=32000, micro_batch=1, steps=1,
                 blocks=7, warmup=1),
    "1.1B": dict(layers=22, hidden=2048, heads=32, kv_heads=4, ffn=5632, seq=2048, vocab=32000, micro_batch=4,
                 steps=10, blocks=5, warmup=5),
}


def ffn_size(shape: dict) -> int:
    """The feed-forward width: the shape's own, else GPT's 4 x hidden."""
    return shape.get("ffn", 4 * shape["hidden"])


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # bos/eos ids beyond a small vocab are irrelevant here


# ---------------------------------------------------------------------------------------- GPT
def build_ours_gpt(shape: dict, device: torch.device, fused_cross_entropy: bool = True):
    """Our GPTForPreTraining with the demo config's dropout 0 and GPT-2's gelu_tanh."""
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    cfg = dict(hidden_layers=shape["layers"], vocab_size=shape["vocab"], hidden_size=shape["hidden"],
               ffn_hidden_size=ffn_size(shape), num_attention_heads=shape["heads"],
               max_seq_length=shape["seq"], embedding_dropout_prob=0.0, attention_dropout_prob=0.0,
               output_dropout_prob=0.0, activation="gelu_tanh", fused_cross_entropy=fused_cross_entropy)
    return GPTForPreTraining(cfg).to(device)


def build_hf_gpt(shape: dict, device: torch.device):
    """``transformers.GPT2LMHeadModel`` of the same shape, dropout 0, its default attention implementation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet_transformers()
    config = GPT2Config(n_layer=shape["layers"], n_embd=shape["hidden"], n_head=shape["heads"],
                        n_positions=shape["seq"], vocab_size=shape["vocab"], n_inner=ffn_size(shape),
                        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).to(device)


# -------------------------------------------------------------------------------------- Llama
def llama_cfg(shape: dict, fused_cross_entropy: bool = True) -> dict:
    """Our ``model.cfg`` for a shape: projects/Llama/configs/model.py's (the settings every Llama recipe
    starts from: rope theta, RMSNorm epsilon, untied head, no MoE) with the shape's sizes."""
    from projects.Llama.configs.model import cfg as base

    cfg = copy.deepcopy(dict(base))
    cfg.update(hidden_layers=shape["layers"], vocab_size=shape["vocab"], hidden_size=shape["hidden"],
               ffn_hidden_size=ffn_size(shape), num_attention_heads=shape["heads"],
               num_key_value_heads=shape["kv_heads"], max_seq_length=shape["seq"], attention_dropout_prob=0.0,
               output_dropout_prob=0.0, fused_cross_entropy=fused_cross_entropy)
    return cfg


def build_ours_llama(shape: dict, device: torch.device, fused_cross_entropy: bool = True):
    """Our LlamaForPreTraining (RMSNorm, RoPE, grouped-query attention, SwiGLU, untied head)."""
    from projects.Llama.modeling.llama_model import LlamaForPreTraining

    return LlamaForPreTraining(llama_cfg(shape, fused_cross_entropy)).to(device)


def build_hf_llama(shape: dict, device: torch.device):
    """``transformers.LlamaForCausalLM`` of the same shape, its config written by the project's own export
    mapping (``config_to_hf``), so both sides agree on every setting the shape does not name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from projects.Llama.modeling.hf_mapping import config_to_hf

    _quiet_transformers()
    hf_cfg = {k: v for k, v in config_to_hf(llama_cfg(shape)).items() if k not in ("model_type", "architectures")}
    # A training step keeps no key/value cache (the config's use_cache=True is for generation): HF would
    # otherwise build one every forward, work ours does not do.
    hf_cfg.update(use_cache=False, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(LlamaConfig(**hf_cfg)).to(device)


@dataclass(frozen=True)
class Family:
    """One model family of the benchmark: ours against transformers' class of the same shape."""

    label: str
    hf_class: str
    sizes: dict
    build_ours: Callable
    build_hf: Callable
    # The reference's weight that is a lookup only (GPT-2: the position table; Llama: the untied input
    # embedding), so its non-embedding count matches ours.num_parameters(non_embedding=True).
    hf_lookup_weight: Callable

    def hf_non_embedding_parameters(self, hf) -> int:
        """The reference's parameters less its lookup-only weight."""
        return sum(p.numel() for p in hf.parameters()) - self.hf_lookup_weight(hf).numel()


FAMILIES = {
    "gpt": Family("GPT", "GPT2LMHeadModel", GPT_SIZES, build_ours_gpt, build_hf_gpt,
                  lambda hf: hf.transformer.wpe.weight),
    "llama": Family("Llama", "LlamaForCausalLM", LLAMA_SIZES, build_ours_llama, build_hf_llama,
                    lambda hf: hf.model.embed_tokens.weight),
}
