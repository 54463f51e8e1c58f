#!/usr/bin/env python
"""Hugging Face weights in and out of libai_lite checkpoints.

    # a transformers directory (config.json + model.safetensors / pytorch_model.bin) -> a DCP checkpoint
    python tools/hf_convert.py import --model gpt2 --hf-dir gpt2/ --output checkpoints/gpt2_hf
    bash tools/train.sh tools/train_net.py checkpoints/gpt2_hf/config.py 1 dataloader.train.data_prefix=...
    # a checkpoint of any parallel layout -> a directory transformers' from_pretrained loads
    python tools/hf_convert.py export --config-file output/gpt2_pretrain/config.yaml \\
        --checkpoint output/gpt2_pretrain/model_final --output hf/gpt2_demo

Bad input ends with one `error: ...` line and exit status 1; nothing is left half-written.
Your own project's models, and what each command writes: docs/tools.md#hf_convert.
"""
from __future__ import annotations

import argparse
import os
import pprint
import sys
import warnings

from libai_lite.utils.errors import UsageError
from libai_lite.utils.paths import check_outputs


def register_builtin_projects() -> None:
    """Import the projects that ship with libai_lite, whose modeling packages register their mappings."""
    import projects.GPT.modeling  # noqa: F401
    import projects.Llama.modeling  # noqa: F401
    import projects.MT5  # noqa: F401


def build_parser() -> argparse.ArgumentParser:
    """The two subcommands, each with its own --help."""
    parser = argparse.ArgumentParser(description="Convert weights between Hugging Face transformers and libai_lite.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{import,export}")

    imp = sub.add_parser(
        "import", help="Hugging Face directory -> libai_lite DCP checkpoint plus a fine-tuning config",
        description="Read a Hugging Face model directory (config.json and model.safetensors, a sharded "
                    "model.safetensors.index.json, or pytorch_model.bin loaded with weights_only) and write a "
                    "DCP checkpoint that train.load_weight=OUTPUT loads, with OUTPUT/config.py ready to train. "
                    "The vocabulary is padded the way the trainer pads it (mean rows for the new ids).",
    )
    imp.add_argument("--model", metavar="TYPE",
                     help="Hugging Face model_type of the directory (gpt2, t5, mt5, llama, mistral, qwen2, qwen3, "
                          "qwen3_moe, mixtral or one your project registers; default: config.json's)")
    imp.add_argument("--config-file", metavar="FILE",
                     help="a training config of your own project: its model class's registered mapping converts "
                          "the weights and the fine-tuning config starts from it (default: the built-in project "
                          "that reads the model type)")
    imp.add_argument("--hf-dir", required=True, help="Hugging Face model directory")
    imp.add_argument("--output", required=True, help="checkpoint directory to create")
    imp.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="tensor-parallel size the generated fine-tuning config sets (default 1); the "
                          "vocabulary is padded to a multiple of --make-vocab-size-divisible-by whatever it is")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                     help="tokenization.make_vocab_size_divisible_by of the fine-tuning run (default 128)")
    imp.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")

    exp = sub.add_parser(
        "export", help="libai_lite checkpoint (any parallel layout) -> Hugging Face directory",
        description="Load a checkpoint saved under any layout (tp, pp, ZeRO) into a one-process model and write "
                    "config.json, generation_config.json and model.safetensors for transformers' from_pretrained "
                    "(GPT2LMHeadModel, T5ForConditionalGeneration, MT5ForConditionalGeneration, LlamaForCausalLM, "
                    "Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM). The vocabulary size "
                    "comes from the checkpoint; when the config names a tokenizer, the padded rows are cut to its real "
                    "vocabulary and its files are copied (a tokenizer.json with a tokenizer_config.json that "
                    "AutoTokenizer loads). Before the directory is kept, transformers (when installed) loads it, and its "
                    "logits on a probe batch must be the checkpoint model's: an export transformers would run as another "
                    "model is refused.",
    )
    exp.add_argument("--config-file", required=True,
                     help="the run's config (its output config.yaml, or the .py); its model class's registered "
                          "mapping writes the directory")
    exp.add_argument("--checkpoint", required=True, help="checkpoint directory (e.g. OUTPUT_DIR/model_final)")
    exp.add_argument("--output", required=True, help="Hugging Face directory to create")
    exp.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    exp.add_argument("--no-verify", action="store_true",
                     help="load --checkpoint without checking its files against the checksums in its manifest.json")
    exp.add_argument("opts", nargs=argparse.REMAINDER, default=[],
                     help="config overrides, as for train_net.py (e.g. model.cfg.hidden_layers=6)")
    return parser


