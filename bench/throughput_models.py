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


# ---------------------------------------------------------------------------------------- MT5
# MT5: encoder length "seq", decoder length "dec" (random_spans_helper's targets length for that encoder:
# 512 -> 114 as in the recipe); "base" is the recipe's mT5-base dims with data_test's WordPiece vocabulary
# plus 100 sentinels, padded (projects/MT5/configs/mt5_pretrain.py, BASELINE.md), for a GPU in bf16.
MT5_SIZES = {
    "smoke": dict(layers=1, hidden=64, heads=2, head_size=32, ffn=128, seq=32, dec=8, vocab=256, micro_batch=2,
                  steps=2, blocks=2, warmup=1),
    "demo": dict(layers=2, hidden=256, heads=4, head_size=64, ffn=512, seq=128, dec=29, vocab=8192, micro_batch=8,
                 steps=2, blocks=11, warmup=2),
    "base": dict(layers=12, hidden=768, heads=12, head_size=64, ffn=2048, seq=512, dec=114, vocab=21248,
                 micro_batch=16, steps=10, blocks=5, warmup=5),
}


def mt5_cfg(shape: dict, fused_cross_entropy: bool = True) -> dict:
    """Our MT5 ``model.cfg`` for a shape (mT5: gated-GELU, untied head), dropout 0 as in the recipe."""
    return dict(vocab_size=shape["vocab"], hidden_size=shape["hidden"], hidden_layers=shape["layers"],
                num_attention_heads=shape["heads"], head_size=shape["head_size"], intermediate_size=shape["ffn"],
                embedding_dropout_prob=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                model_type="mt5", fused_cross_entropy=fused_cross_entropy)


def build_ours_mt5(shape: dict, device: torch.device, fused_cross_entropy: bool = True):
    """Our MT5ForPreTraining (projects/MT5), the model of the recipe."""
    from projects.MT5 import MT5ForPreTraining

    return MT5ForPreTraining(mt5_cfg(shape, fused_cross_entropy)).to(device)


def build_hf_mt5(shape: dict, device: torch.device):
    """``transformers.MT5ForConditionalGeneration`` of the same shape (gated-gelu, untied head, dropout 0)."""
    from transformers import MT5Config, MT5ForConditionalGeneration

    _quiet_transformers()
    config = MT5Config(vocab_size=shape["vocab"], d_model=shape["hidden"], d_kv=shape["head_size"],
                       d_ff=shape["ffn"], num_layers=shape["layers"], num_decoder_layers=shape["layers"],
                       num_heads=shape["heads"], dropout_rate=0.0, feed_forward_proj="gated-gelu",
                       use_cache=False, pad_token_id=0, eos_token_id=1,
                       decoder_start_token_id=0)
    hf = MT5ForConditionalGeneration(config)
    # transformers 5 ties mT5's head to the embedding whatever the config says; mT5 (and ours) does not.
    if hf.lm_head.weight is hf.shared.weight:
        hf.lm_head.weight = torch.nn.Parameter(hf.shared.weight.detach().clone())
    return hf.to(device)


def span_corruption_batch(shape: dict, micro_batch: int, gen: torch.Generator) -> dict:
    """One span-corruption batch as projects/MT5/data/t5_dataset.py lays it out (random tokens, T5's noise
    masks, one sentinel per span from the top of the vocabulary, EOS, right padding with pad 0)."""
    import numpy as np

    from projects.MT5.data.t5_dataset import random_spans_helper, random_spans_noise_mask

    enc_len, dec_len, vocab = shape["seq"], shape["dec"], shape["vocab"]
    raw, _ = random_spans_helper(enc_len)
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
    pad, eos, start, sentinel0 = 0, 1, 0, vocab - 1
    rows = {k: [] for k in ("encoder_input_ids", "decoder_input_ids", "labels", "encoder_attn_mask",
                            "decoder_attn_mask")}
    for _ in range(micro_batch):
        # Some samples shorter than the window, so both masks have padding, as at a document's end.
        length = int(rng.integers(raw * 3 // 4, raw + 1))
        tokens = rng.integers(2, vocab - 100, length)
        noise = random_spans_noise_mask(length, 0.15, 3.0, rng)
        span_start = noise & ~np.concatenate(([False], noise[:-1]))
        sentinels = sentinel0 - np.arange(int(span_start.sum()))
        encoder = tokens.copy()
        encoder[span_start] = sentinels
        encoder = encoder[~noise | span_start]
        labels = np.insert(tokens[noise], np.flatnonzero(span_start[noise]), sentinels)
        n_enc, n_dec = encoder.size + 1, labels.size + 1
        enc = np.full(enc_len, pad)
        enc[:n_enc] = np.append(encoder, eos)
        lab = np.full(dec_len, -100)
        lab[:n_dec] = np.append(labels, eos)
        dec = np.full(dec_len, pad)
        dec[0], dec[1:n_dec] = start, lab[:n_dec - 1]
        for key, value in zip(rows, (enc, dec, lab, np.arange(enc_len) < n_enc, np.arange(dec_len) < n_dec)):
            rows[key].append(torch.from_numpy(np.asarray(value)))
    batch = {k: torch.stack(v) for k, v in rows.items()}
    batch["encoder_decoder_attn_mask"] = batch["encoder_attn_mask"].clone()
    return batch


def _mt5_lookup_weights(hf) -> torch.Tensor:
    """The input embedding and both relative bias tables (lookups, as ours drops them), as one meta tensor
    of their combined size."""
    tables = [m.relative_attention_bias.weight for m in hf.modules() if hasattr(m, "relative_attention_bias")
              and m.relative_attention_bias is not None]
    return torch.empty(hf.shared.weight.numel() + sum(t.numel() for t in tables), device="meta")


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
    # Encoder-decoder families: one batch dict (``make_batch(shape, micro_batch, generator)``), the tokens one
    # sample feeds (encoder plus decoder) and our training FLOPs per such token; None for causal LMs, whose
    # batches are (input_ids, labels) of ``seq`` tokens and whose FLOPs are 6N + 12 L H T.
    make_batch: Callable = None
    tokens_per_sample: Callable = None
    flops_per_token: Callable = None

    def hf_non_embedding_parameters(self, hf) -> int:
        """The reference's parameters less its lookup-only weight."""
        return sum(p.numel() for p in hf.parameters()) - self.hf_lookup_weight(hf).numel()


FAMILIES = {
    "gpt": Family("GPT", "GPT2LMHeadModel", GPT_SIZES, build_ours_gpt, build_hf_gpt,
                  lambda hf: hf.transformer.wpe.weight),
    "llama": Family("Llama", "LlamaForCausalLM", LLAMA_SIZES, build_ours_llama, build_hf_llama,
                    lambda hf: hf.model.embed_tokens.weight),
    "mt5": Family("MT5", "MT5ForConditionalGeneration", MT5_SIZES, build_ours_mt5, build_hf_mt5,
                  _mt5_lookup_weights, make_batch=span_corruption_batch,
                  tokens_per_sample=lambda shape: shape["seq"] + shape["dec"],
                  # MT5Model.flops_per_token counts per encoder token: spread over encoder + decoder tokens.
                  flops_per_token=lambda ours, shape: ours.flops_per_token(shape["seq"], shape["dec"]) * shape["seq"]
                  / (shape["seq"] + shape["dec"])),
}
