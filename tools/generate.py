#!/usr/bin/env python
"""Generate text with a trained checkpoint or a Hugging Face model directory.

    python tools/generate.py --config-file projects/GPT/configs/gpt2_pretrain.py \\
        --checkpoint output/gpt2_pretrain/model_final --prompt "The history of" --max-new-tokens 40
    torchrun --nproc_per_node 2 tools/generate.py --config-file projects/GPT/configs/gpt2_pretrain.py \\
        --checkpoint output/gpt2_pretrain/model_final --prompt "The history of" train.dist.tensor_parallel_size=2
    python tools/generate.py --hf-dir ./gpt2 --prompt "Hello" --do-sample --top-p 0.9 --seed 1

With a config, the model is built from ``model`` (after the ``key=value`` overrides) with the
vocabulary size of the checkpoint's embedding (older versions padded it to a multiple of 256 at
tensor_parallel_size=2), and the tokenizer from ``tokenization.tokenizer``. Under torchrun the model is
split tensor-parallel over all processes; rank 0 prints.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

import torch

from libai_lite.utils.errors import UsageError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    """The command line (``--help`` lists it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("model (one of)")
    src.add_argument("--config-file", metavar="FILE", help="lazy config the checkpoint was trained with")
    src.add_argument("--checkpoint", metavar="DIR", help="a checkpoint directory (model_XXXXXXX, model_final) of that config")
    src.add_argument("--hf-dir", metavar="DIR", help="a Hugging Face model directory (config.json + weights)")
    src.add_argument("--no-verify", action="store_true",
                     help="load --checkpoint without checking its files against the checksums in its manifest.json")
    src.add_argument("--model", choices=("gpt2", "t5", "mt5", "llama", "mistral", "qwen2", "qwen3", "mixtral"),
                     help="model type of --hf-dir (default: from its config.json)")
    tok = p.add_argument_group("tokenizer (default: the config's, or the files in --hf-dir)")
    tok.add_argument("--vocab-file", metavar="FILE", help="GPT-2 vocab.json")
    tok.add_argument("--merges-file", metavar="FILE", help="GPT-2 merges.txt")
    tok.add_argument("--spm-model", metavar="FILE", help="SentencePiece model (T5/mT5 spiece.model, T5's 100 sentinels)")
    inp = p.add_argument_group("prompts")
    inp.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    inp.add_argument("--prompt-file", metavar="FILE", help='one prompt per line, or JSON lines with a "text" field')
    inp.add_argument("--prompt-ids", action="append", default=[], metavar='"1 2 3"',
                     help="a prompt as token ids separated by spaces (repeatable)")
    gen = p.add_argument_group("decoding")
    gen.add_argument("--max-new-tokens", type=int, default=32, metavar="N")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--greedy", dest="do_sample", action="store_false", help="argmax decoding (default)")
    mode.add_argument("--do-sample", dest="do_sample", action="store_true", help="sample from the processed distribution")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="nucleus: keep the most likely tokens up to this probability mass (1: off)")
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (same on every rank)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="CTRL's penalty on tokens already present (1: off)")
    gen.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    gen.add_argument("--no-cache", dest="use_cache", action="store_false", help="re-read the whole sequence every step")
    gen.add_argument("--show-ids", action="store_true", help="also print the generated token ids")
    run = p.add_argument_group("run")
    run.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: the GPU of this rank when there is one)")
    run.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="weights and activations")
    p.add_argument("opts", nargs="*", metavar="key=value", help="config overrides (Hydra grammar), as for train_net.py")
    p.set_defaults(do_sample=False)
    return p


# ------------------------------------------------------------------------------- prompts