# ------------------------------------------------------------------------------------ import

_BASE_NAMES = ("dataloader", "model", "optim", "tokenization", "train")


def load_model_config(config_file: str, opts=()):
    """``(cfg, model class)`` of a training config; importing the class registers its project's mapping."""
    from libai_lite.config import LazyConfig
    from libai_lite.config.instantiate import instantiate_target

    try:
        cfg = LazyConfig.load(config_file)
    except FileNotFoundError as e:
        raise UsageError(f"config file {config_file} not found; pass the run's config.yaml or its .py") from e
    cfg = LazyConfig.apply_overrides(cfg, list(opts))
    if "model" not in cfg or "_target_" not in cfg.model or "cfg" not in cfg.model:
        raise UsageError(f"{config_file} has no model = LazyCall(...)(cfg=...); pass a training config")
    target = cfg.model._target_
    try:
        return cfg, instantiate_target(cfg.model)
    except ImportError as e:
        raise UsageError(f"{config_file}: model._target_ {target!r} cannot be imported ({e})") from e


def _finetune_config(mapping, cfg: dict, tokenizer, args, output: str) -> str:
    """Source of OUTPUT/config.py: the base config (--config-file or the project's) with this model's cfg,
    weights and tokenizer."""
    tp, divisible_by = args.tensor_parallel_size, args.make_vocab_size_divisible_by
    lines = [
        f'"""Fine-tune the Hugging Face weights imported from {os.path.abspath(args.hf_dir)}',
        "(written by tools/hf_convert.py import; train.load_weight is this directory).",
        "",
        f"    bash tools/train.sh tools/train_net.py {os.path.join(output, 'config.py')} 1 \\",
        "        dataloader.train.data_prefix=YOUR_CORPUS_text_document",
        "",
        "Point dataloader.train.data_prefix at a corpus preprocessed with this tokenizer",
        "(tools/preprocess_data.py). The vocabulary was padded as the trainer pads it, to a multiple of",
        f"make_vocab_size_divisible_by={divisible_by} whatever the layout: any tensor_parallel_size that",
        "divides it trains this checkpoint.",
        '"""',
        "import os",
        "",
        "from libai_lite.config import LazyCall, LazyConfig  # noqa: F401",
    ]
    if tokenizer is not None:
        lines.append(tokenizer.import_line)
    if args.config_file:
        lines += ["", f"_base = LazyConfig.load({os.path.abspath(args.config_file)!r})",
                  f"{', '.join(_BASE_NAMES)} = (_base[k] for k in {_BASE_NAMES!r})"]
    else:
        lines.append(f"from {mapping.finetune_config} import {', '.join(_BASE_NAMES)}")
    lines += [
        "",
        "_here = os.path.dirname(os.path.abspath(__file__))",
        "",
        "model.cfg.update(",
        *[f"    {k}={v!r}," for k, v in cfg.items()],
        ")",
    ]
    if tokenizer is not None:
        lines.append(f"tokenization.tokenizer = {tokenizer.lazy_call}")
    else:
        lines += ["# The Hugging Face directory had no tokenizer files: set the tokenizer this model was trained with.",
                  "tokenization.tokenizer = None"]
    lines.append(f"tokenization.make_vocab_size_divisible_by = {divisible_by}")
    dist = f"data_parallel_size=None, tensor_parallel_size={tp}, pipeline_parallel_size=1"
    if mapping.pipeline_num_layers is not None:
        dist += f", pipeline_num_layers={mapping.pipeline_num_layers(cfg)}"
    lines += [
        f"train.dist.update({dist})",
        "train.load_weight = _here",
        f'train.output_dir = "output/{os.path.basename(os.path.normpath(output))}_finetune"',
        "",
    ]
    return "\n".join(lines)


