#!/usr/bin/env python
"""Training throughput of our GPT, Llama or MT5 against Hugging Face's model of the same shape, side by side.

    python bench/train_throughput.py --size demo
    python bench/train_throughput.py --size 345M --device cuda --dtype bf16 --micro-batch 8
    python bench/train_throughput.py --model llama --size 100M
    python bench/train_throughput.py --model mt5 --size base --device cuda --dtype bf16
    python bench/train_throughput.py --size demo --compile      # ours compiled against ours eager

The last line of the output is one JSON object with the numbers.
The method and MFU: bench/README.md, section "train_throughput.py: how it measures".
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import time
import warnings

import torch

# Run as a script, this file's folder is on sys.path: the model-specific half sits beside it.
from throughput_measure import PROFILE_KINDS, Peak, profile_steps, run_blocks, sync
from throughput_models import FAMILIES, ffn_size

DTYPES = {"fp32": None, "bf16": torch.bfloat16}
# configs/common/optim.py: what the trainer builds for every config.
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-4, (0.9, 0.95), 1e-8, 0.01, 1.0


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options; see ``--help``."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sizes = {name: [s for s in f.sizes if s != "smoke"] for name, f in FAMILIES.items()}
    p.add_argument("--model", choices=sorted(FAMILIES), default="gpt",
                   help="gpt: ours against GPT2LMHeadModel (default); llama: ours against LlamaForCausalLM; "
                        "mt5: ours against MT5ForConditionalGeneration on span-corruption batches")
    p.add_argument("--size", choices=sorted({s for names in sizes.values() for s in names}), default="demo",
                   help="model shape, default demo (the family's demo config); "
                        + "; ".join(f"{name}: {', '.join(names)}" for name, names in sizes.items()))
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="fp32, or bf16 autocast for both models (the trainer's train.amp)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per model per block")
    p.add_argument("--blocks", type=int, default=None, help="alternating blocks (each model runs once per block)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per model before the blocks")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per step")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    p.add_argument("--compile", action="store_true",
                   help="our model compiled (train.compile; --compile-scope) against our model eager, "
                        "instead of against HF")
    p.add_argument("--compile-scope", choices=["model", "layers"], default="model",
                   help="with --compile: the whole model (what train.compile.scope=auto does on one GPU) or each "
                        "transformer layer (under a pipeline, tp or data parallelism)")
    p.add_argument("--compile-mode", default=None,
                   help="with --compile: torch.compile's mode (train.compile.mode), e.g. reduce-overhead")
    p.add_argument("--compile-loss", action="store_true",
                   help="with --compile: also compile the cross entropy (train.compile.loss; with "
                        "--unfused-cross-entropy, else our fused head never calls it)")
    p.add_argument("--fused-adamw", action="store_true",
                   help="torch's fused AdamW on both sides (ours through the config's optim.fused=True; "
                        "recent HF Trainers default to it); by default each side uses what it is configured with")
    p.add_argument("--unfused-cross-entropy", action="store_true",
                   help="our side materialises the logits and runs the plain cross entropy (model.cfg."
                        "fused_cross_entropy=False), as HF does; by default it fuses the LM head with the loss")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after the timed blocks, profile this many steps of each model (alternating) and print "
                        "milliseconds per step by kind of work (GEMMs, attention, MLP activation, loss, optimizer "
                        "and clipping, other)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--smoke", action="store_true", help="a tiny model and two steps: checks the script runs")
    args = p.parse_args(argv)
    family = FAMILIES[args.model]
    if not args.smoke and args.size not in family.sizes:
        p.error(f"--size {args.size} is not a {args.model} size; {args.model} has {', '.join(sizes[args.model])}")
    shape = dict(family.sizes["smoke" if args.smoke else args.size])
    for key in ("steps", "blocks", "warmup", "micro_batch"):
        if getattr(args, key) is None:
            setattr(args, key, shape[key])
        elif getattr(args, key) < (0 if key == "warmup" else 1):
            p.error(f"--{key.replace('_', '-')} must be {'>= 0' if key == 'warmup' else '>= 1'}")
    if args.compile_loss and not args.compile:
        p.error("--compile-loss needs --compile")
    if args.compile and args.warmup < 1:
        p.error("--compile needs --warmup >= 1: the first step compiles")
    args.shape, args.family = shape, family
    if args.smoke:
        args.size = "smoke"
    return args


# ------------------------------------------------------------------------------------- models
def hf_attn_implementation(model) -> str:
    """The attention implementation transformers picked (``sdpa``, ``eager``, ...)."""
    return str(getattr(model.config, "_attn_implementation", None) or "unknown")


# -------------------------------------------------------------------------------------- steps
class OursStepper:
    """Steps our model through Trainer.run_step, the exact code path of a training run."""

    def __init__(self, model, batches, device, amp_dtype, fused_adamw: bool = False):
        from configs.common.optim import optim as optim_cfg
        from libai_lite.config.instantiate import instantiate_with
        from libai_lite.engine.trainer import Trainer
        from libai_lite.model import output_metrics
        from libai_lite.scheduler import WarmupDecayLR
        from libai_lite.utils.events import EventStorage

        # The trainer builds the optimizer from this config node with the model filled in.
        optim_cfg.lr = LR
        if fused_adamw:
            optim_cfg.fused = True
        params = instantiate_with(optim_cfg.params, model=model)
        optimizer = instantiate_with(optim_cfg, params=params)
        self.optimizer = optimizer
        scheduler = WarmupDecayLR(optimizer, max_iter=10**9, decay="constant")
        # The trainer moves each batch to the device itself, as it does for a DataLoader.
        loader = [b if isinstance(b, dict) else {"input_ids": b[0], "labels": b[1]} for b in batches]
        self.trainer = Trainer(model, loader, optimizer, scheduler, output_metrics(model), device=device,
                               amp_dtype=amp_dtype,
                               clip_grad_max_norm=CLIP, clip_grad_norm_type=2.0)
        self.trainer.storage = EventStorage(0)

    def step(self) -> None:
        t = self.trainer
        t.storage.begin(t.iter)
        t.run_step()
        t.iter += 1


class HFStepper:
    """A plain PyTorch loop over the HF model: autocast forward with labels, backward, clip, AdamW."""

    def __init__(self, model, batches, device, amp_dtype, fused_adamw: bool = False):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                           fused=True if fused_adamw else None)
        # HF shifts labels itself, so a causal LM is given the inputs as labels (the usual HF call).
        self.batches = [b if isinstance(b, dict) else b[0] for b in batches]
        self.device, self.amp_dtype = device, amp_dtype
        self.i = 0

    def step(self) -> None:
        batch = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.model.train()
        ctx = (torch.autocast(device_type=self.device.type, dtype=self.amp_dtype) if self.amp_dtype is not None
               else contextlib.nullcontext())
        with ctx:
            if isinstance(batch, dict):  # span corruption: HF's names for the same tensors
                b = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
                loss = self.model(input_ids=b["encoder_input_ids"], attention_mask=b["encoder_attn_mask"],
                                  decoder_input_ids=b["decoder_input_ids"],
                                  decoder_attention_mask=b["decoder_attn_mask"], labels=b["labels"]).loss
            else:
                x = batch.to(self.device, non_blocking=True)
                loss = self.model(input_ids=x, labels=x).loss
        loss.backward()
        # Not read here: the trainer keeps its loss on the device until a log line (none in the timed
        # blocks), and a read per step would stall a GPU's launch queue in this loop alone. Read once at the end.
        self.last_loss = loss.detach()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def adamw_impl(optimizer) -> str:
    """Which AdamW kernel runs: fused, foreach, or torch's default (foreach on CUDA, a for-loop on CPU)."""
    if optimizer.defaults.get("fused"):
        return "fused"
    if optimizer.defaults.get("foreach"):
        return "foreach"
    return "default"