def read_prompts(args) -> list:
    """Every prompt given, in order: a text (``str``) or a list of token ids. Checked before any model loads."""
    prompts = list(args.prompt)
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            raise UsageError(f"--prompt-file {args.prompt_file} not found; give a text file with one prompt per line")
        with open(args.prompt_file, "rb") as f:
            for n, raw in enumerate(f, 1):
                # Decoded line by line, so a file that is not text is named with the line where it stops being so.
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError:
                    line = None
                if line is None or "\x00" in line:
                    raise UsageError(f"--prompt-file {args.prompt_file} line {n} is not UTF-8 text (a binary file?); "
                                     f"give a UTF-8 text file with one prompt per line, or JSON lines with a "
                                     f"\"text\" field")
                if not line.strip():
                    continue
                if line.lstrip().startswith("{"):
                    try:
                        line = json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise UsageError(f"{args.prompt_file} line {n} is not a JSON object with a \"text\" field; "
                                         f"write one prompt per line or JSON lines like {{\"text\": \"...\"}}") from None
                prompts.append(line)
    for raw in args.prompt_ids:
        try:
            prompts.append([int(t) for t in raw.replace(",", " ").split()])
        except ValueError:
            raise UsageError(f"--prompt-ids {raw!r} is not a list of integers; "
                             f"write e.g. --prompt-ids \"464 2068 7586\"") from None
    if not prompts:
        raise UsageError("no prompt given; pass --prompt TEXT, --prompt-file FILE or --prompt-ids \"1 2 3\"")
    return prompts


def encode_prompts(prompts: list, tokenizer, vocab_size: int) -> list[tuple[str, list[int]]]:
    """``(shown text, ids)`` for each prompt of ``read_prompts``.

    A text starts with the tokenizer's BOS when the tokenizer adds one (a Llama-family ``tokenizer.json``), as
    transformers' ``tokenizer(prompt)`` does: those models saw BOS at the start of every training document.
    ``--prompt-ids`` are taken as given.
    """
    bos = [tokenizer.bos_token_id] if tokenizer is not None and tokenizer.add_bos_token else []
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise UsageError("text prompts need a tokenizer; give --vocab-file/--merges-file or --spm-model, "
                                 "or use --prompt-ids")
            out.append((prompt, bos + list(tokenizer.encode(prompt))))
        else:
            bad = [i for i in prompt if not 0 <= i < vocab_size]
            if bad:
                raise UsageError(f"--prompt-ids holds {bad[0]}, outside the vocabulary [0, {vocab_size}); "
                                 f"use ids of this model's tokenizer")
            out.append((tokenizer.decode(prompt) if tokenizer is not None else " ".join(map(str, prompt)), prompt))
        if not out[-1][1]:
            raise UsageError(f"prompt {len(out) - 1} encodes to no tokens; remove empty prompts")
    return out


# ------------------------------------------------------------------------------- tokenizers


def _tokenizer_from_files(vocab_file=None, merges_file=None, spm_model=None):
    """Our tokenizer for the files named on the command line (None when none are)."""
    from libai_lite.tokenizer import GPT2Tokenizer, SentencePieceTokenizer

    try:
        if spm_model:
            return SentencePieceTokenizer(spm_model, extra_ids=100, style="t5")  # T5's 100 sentinels
        if vocab_file or merges_file:
            if not (vocab_file and merges_file):
                raise UsageError("a GPT-2 tokenizer needs both --vocab-file (vocab.json) and --merges-file (merges.txt)")
            return GPT2Tokenizer(vocab_file, merges_file)
    except ValueError as e:  # the tokenizers' own one-line messages name the file and the fix
        raise UsageError(str(e).splitlines()[0]) from None
    return None


# ------------------------------------------------------------------------------- models


def checkpoint_vocab_size(cfg, path: str) -> int:
    """Rows of the checkpoint's token embedding, named by building ``cfg.model`` on the meta device."""
    from libai_lite.checkpoint.integrity import stored_rows
    from libai_lite.config import instantiate
    from libai_lite.layers import VocabEmbedding

    with torch.device("meta"):
        model = instantiate(cfg.model)
    names = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, VocabEmbedding)]
    return stored_rows(path, names, "it was saved from another model; give the --config-file it was trained with")