def check_tensor_parallel(model_class, cfg: dict, padded: int, args) -> None:
    """Refuse a --tensor-parallel-size the fine-tuning run would refuse: it must divide every dimension the model's
    layers split (heads, key/value heads, feed-forward rows) and the padded vocabulary. Built on ``meta``."""
    import torch

    from libai_lite.parallel.tensor_parallel import check_declared_splits

    tp, divisible_by = args.tensor_parallel_size, args.make_vocab_size_divisible_by
    # The vocabulary is checked apart, to name this tool's option: here it is a size every tp divides.
    with torch.device("meta"):
        model = model_class({**cfg, "vocab_size": padded * tp})
    try:
        check_declared_splits(model, tp, cfg)
    except UsageError as e:
        raise UsageError(f"--tensor-parallel-size {tp} would write a config that cannot train: {e}") from None
    if padded % tp:
        raise UsageError(f"--tensor-parallel-size {tp} does not divide the {padded} vocabulary rows (padded to a "
                         f"multiple of --make-vocab-size-divisible-by {divisible_by}); give a "
                         f"--make-vocab-size-divisible-by that is a multiple of {tp}, or a --tensor-parallel-size "
                         f"that divides {padded}")


def cmd_import(args) -> int:
    """Hugging Face directory -> DCP checkpoint + config.py."""
    import shutil

    from libai_lite.checkpoint import Checkpointer
    from libai_lite.checkpoint.hf import (
        detect_model_type,
        load_hf_model,
        mapping_for_model,
        mapping_for_type,
        read_hf_config,
    )
    from libai_lite.checkpoint.hf_io import check_output_dir, staged_output_dir
    from libai_lite.tokenizer import pad_vocab_size

    check_outputs([args.output], [args.hf_dir, args.config_file], option="--output", directory=True)
    for name in ("tensor_parallel_size", "make_vocab_size_divisible_by"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}={getattr(args, name)} must be a positive integer")
    check_output_dir(args.output, args.force)
    mapping = model_class = None
    if args.config_file:
        base, model_class = load_model_config(args.config_file)
        missing = [k for k in _BASE_NAMES if k not in base]
        if missing:
            raise UsageError(f"{args.config_file} has no {missing[0]}; pass a training config "
                             f"(with {', '.join(_BASE_NAMES)}) to start the fine-tuning config from")
        mapping = mapping_for_model(model_class)
    else:
        register_builtin_projects()
        if args.model is not None:
            mapping_for_type(args.model)  # an unknown type is refused before the directory is read
    hf_config = read_hf_config(args.hf_dir)
    model_type, mapping = detect_model_type(hf_config, args.model, args.hf_dir, mapping)
    if not args.config_file and mapping.finetune_config is None:
        raise UsageError(f"{mapping.model_class.__name__} names no project config to fine-tune from; "
                         f"pass --config-file of a training config of it")
    tokenizer = mapping.find_tokenizer(args.hf_dir)
    hf_vocab = int(mapping.config_from_hf(hf_config)["vocab_size"])
    tok_vocab = tokenizer.tokenizer.vocab_size if tokenizer is not None else 0
    # What the trainer will build: the tokenizer's size padded (never fewer rows than the weights).
    padded = pad_vocab_size(max(hf_vocab, tok_vocab), args.make_vocab_size_divisible_by)
    check_tensor_parallel(model_class or mapping.model_class, mapping.config_from_hf(hf_config), padded, args)
    model_type, cfg, module = load_hf_model(args.hf_dir, model_type, vocab_size=padded,
                                            model_class=model_class or mapping.model_class)

    output = os.path.abspath(args.output)
    with staged_output_dir(output, args.force, promote="checkpoint") as tmp:
        state = {"iteration": -1, "consumed_samples": 0, "imported_from": os.path.abspath(args.hf_dir),
                 "hf_model_type": model_type}
        ckpt = Checkpointer(module, save_dir=tmp, retry="give --output another path").save("checkpoint", state)
        for name, src in (tokenizer.files.items() if tokenizer is not None else ()):
            shutil.copyfile(src, os.path.join(ckpt, name))
        with open(os.path.join(ckpt, "config.py"), "w", encoding="utf-8") as f:
            f.write(_finetune_config(mapping, cfg, tokenizer, args, output))

    print(f"Imported {model_type} weights from {args.hf_dir} into {output} ({type(module).__name__})")
    print(f"vocabulary: {hf_vocab} rows in the weights, tokenizer "
          f"{tok_vocab if tokenizer is not None else 'not found'}, padded to {padded}")
    print("model.cfg:")
    print(pprint.pformat(cfg, sort_dicts=False))
    print(f"Fine-tune: bash tools/train.sh tools/train_net.py {os.path.join(output, 'config.py')} 1 "
          f"dataloader.train.data_prefix=YOUR_CORPUS_text_document   (or train.load_weight={output} in your config)")
    return 0