# --------------------------------------------------------------------------------------- main
def _quantile(values, q: float) -> float:
    """Linear-interpolated quantile (statistics.quantiles needs two or more values)."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def make_batches(args, device: torch.device) -> list:
    """A few distinct (input_ids, labels) batches, pinned when a GPU will receive them, as the DataLoader does."""
    gen = torch.Generator().manual_seed(args.seed)
    batches = []
    if args.family.make_batch is not None:
        for _ in range(4):
            batch = args.family.make_batch(args.shape, args.micro_batch, gen)
            batches.append({k: v.pin_memory() if device.type == "cuda" else v for k, v in batch.items()})
        return batches
    for _ in range(4):
        x = torch.randint(0, args.shape["vocab"], (args.micro_batch, args.shape["seq"] + 1), generator=gen)
        pair = (x[:, :-1].contiguous(), x[:, 1:].contiguous())
        batches.append(tuple(t.pin_memory() for t in pair) if device.type == "cuda" else pair)
    return batches


def step_tokens(args) -> int:
    """Tokens one step feeds a model: ``seq`` per sequence, encoder plus decoder for span corruption."""
    per_sample = args.family.tokens_per_sample(args.shape) if args.family.tokens_per_sample else args.shape["seq"]
    return args.micro_batch * per_sample


def model_flops_per_token(args, ours, n_params: int) -> float:
    """Training FLOPs per counted token: the family's own count, else 6N + 12 L H T."""
    from libai_lite.utils.flops import transformer_flops_per_token

    if args.family.flops_per_token is not None:
        return float(args.family.flops_per_token(ours, args.shape))
    shape = args.shape
    return transformer_flops_per_token(n_params, shape["layers"], shape["hidden"], shape["seq"])


