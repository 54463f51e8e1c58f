#!/usr/bin/env python
"""Megatron-LM GPT checkpoints into this project's checkpoints (weights), then trained on any layout.

    python tools/convert_checkpoint.py --from megatron --input megatron_ckpt --output checkpoints/gpt_from_megatron \\
        [--iteration N] [--vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt]
    bash tools/train.sh tools/train_net.py checkpoints/gpt_from_megatron/config.py 1 dataloader.train.data_prefix=...

Files are loaded with ``torch.load(weights_only=False)``: convert only checkpoints you trust.
The layouts it reads and what it writes: docs/tools.md#convert_checkpoint.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

import torch

from compat.checkpoints import checkpoint_format, megatron_iteration_dir
from libai_lite.utils.errors import UsageError
from libai_lite.utils.paths import check_outputs

_LEGACY_FILE = "model_optim_rng.pt"
# Megatron's (legacy) layer-local names -> how tensor-parallel shards join: 0 rows, 1 columns, None replicated.
_SPLIT_DIM = {"query_key_value": 0, "dense_h_to_4h": 0, "dense_4h_to_h": 1, "self_attention.dense": 1,
              "attention.dense": 1, "word_embeddings": 0}


def _iteration_dir(path: str, iteration) -> str:
    return megatron_iteration_dir(path, iteration)


def _load(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - torch.load has many failure types; one line names the file
        raise UsageError(f"{path} cannot be read as a Megatron-LM checkpoint file ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]})") from None


def _legacy_shards(step_dir: str) -> tuple:
    """{(tp, pp): state dict} of a legacy iteration directory."""
    shards = {}
    for sub in sorted(os.listdir(step_dir)):
        m = re.fullmatch(r"mp_rank_(\d\d)(?:_(\d\d\d))?", sub)
        if m and os.path.isfile(os.path.join(step_dir, sub, _LEGACY_FILE)):
            shards[(int(m.group(1)), int(m.group(2) or 0))] = _load(os.path.join(step_dir, sub, _LEGACY_FILE))
    if not shards:
        raise UsageError(f"{step_dir} holds no mp_rank_XX/{_LEGACY_FILE}: it is not a Megatron-LM legacy iteration "
                         f"directory (pass the checkpoint directory, or --iteration N)")
    tps = sorted({t for t, _ in shards})
    pps = sorted({p for _, p in shards})
    if tps != list(range(len(tps))) or pps != list(range(len(pps))) or len(shards) != len(tps) * len(pps):
        raise UsageError(f"{step_dir} is missing shards: found {sorted(shards)}; copy every mp_rank_* folder")
    return shards, len(tps), len(pps)


def _language_model(sd: dict) -> dict:
    model = sd.get("model", sd)
    if "model0" in sd:
        raise UsageError("this Megatron-LM checkpoint uses virtual pipeline stages (model0, model1, ...); convert it "
                         "to one stage per rank with Megatron's tools/checkpoint/convert.py first")
    lm = model.get("language_model", model)
    return lm


def _flat_legacy(lm: dict) -> dict:
    """Megatron legacy names flattened: embedding.word_embeddings.weight, encoder.layers.0..., final_layernorm..."""
    out = {}
    emb = lm.get("embedding", {})
    for name, sub in emb.items():
        for k, v in sub.items():
            out[f"embedding.{name}.{k}"] = v
    stack = lm.get("encoder", lm.get("transformer", {}))
    for k, v in stack.items():
        out[f"encoder.{k}".replace(".attention.", ".self_attention.")] = v
    if "output_layer" in lm:
        out["output_layer.weight"] = lm["output_layer"]["weight"]
    return out


def _merge_tp(shards: list) -> dict:
    merged = {}
    for key in shards[0]:
        tensors = [s[key] for s in shards]
        dim = next((d for name, d in _SPLIT_DIM.items() if name in key), None)
        if key.endswith(".bias") and dim == 1:
            dim = None  # a row-parallel layer's bias is whole on every rank
        if key.startswith("output_layer"):
            dim = 0
        merged[key] = torch.cat(tensors, dim=dim) if dim is not None and len(tensors) > 1 else tensors[0]
    return merged


def read_megatron_legacy(path: str, iteration=None) -> tuple:
    """(one process's flat Megatron state dict, args, checkpoint_version, iteration) of a legacy checkpoint."""
    step = _iteration_dir(path, iteration)
    if not os.path.isdir(step):
        raise UsageError(f"{step} does not exist; pass --iteration with one of the checkpoint's iter_* folders")
    shards, tp, pp = _legacy_shards(step)
    first = shards[(0, 0)]
    args = first.get("args")
    layers_per_stage = None
    merged = {}
    for stage in range(pp):
        stage_sd = _merge_tp([_flat_legacy(_language_model(shards[(t, stage)])) for t in range(tp)])
        local = sorted({int(m.group(1)) for k in stage_sd if (m := re.match(r"encoder\.layers\.(\d+)\.", k))})
        layers_per_stage = layers_per_stage or len(local)
        for key, value in stage_sd.items():
            m = re.match(r"encoder\.layers\.(\d+)\.(.*)", key)
            if m:  # legacy layer numbers restart on every pipeline stage
                key = f"encoder.layers.{int(m.group(1)) + stage * layers_per_stage}.{m.group(2)}"
            merged.setdefault(key, value)
    return merged, args, float(first.get("checkpoint_version", 0)), first.get("iteration")


_MCORE = {
    "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "decoder.final_layernorm.weight": "encoder.final_layernorm.weight",
    "decoder.final_layernorm.bias": "encoder.final_layernorm.bias",
    "output_layer.weight": "output_layer.weight",
}
_MCORE_LAYER = {
    "input_layernorm": "input_layernorm", "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "self_attention.linear_qkv": "self_attention.query_key_value", "self_attention.linear_proj": "self_attention.dense",
    "pre_mlp_layernorm": "post_attention_layernorm",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
    "mlp.linear_fc1": "mlp.dense_h_to_4h", "mlp.linear_fc2": "mlp.dense_4h_to_h",
}


def read_megatron_torch_dist(path: str, iteration=None) -> tuple:
    """(flat legacy-named state dict, args, 3.0, iteration) of a Megatron core ``torch_dist`` checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = _iteration_dir(path, iteration)
    if not os.path.isfile(os.path.join(step, ".metadata")):
        raise UsageError(f"{step} has no .metadata: not a complete torch_dist checkpoint")
    common = _load(os.path.join(step, "common.pt")) if os.path.isfile(os.path.join(step, "common.pt")) else {}
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(step, os.path.join(tmp, "full.pt"))
        raw = torch.load(os.path.join(tmp, "full.pt"), map_location="cpu", weights_only=False)
    flat = {}
    for key, value in raw.items():
        key = key.removeprefix("model.").removeprefix("module.")
        if not isinstance(value, torch.Tensor) or key.endswith("_extra_state"):
            continue
        if key in _MCORE:
            flat[_MCORE[key]] = value
            continue
        m = re.match(r"decoder\.layers\.(?:(\d+)\.)?(.*)\.(weight|bias|layer_norm_weight|layer_norm_bias)$", key)
        if m is None:
            continue
        name = f"{m.group(2)}.{m.group(3)}"
        target = _MCORE_LAYER.get(name) or f"{_MCORE_LAYER.get(m.group(2), m.group(2))}.{m.group(3)}"
        # Megatron core stacks a homogeneous block's layers into one tensor with a leading layer axis.
        layers = [(int(m.group(1)), value)] if m.group(1) is not None else list(enumerate(value.unbind(0)))
        for i, tensor in layers:
            flat[f"encoder.layers.{i}.{target}"] = tensor
    return flat, common.get("args"), 3.0, common.get("iteration")


def _qkv_to_hf(w: torch.Tensor, heads: int, version: float) -> torch.Tensor:
    """Megatron's fused q/k/v rows (per head [q, k, v] from version 2 on, [d, 3] interleaved in version 1) as
    GPT-2's ``[q; k; v]``."""
    rest = w.shape[1:]
    d = w.shape[0] // (3 * heads)
    per_head = w.view(heads, 3, d, *rest) if version >= 2.0 else w.view(heads, d, 3, *rest).transpose(1, 2)
    return per_head.transpose(0, 1).reshape(3 * heads * d, *rest)


def to_hf_gpt2(flat: dict, args, version: float) -> tuple:
    """(GPT-2 config.json dict, GPT-2 state dict) of a merged Megatron GPT."""
    if args is None:
        raise UsageError("the checkpoint has no saved args (model sizes); it was not written by Megatron-LM's "
                         "pretrain_gpt.py")
    if "output_layer.weight" in flat and not torch.equal(flat["output_layer.weight"],
                                                         flat["embedding.word_embeddings.weight"]):
        raise UsageError("this Megatron GPT has an untied output layer (--untie-embeddings-and-output-weights); "
                         "the GPT project ties its LM head to the embedding")
    heads, layers = int(args.num_attention_heads), int(args.num_layers)
    hidden = int(args.hidden_size)
    sd = {"transformer.wte.weight": flat["embedding.word_embeddings.weight"],
          "transformer.wpe.weight": flat["embedding.position_embeddings.weight"],
          "transformer.ln_f.weight": flat["encoder.final_layernorm.weight"],
          "transformer.ln_f.bias": flat["encoder.final_layernorm.bias"]}
    for i in range(layers):
        m, h = f"encoder.layers.{i}.", f"transformer.h.{i}."
        missing = [k for k in ("input_layernorm.weight", "self_attention.query_key_value.weight") if m + k not in flat]
        if missing:
            raise UsageError(f"the checkpoint has no {m + missing[0]}: its layers do not match num_layers={layers}")
        sd[h + "ln_1.weight"] = flat[m + "input_layernorm.weight"]
        sd[h + "ln_1.bias"] = flat[m + "input_layernorm.bias"]
        sd[h + "attn.c_attn.weight"] = _qkv_to_hf(flat[m + "self_attention.query_key_value.weight"], heads, version).t()
        sd[h + "attn.c_attn.bias"] = _qkv_to_hf(flat[m + "self_attention.query_key_value.bias"], heads, version)
        sd[h + "attn.c_proj.weight"] = flat[m + "self_attention.dense.weight"].t()
        sd[h + "attn.c_proj.bias"] = flat[m + "self_attention.dense.bias"]
        sd[h + "ln_2.weight"] = flat[m + "post_attention_layernorm.weight"]
        sd[h + "ln_2.bias"] = flat[m + "post_attention_layernorm.bias"]
        sd[h + "mlp.c_fc.weight"] = flat[m + "mlp.dense_h_to_4h.weight"].t()
        sd[h + "mlp.c_fc.bias"] = flat[m + "mlp.dense_h_to_4h.bias"]
        sd[h + "mlp.c_proj.weight"] = flat[m + "mlp.dense_4h_to_h.weight"].t()
        sd[h + "mlp.c_proj.bias"] = flat[m + "mlp.dense_4h_to_h.bias"]
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": hidden, "n_head": heads,
              "n_layer": layers, "n_positions": int(args.max_position_embeddings),
              "n_inner": int(getattr(args, "ffn_hidden_size", None) or 4 * hidden),
              "vocab_size": int(sd["transformer.wte.weight"].shape[0]),
              "layer_norm_epsilon": float(getattr(args, "layernorm_epsilon", 1e-5)),
              "activation_function": "gelu_new",
              "resid_pdrop": float(getattr(args, "hidden_dropout", 0.1)),
              "embd_pdrop": float(getattr(args, "hidden_dropout", 0.1)),
              "attn_pdrop": float(getattr(args, "attention_dropout", 0.1))}
    return config, {k: v.detach().float().contiguous() for k, v in sd.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Convert a Megatron-LM GPT checkpoint into a libai_lite checkpoint.")
    parser.add_argument("--from", dest="source", required=True, choices=["megatron"], help="the checkpoint's format")
    parser.add_argument("--input", required=True, help="the checkpoint directory (Megatron's --save)")
    parser.add_argument("--output", required=True, help="the new checkpoint directory")
    parser.add_argument("--iteration", default=None, help="iteration to convert (default: the latest)")
    parser.add_argument("--vocab-file", help="GPT-2 vocab.json the run used (copied as the checkpoint's tokenizer)")
    parser.add_argument("--merge-file", help="GPT-2 merges.txt the run used")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    parser.add_argument("--force", action="store_true", help="replace an existing --output")
    args = parser.parse_args(argv)
    try:
        check_outputs([args.output], [args.input, args.vocab_file, args.merge_file], option="--output",
                      directory=True)
        kind = checkpoint_format(args.input)
        if kind == "libai":
            raise UsageError(f"{args.input} is a LiBai (OneFlow) checkpoint: OneFlow's tensor folders cannot be read "
                             f"without OneFlow; export it to Hugging Face with LiBai, then python tools/hf_convert.py "
                             f"import --hf-dir DIR --output {args.output}")
        if kind == "ours":
            raise UsageError(f"{args.input} is already a libai_lite checkpoint: set train.load_weight={args.input}")
        if not kind:
            raise UsageError(f"{args.input} is not a Megatron-LM checkpoint directory (no "
                             f"latest_checkpointed_iteration.txt, iter_* or mp_rank_* folders)")
        reader = read_megatron_torch_dist if kind == "megatron-torch_dist" else read_megatron_legacy
        flat, margs, version, iteration = reader(args.input, args.iteration)
        config, sd = to_hf_gpt2(flat, margs, version)
        with tempfile.TemporaryDirectory() as hf_dir:
            from libai_lite.checkpoint.hf_io import write_hf_dir

            write_hf_dir(hf_dir, config, sd)
            for src, name in ((args.vocab_file, "vocab.json"), (args.merge_file, "merges.txt")):
                if src:
                    with open(src, "rb") as f_in, open(os.path.join(hf_dir, name), "wb") as f_out:
                        f_out.write(f_in.read())
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import hf_convert

            code = hf_convert.main(["import", "--model", "gpt2", "--hf-dir", hf_dir, "--output", args.output,
                                    "--make-vocab-size-divisible-by", str(args.make_vocab_size_divisible_by)]
                                   + (["--force"] if args.force else []))
        if code == 0:
            print(f"Converted the {kind} checkpoint {args.input} (iteration {iteration}, checkpoint_version "
                  f"{version}) into {args.output}")
        return code
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