def _explicit_tp(opts) -> int | None:
    for o in opts:
        key, _, value = o.lstrip("+").partition("=")
        if key == "train.dist.tensor_parallel_size":
            return int(value)
    return None


def _setup_dist(tp_asked: int | None):
    """One process per tensor-parallel rank: the layout is tp = world size."""
    from libai_lite.utils.distributed import setup_dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp_asked is not None and tp_asked != world:
        raise UsageError(f"train.dist.tensor_parallel_size={tp_asked} but {world} process(es) were launched; generation "
                         f"runs tensor parallel over every process: launch torchrun --nproc_per_node {tp_asked}")
    return setup_dist({"tensor_parallel_size": world, "pipeline_parallel_size": 1, "data_parallel_size": 1})


def load_model(args):
    """``(model, tokenizer, is_encoder_decoder, ctx)`` as the command line asks, parallelized and loaded."""
    from libai_lite.parallel.tensor_parallel import apply_tensor_parallel

    if bool(args.hf_dir) == bool(args.config_file):
        raise UsageError("give either --config-file CONFIG --checkpoint DIR or --hf-dir DIR")
    tokenizer = _tokenizer_from_files(args.vocab_file, args.merges_file, args.spm_model)
    if args.config_file:
        from omegaconf import open_dict

        from libai_lite.checkpoint import Checkpointer
        from libai_lite.checkpoint.dcp_io import build_empty
        from libai_lite.checkpoint.integrity import read_metadata
        from libai_lite.config import LazyConfig, instantiate

        if not args.checkpoint:
            raise UsageError("--config-file needs --checkpoint DIR (a model_XXXXXXX or model_final directory)")
        path = args.checkpoint
        read_metadata(path)  # a missing or corrupt checkpoint is refused before the config is read
        cfg = LazyConfig.apply_overrides(LazyConfig.load(args.config_file), args.opts)
        ctx = _setup_dist(_explicit_tp(args.opts))
        with open_dict(cfg):
            cfg.model.cfg.vocab_size = checkpoint_vocab_size(cfg, path)
        if tokenizer is None and cfg.get("tokenization") is not None and cfg.tokenization.get("tokenizer") is not None:
            try:
                tokenizer = instantiate(cfg.tokenization.tokenizer)
            except ValueError as e:
                raise UsageError(f"tokenization.tokenizer cannot be built: {str(e).splitlines()[0]}") from None
        device = _device(args, ctx)
        model = build_empty(lambda: instantiate(cfg.model), device)
        if ctx.tensor_parallel_size > 1:
            apply_tensor_parallel(model, ctx.mesh["tp"])
        Checkpointer(model, verify=not args.no_verify).load(path, weights_only=True)
    else:
        if args.checkpoint:
            raise UsageError("--checkpoint goes with --config-file; a --hf-dir directory holds its own weights")
        if not os.path.isdir(args.hf_dir):
            raise UsageError(f"--hf-dir {args.hf_dir} is not a directory; give a Hugging Face model directory")
        import projects.GPT.modeling  # noqa: F401  (the built-in projects register their Hugging Face mappings)
        import projects.Llama.modeling  # noqa: F401
        import projects.MT5  # noqa: F401
        from libai_lite.checkpoint.hf import load_hf_model, mapping_for_model

        ctx = _setup_dist(_explicit_tp(args.opts))
        _, model_cfg, model = load_hf_model(args.hf_dir, model_type=args.model)
        if tokenizer is None:
            found = mapping_for_model(model).find_tokenizer(args.hf_dir)
            tokenizer = found.tokenizer if found is not None else None
        model = model.to(_device(args, ctx))
        if ctx.tensor_parallel_size > 1:
            apply_tensor_parallel(model, ctx.mesh["tp"])
    # An encoder-decoder model's generate reads encoder inputs (projects/MT5 and copies of it).
    encoder_decoder = "encoder_input_ids" in inspect.signature(model.generate).parameters
    return model.to(_DTYPES[args.dtype]), tokenizer, encoder_decoder, ctx