def timed_warmup(stepper, steps: int, device: torch.device) -> float:
    """Seconds for ``steps`` untimed warm-up steps (where compilation happens)."""
    start = time.perf_counter()
    for _ in range(steps):
        stepper.step()
    sync(device)
    return time.perf_counter() - start


def compile_main(args, device: torch.device, amp_dtype) -> dict:
    """``--compile``: our model compiled (whole or per layer, ``--compile-scope``) against itself eager; prints a
    table and the JSON line."""
    from torch._dynamo.utils import counters

    from libai_lite.converters.compile import CompileOptions, apply_compile
    shape, family = args.shape, args.family
    peak_meter = Peak(device, amp_dtype, args.smoke)
    models = {}
    for name in ("eager", "compiled"):
        torch.manual_seed(args.seed)
        models[name] = family.build_ours(shape, device, fused_cross_entropy=not args.unfused_cross_entropy)
    options = CompileOptions(enabled=True, loss=args.compile_loss, scope=args.compile_scope, mode=args.compile_mode)
    apply_compile(models["compiled"], options, whole_model_ok=True)
    batches = make_batches(args, device)
    steppers = {name: OursStepper(m, batches, device, amp_dtype, args.fused_adamw) for name, m in models.items()}
    # One untimed eager step first: the process's one-off costs (thread pools, allocator) would
    # otherwise land on whichever model steps first and be mistaken for (or hide) compile time.
    steppers["eager"].step()
    warmup_s = {name: timed_warmup(s, args.warmup, device) for name, s in steppers.items()}
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    tokens_per_step = step_tokens(args)
    rates = run_blocks(steppers, args.steps, args.blocks, 0, tokens_per_step, device, between=peak_meter.measure)
    n_params = models["eager"].num_parameters(non_embedding=True)
    flops_per_token = model_flops_per_token(args, models["eager"], n_params)
    eager_tps, compiled_tps = statistics.median(rates["eager"]), statistics.median(rates["compiled"])
    ratios = [c / e for c, e in zip(rates["compiled"], rates["eager"])]
    result = {
        "benchmark": "train_throughput_compile",
        "model": args.model, "size": args.size, "device": str(device), "dtype": args.dtype,
        "threads": torch.get_num_threads(), "backend": options.backend, "compile_loss": options.loss,
        "compile_scope": options.scope, "compile_mode": options.mode,
        "layers": shape["layers"], "hidden": shape["hidden"], "seq_length": shape["seq"], "vocab": shape["vocab"],
        "micro_batch": args.micro_batch, "steps_per_block": args.steps, "blocks": args.blocks,
        "warmup": args.warmup, "ours_fused_cross_entropy": not args.unfused_cross_entropy,
        "eager_tokens_per_s": eager_tps, "compiled_tokens_per_s": compiled_tps,
        "ratio": statistics.median(ratios),
        "ratio_p25": _quantile(ratios, 0.25), "ratio_p75": _quantile(ratios, 0.75),
        "eager_block_tokens_per_s": rates["eager"], "compiled_block_tokens_per_s": rates["compiled"],
        # One-off: what the first steps cost beyond the eager ones (inductor's cache makes reruns cheaper).
        "compile_seconds": warmup_s["compiled"] - warmup_s["eager"],
        "graphs": graphs_after_warmup,
        # Graphs inductor found in its on-disk cache: then compile_seconds is a rerun's, not a first run's.
        "inductor_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
        # Anything compiled during the timed blocks is a recompilation, and a bug.
        "graphs_compiled_in_blocks": counters["stats"]["unique_graphs"] - graphs_after_warmup,
        "flops_per_token": flops_per_token, "peak_flops": peak_meter.flops, "peak_source": peak_meter.source,
        "mfu_eager": flops_per_token * eager_tps / peak_meter.flops,
        "mfu_compiled": flops_per_token * compiled_tps / peak_meter.flops,
        "torch": torch.__version__, "date": datetime.date.today().isoformat(),
    }
    print(f"{family.label} {args.size}: {shape['layers']} layers, hidden {shape['hidden']}, seq {shape['seq']}, "
          f"vocab {shape['vocab']}, micro batch {args.micro_batch}, {args.dtype}, {result['threads']} threads; "
          f"train.compile ({options.backend}, per layer{', loss' if options.loss else ''}) against eager")
    print(f"compile: {result['compile_seconds']:.1f} s over the {args.warmup} warm-up steps, {result['graphs']} "
          f"graphs ({result['inductor_cache_hits']} from inductor's cache), {result['graphs_compiled_in_blocks']} "
          f"compiled during the timed blocks")
    print(f"{'block':>5} {'eager tok/s':>12} {'compiled tok/s':>15} {'compiled/eager':>15}")
    for b, (e, c) in enumerate(zip(rates["eager"], rates["compiled"])):
        print(f"{b:>5} {e:>12.1f} {c:>15.1f} {c / e:>15.3f}")
    print(f"median: eager {eager_tps:.1f} tok/s (MFU {result['mfu_eager']:.1%}), compiled {compiled_tps:.1f} tok/s "
          f"(MFU {result['mfu_compiled']:.1%}), compiled/eager {result['ratio']:.3f} "
          f"(per-block quartiles {result['ratio_p25']:.3f}-{result['ratio_p75']:.3f})")
    print(json.dumps(result), flush=True)
    return result