# ------------------------------------------------------------------------------------ export


def cmd_export(args) -> int:
    """DCP checkpoint -> Hugging Face directory, through the mapping of the config's model class."""
    from omegaconf import OmegaConf, open_dict

    from libai_lite.checkpoint import Checkpointer
    from libai_lite.checkpoint.dcp_io import build_empty
    from libai_lite.checkpoint.hf import (
        check_hf_export,
        checkpoint_vocab_size,
        export_probe,
        mapping_for_model,
        save_hf_model,
    )
    from libai_lite.checkpoint.hf_io import check_output_dir, staged_output_dir
    from libai_lite.checkpoint.integrity import read_metadata
    from libai_lite.config import instantiate

    check_outputs([args.output], [args.checkpoint, args.config_file], option="--output", directory=True)
    check_output_dir(args.output, args.force)
    read_metadata(args.checkpoint)  # a missing or corrupt checkpoint is refused before the config is read
    cfg, model_class = load_model_config(args.config_file, [o for o in args.opts if o != "--"])
    mapping_for_model(model_class)  # a class without a mapping is refused before the checkpoint is read
    model_cfg = OmegaConf.to_container(cfg.model.cfg, resolve=True)
    # The vocabulary the run padded to (a run before padding stopped depending on tp: 256 at tp=2), not a fresh one.
    model_cfg["vocab_size"] = checkpoint_vocab_size(args.checkpoint, model_class)
    module = build_empty(lambda: model_class(dict(model_cfg)))
    # With model.cfg, a shape refusal names the key that differs (model.cfg.hidden_size=...).
    Checkpointer(module, model_config=model_cfg, verify=not args.no_verify).load(args.checkpoint, weights_only=True)

    tokenizer = None
    tok_cfg = cfg.get("tokenization")
    if tok_cfg is not None and tok_cfg.get("tokenizer") is not None:
        try:
            with open_dict(cfg):
                tokenizer = instantiate(tok_cfg.tokenizer)
        except Exception as e:  # noqa: BLE001 - any failure here is a tokenizer path the user must fix
            cause = e
            while cause.__cause__ is not None:
                cause = cause.__cause__
            raise UsageError(f"the config's tokenization.tokenizer cannot be built ({' '.join(str(cause).split())}); "
                             f"run from the directory its paths start at, override tokenization.tokenizer.*, "
                             f"or pass tokenization.tokenizer=null to keep the padded vocabulary") from e
    vocab = tokenizer.vocab_size if tokenizer is not None else None
    with staged_output_dir(args.output, args.force) as tmp:
        hf_config, notes = save_hf_model(module, model_cfg, tmp, vocab_size=vocab, tokenizer=tokenizer)
        probe = export_probe(module, hf_config)
        del module  # transformers loads the export next: one model in memory at a time
        notes.append(check_hf_export(tmp, hf_config, probe, model_class))
    print(f"Exported {args.checkpoint} ({model_class.__name__}) to {os.path.abspath(args.output)} as "
          f"{hf_config['architectures'][0]} (model_type {hf_config['model_type']})")
    kept = "cut to the tokenizer's" if vocab is not None else "kept as in the checkpoint (no tokenizer in the config):"
    print(f"vocabulary: {model_cfg['vocab_size']} rows in the checkpoint, {kept} {hf_config['vocab_size']}")
    for note in notes:
        print(f"note: {note}")
    return 0


def main(argv=None) -> int:
    """Run a subcommand; a user error prints one `error:` line and returns 1."""
    args = build_parser().parse_args(argv)
    # DCP says it runs in one process, which is what a conversion does.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    try:
        return cmd_import(args) if args.command == "import" else cmd_export(args)
    except UsageError as e:
        if os.environ.get("LIBAI_LITE_TRACEBACK"):
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