def _device(args, ctx) -> torch.device:
    if args.device is None:
        return ctx.device
    device = torch.device(args.device)
    if ctx.world_size > 1 and device.type != ctx.device.type:
        raise UsageError(f"--device {args.device} under torchrun: the ranks use {ctx.device.type}; leave --device out")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device} but no GPU is visible; use --device cpu")
    return device


# ------------------------------------------------------------------------------- generation


def run(args) -> int:
    """Load, generate for every prompt in batches, print (rank 0) and report the speed."""
    from libai_lite.inference import build_logits_processors, pad_prompts
    from libai_lite.model import special_token_ids

    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} must be at least 1")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size} must be at least 1")
    # Bad prompts or options are refused before a model that may take minutes to load.
    build_logits_processors(args.do_sample, args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    prompts = read_prompts(args)
    model, tokenizer, encoder_decoder, ctx = load_model(args)
    vocab_size = tokenizer.vocab_size if tokenizer is not None else _model_vocab_size(model)
    prompts = encode_prompts(prompts, tokenizer, vocab_size)
    ids = special_token_ids(model, tokenizer)
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(args.seed)
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                   eos_token_id=ids["eos"], pad_token_id=ids["pad"], use_cache=args.use_cache, generator=generator,
                   vocab_size=vocab_size)
    if encoder_decoder:
        options["decoder_start_token_id"] = ids["decoder_start"]
    show = ctx.rank == 0
    total_tokens, elapsed = 0, 0.0
    for first in range(0, len(prompts), args.batch_size):
        chunk = prompts[first:first + args.batch_size]
        rows = [p for _, p in chunk]
        if encoder_decoder and ids["eos"] is not None:
            # T5 encoders read text that ends with eos, as in training.
            rows = [r if r[-1] == ids["eos"] else r + [ids["eos"]] for r in rows]
        batch, mask = pad_prompts(rows, ids["pad"], side="right" if encoder_decoder else "left", device=device)
        _sync(device)
        start = time.perf_counter()
        out = model.generate(batch, mask, **options)
        _sync(device)
        elapsed += time.perf_counter() - start
        new = out[:, 1:] if encoder_decoder else out[:, batch.shape[1]:]
        for i, (text, _) in enumerate(chunk):
            row = new[i].tolist()
            if ids["eos"] is not None and ids["eos"] in row:
                row = row[: row.index(ids["eos"]) + 1]  # what follows a row's eos is padding
            total_tokens += len(row)
            if show:
                shown = row[:-1] if row and row[-1] == ids["eos"] else row
                print(f"prompt {first + i}: {text}")
                text_out = tokenizer.decode(shown) if tokenizer is not None else " ".join(map(str, shown))
                print(f"output {first + i}: {text_out}")
                if args.show_ids:
                    print(f"ids {first + i}: {' '.join(map(str, row))}")
    if show:
        rate = total_tokens / elapsed if elapsed > 0 else float("inf")
        print(f"generated {total_tokens} tokens in {elapsed:.2f} s ({rate:.1f} tokens/s)", flush=True)
    return 0


def _model_vocab_size(model) -> int:
    from libai_lite.layers import VocabEmbedding

    return next(m.num_embeddings for m in model.modules() if isinstance(m, VocabEmbedding))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    """Parse, run, and turn a user error into one ``error:`` line and exit status 1."""
    args = build_parser().parse_intermixed_args(argv)
    from libai_lite.engine.launch import report_cli_error
    from libai_lite.utils.distributed import destroy

    try:
        return run(args)
    except Exception as e:  # noqa: BLE001 - user errors arrive wrapped by instantiate; find them
        return report_cli_error(e)
    finally:
        destroy()


if __name__ == "__main__":
    sys.exit(main())