def main(argv=None) -> dict:
    """Run the benchmark, print a table and the JSON line; returns the JSON object."""
    args = parse_args(argv)
    shape = args.shape
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    amp_dtype = DTYPES[args.dtype]
    warnings.filterwarnings("ignore", message=".*bos_token_id.*|.*eos_token_id.*|.*loss_type.*")
    if args.compile:
        return compile_main(args, device, amp_dtype)

    peak_meter = Peak(device, amp_dtype, args.smoke)

    torch.manual_seed(args.seed)
    family = args.family
    ours = family.build_ours(shape, device, fused_cross_entropy=not args.unfused_cross_entropy)
    torch.manual_seed(args.seed)
    hf = family.build_hf(shape, device)
    batches = make_batches(args, device)

    n_params = ours.num_parameters(non_embedding=True)
    n_hf = family.hf_non_embedding_parameters(hf)
    n_total = ours.num_parameters()
    flops_per_token = model_flops_per_token(args, ours, n_params)
    attn_impl = hf_attn_implementation(hf)

    steppers = {
        "ours": OursStepper(ours, batches, device, amp_dtype, args.fused_adamw),
        "hf": HFStepper(hf, batches, device, amp_dtype, args.fused_adamw),
    }
    tokens_per_step = step_tokens(args)
    rates = run_blocks(steppers, args.steps, args.blocks, args.warmup, tokens_per_step, device,
                       between=peak_meter.measure)
    # The loss's [tokens, vocab] work is over the decoder's tokens for span corruption.
    loss_tokens = args.micro_batch * shape.get("dec", shape["seq"])
    breakdown = (profile_steps(steppers, args.profile, loss_tokens, ffn_size(shape), shape["vocab"])
                 if args.profile else None)
    peak, peak_source = peak_meter.flops, peak_meter.source
    ours_tps, hf_tps = statistics.median(rates["ours"]), statistics.median(rates["hf"])
    ratios = [o / h for o, h in zip(rates["ours"], rates["hf"])]
    result = {
        "benchmark": "train_throughput",
        "model": args.model,
        "hf_class": family.hf_class,
        "size": args.size,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        or platform.machine(),
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "layers": shape["layers"], "hidden": shape["hidden"], "heads": shape["heads"],
        "kv_heads": shape.get("kv_heads", shape["heads"]), "ffn_hidden": ffn_size(shape),
        "seq_length": shape["seq"], "vocab": shape["vocab"], "micro_batch": args.micro_batch,
        "steps_per_block": args.steps, "blocks": args.blocks, "warmup": args.warmup,
        "params_total": n_total, "hf_params_total": sum(p.numel() for p in hf.parameters()),
        "params_non_embedding": n_params, "hf_params_non_embedding": n_hf,
        "hf_attn_implementation": attn_impl,
        "ours_adamw": adamw_impl(steppers["ours"].optimizer),
        "hf_adamw": adamw_impl(steppers["hf"].optimizer),
        "ours_fused_cross_entropy": not args.unfused_cross_entropy,
        "ours_tokens_per_s": ours_tps,
        "hf_tokens_per_s": hf_tps,
        "ratio": statistics.median(ratios),
        # The spread of the per-block ratios: how much to trust the median on a busy machine.
        "ratio_p25": _quantile(ratios, 0.25),
        "ratio_p75": _quantile(ratios, 0.75),
        "ours_block_tokens_per_s": rates["ours"],
        "hf_block_tokens_per_s": rates["hf"],
        "flops_per_token": flops_per_token,
        "peak_flops": peak,
        "peak_source": peak_source,
        "mfu_ours": flops_per_token * ours_tps / peak,
        "mfu_hf": flops_per_token * hf_tps / peak,
        "profile_ms_per_step": breakdown,
        "hf_last_loss": float(steppers["hf"].last_loss),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "date": datetime.date.today().isoformat(),
    }
    kv = f" ({result['kv_heads']} key/value)" if result["kv_heads"] != shape["heads"] else ""
    print(f"{family.label} {args.size}: {shape['layers']} layers, hidden {shape['hidden']}, "
          f"heads {shape['heads']}{kv}, ffn {result['ffn_hidden']}, seq {shape['seq']}, "
          f"vocab {shape['vocab']}, micro batch {args.micro_batch}, {args.dtype}, {result['threads']} threads, "
          f"HF attention '{attn_impl}', AdamW ours "
          f"{result['ours_adamw']} / HF {result['hf_adamw']}, our LM head + loss "
          f"{'fused' if result['ours_fused_cross_entropy'] else 'unfused'}")
    print(f"parameters: {n_total / 1e6:.1f}M, {n_params / 1e6:.1f}M without the lookup-only embedding (the N of "
          f"6N; transformers' {family.hf_class}: {n_hf / 1e6:.1f}M)")
    print(f"peak {peak / 1e12:.3f} TFLOP/s ({peak_source}); {flops_per_token / 1e6:.1f} MFLOP/token")
    print(f"{'block':>5} {'ours tok/s':>12} {'HF tok/s':>12} {'ours/HF':>8}")
    for b, (o, h) in enumerate(zip(rates["ours"], rates["hf"])):
        print(f"{b:>5} {o:>12.1f} {h:>12.1f} {o / h:>8.3f}")
    print(f"median: ours {ours_tps:.1f} tok/s (MFU {result['mfu_ours']:.1%}), HF {hf_tps:.1f} tok/s "
          f"(MFU {result['mfu_hf']:.1%}), ours/HF {result['ratio']:.3f} "
          f"(per-block quartiles {result['ratio_p25']:.3f}-{result['ratio_p75']:.3f})")
    if breakdown:
        print(f"self CPU ms per step over {args.profile} profiled steps each (torch.profiler; ATen calls only):")
        print(f"{'kind':<24} {'ours':>9} {'HF':>9}")
        for kind in PROFILE_KINDS + ("total",):
            print(f"{kind:<24} {breakdown['ours'][kind]:>9.1f} {breakdown['hf'][kind]:>9.1f}")
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
