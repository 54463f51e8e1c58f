"""bench/gpu.py's steps: what each runs, how its log is read, and how long it is expected to take.

The list is in the order of what the steps answer: the mission's MT5 recipe trains, the fast paths take no
fallback and agree with eager at the first step, then the speeds against their targets, then the rest.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

GPT_DEMO = "projects/GPT/configs/gpt2_pretrain.py"
GPT_345M = "projects/GPT/configs/gpt2_345M.py"
MT5 = "projects/MT5/configs/mt5_pretrain.py"
# The dry run's model: the tests' tiny GPT (tests/launch.py), milliseconds per step on a CPU.
TINY_GPT = ["model.cfg.hidden_layers=2", "model.cfg.hidden_size=64", "model.cfg.ffn_hidden_size=128",
            "model.cfg.num_attention_heads=2", "model.cfg.max_seq_length=32", "train.train_micro_batch_size=4",
            "train.global_batch_size=8", "train.test_micro_batch_size=4", "train.log_period=1",
            "train.evaluation.eval_iter=2", "train.log_memory_estimate=False", "dataloader.train.num_workers=0"]
TINY_MT5 = ["model.cfg.hidden_layers=2", "model.cfg.hidden_size=64", "model.cfg.num_attention_heads=4",
            "model.cfg.head_size=16", "model.cfg.intermediate_size=128", "dataloader.train.max_seq_length=64",
            "dataloader.train.num_workers=0", "train.train_micro_batch_size=2", "train.log_period=1",
            "tokenization.make_vocab_size_divisible_by=256"]
# libai_lite.utils.fallback.FastPath's one warning line, and the other wordings of a fallback (as
# tests/gpu/test_recipes.py reads them): a training step whose log has one failed its check.
FALLBACK = re.compile(r"failed at its first use|conversion failed|fall(ing|s)? back|fell back", re.I)

# Where an estimate comes from. Measured: bench/results/2026-11-28-h200.md and ../shared/gpu's logs of
# that day (gpu.py's seconds per step, torch 2.11). Everything else is a prediction.
MEASURED_H200 = "measured H200 2026-11-28"
PREDICTED = "predicted"


@dataclass
class Ctx:
    """What every step's command and parser needs."""

    dry: bool
    work: Path
    python: str
    env: dict


@dataclass
class Step:
    """One step: ``cmd(ctx)`` -> argv; ``parse(text, ctx)`` -> (ok, figure); ``answers``: the question it
    answers; ``estimate``: device kind -> (seconds, where the figure comes from)."""

    name: str
    answers: str
    cmd: Callable[[Ctx], list]
    parse: Callable[[str, Ctx], tuple]
    estimate: dict
    env: dict = field(default_factory=dict)
    # In the dry run on a CPU this step is refused by design (FP8 needs compute capability 8.9+): a
    # one-line `error:` is its expected outcome there.
    cpu_refuses: bool = False
    # A step that continues what another step left (its checkpoint): run only after that one.
    needs: str | None = None

    def limit(self, kind: str) -> float:
        """The step's own time limit on a device of ``kind``: well past its estimate, so that only a
        step that hangs or crawls is stopped by it."""
        seconds = self.estimate.get(kind, self.estimate["H100"])[0]
        return max(2.0 * seconds, seconds + 60.0)


def est(h100: float, h200: float | None = None, h200_source: str = PREDICTED) -> dict:
    """Estimates for the two device kinds; H100 is always predicted (no H100 ran the current steps)."""
    return {"H100": (float(h100), PREDICTED), "H200": (float(h200 if h200 is not None else h100), h200_source)}


# ----------------------------------------------------------------------------------------- parsing
def _last(pattern: str, text: str):
    found = re.findall(pattern, text, flags=re.M)
    return found[-1] if found else None


def _iteration_figure(text: str) -> tuple:
    """s/it, tokens/s, MFU and loss from the last `iteration:` log line of a training run."""
    line = _last(r"^.*iteration: \d+/\d+ .*$", text)
    if line is None:
        return False, "no iteration line"
    parts = ["iter " + _last(r"iteration: (\d+)/", line)]
    for label, pattern in (("s/it", r"\btime: ([\d.]+) s/it"), ("tok/s", r"tokens/s: ([\d.]+)"),
                           ("samples/s", r"samples/s: ([\d.]+)"), ("MFU", r"MFU: ([\d.]+%)"),
                           ("loss", r"total_loss: ([\d.]+)")):
        value = _last(pattern, line)
        if value is not None:
            parts.append(f"{label} {value}" if label != "s/it" else f"{value} s/it")
    device = _last(r" on (cuda:\d+|cpu);", text)
    figure = ", ".join(parts + ([f"on {device}"] if device else []))
    fell = [line for line in text.splitlines() if FALLBACK.search(line)]
    if fell:
        return False, "a fast path fell back: " + fell[0].strip()[:160] + "; " + figure
    return True, figure


def parse_train(text: str, ctx: Ctx) -> tuple:
    """A training run: its last log line; a fast path that fell back fails it."""
    return _iteration_figure(text)


def parse_train_with_save(text: str, ctx: Ctx) -> tuple:
    """A training run and the seconds its final synchronous checkpoint save took."""
    ok, figure = _iteration_figure(text)
    save = _last(r"Saved checkpoint \S+ in ([\d.]+)\s*s", text)
    return ok, figure + (f"; checkpoint save {save} s" if save else "; no checkpoint save logged")


def parse_resume(text: str, ctx: Ctx) -> tuple:
    """A resumed run: where it started (a fresh start is a failure here) and its last log line."""
    start = _last(r"Starting training from iteration (\d+) to (\d+)", text)
    ok, figure = _iteration_figure(text)
    if not start or start[0] == "0":
        return False, "did not resume (started from iteration 0 or not at all); " + figure
    return ok, f"resumed at {start[0]} -> {start[1]}; " + figure


def parse_throughput(text: str, ctx: Ctx) -> tuple:
    """bench/train_throughput.py's last line, a JSON object."""
    line = _last(r"^\{.*\}$", text)
    if line is None:
        return False, "no JSON result line"
    r = json.loads(line)
    if r.get("benchmark") == "train_throughput_compile":
        return True, (f"eager {r['eager_tokens_per_s']:.0f} tok/s, compiled {r['compiled_tokens_per_s']:.0f} tok/s, "
                      f"ratio {r['ratio']:.2f}, compile {r['compile_seconds']:.0f} s")
    return True, (f"ours {r['ours_tokens_per_s']:.0f} tok/s (MFU {r['mfu_ours']:.1%}), HF {r['hf_tokens_per_s']:.0f} "
                  f"tok/s (MFU {r['mfu_hf']:.1%}), ratio {r['ratio']:.2f}")


def parse_stall(text: str, ctx: Ctx) -> tuple:
    """bench/checkpoint_stall.py's JSON line: the loop's stall per save, synchronous and async."""
    line = _last(r"^\{.*\}$", text)
    if line is None:
        return False, "no JSON result line"
    r = json.loads(line)
    return True, (f"{r['parameters'] / 1e6:.0f}M, {r['checkpoint_bytes'] / 2**30:.1f} GiB: stall sync "
                  f"{r['sync']['stall_s']:.2f} s, async {r['async']['stall_s']:.2f} s (first async "
                  f"{r['async']['first_stall_s']:.2f} s), step {r['step_s']:.3f} s")


def parse_pytest(text: str, ctx: Ctx) -> tuple:
    """pytest's summary line: counts of passed, failed, skipped ..."""
    line = _last(r"^=*\s*(\d+ (?:passed|failed|skipped|error|errors|deselected|xfailed|xpassed)\b.*?)\s*=*$", text)
    if line is None:
        return False, "no pytest summary"
    failed = re.search(r"(\d+) (failed|errors?)\b", line)
    return failed is None, re.sub(r" in [\d.]+s.*$", "", line)


# ----------------------------------------------------------------------------------------- commands
def _train(config: str, nproc: int, out: str, full: list, dry: list, resume: bool = False) -> Callable[[Ctx], list]:
    """tools/train.sh with ``full`` overrides, or in the dry run the tiny ones."""
    def cmd(ctx: Ctx) -> list:
        tiny = TINY_MT5 if config == MT5 else TINY_GPT
        extra = dry if ctx.dry else full
        base = [f"train.output_dir={ctx.work / out}", f"dataloader.train.cache_dir={ctx.work / 'cache'}"]
        return (["bash", "tools/train.sh", "tools/train_net.py", config, str(nproc), *base, *(tiny if ctx.dry else []),
                 *extra] + (["--resume"] if resume else []))
    return cmd


def _throughput(*full: str) -> Callable[[Ctx], list]:
    def cmd(ctx: Ctx) -> list:
        compile_ = ["--compile"] if "--compile" in full else []
        model = [a for i, a in enumerate(full) if i > 0 and full[i - 1] == "--model"]
        args = (["--smoke", "--device", "cpu", *compile_, *(["--model", model[0]] if model else [])] if ctx.dry
                else [*full, "--device", "cuda", "--dtype", "bf16"])
        return [ctx.python, "bench/train_throughput.py", *args]
    return cmd


# The fast paths against their plain paths on the device: the MT5 recipe's widths, heads and lengths
# through FlexAttention and through dense SDPA (first step's loss and gradient norm), and the kernels'
# own CUDA tests (compiled flex against the dense path, the fused LM head + loss against the unfused one).
FAST_PATH_TESTS = ["tests/gpu/test_recipes.py::test_mt5_recipe_at_shipped_widths",
                   "tests/layers/test_flex_attention.py", "tests/layers/test_fused_linear_ce.py"]


def _pytest(marks: str, tests: list | None = None, deselect: list = ()) -> Callable[[Ctx], list]:
    # Without ``tests`` the dry run collects tests/gpu only (everything there skips on a CPU); on a GPU
    # every test of the suite with these marks runs (tests/gpu, the FP8, flex and fused-loss kernels ...).
    def cmd(ctx: Ctx) -> list:
        where = tests or (["tests/gpu"] if ctx.dry else ["tests"])
        return [ctx.python, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "-m", marks, "-rfEs",
                *[f"--deselect={t}" for t in deselect], *where]
    return cmd


NO_EVAL = "train.evaluation.enabled=False"
TRAINER_345M = ["train.train_iter=30", "train.log_period=10", "train.train_micro_batch_size=8",
                "train.global_batch_size=8", NO_EVAL]
TWO_RANKS = ["train.dist.backend=gloo", NO_EVAL, "train.log_period=10"]
MT5_1GPU = ["train.dist.data_parallel_size=1", "train.dist.tensor_parallel_size=1",
            "train.zero_optimization.enabled=False", "train.num_accumulation_steps=1", "train.train_epoch=0", NO_EVAL]
# Shorter than the benchmark's defaults (5 blocks, 5 warm-up steps): the ratio over 3 blocks of 10 steps.
SHORT = ["--blocks", "3", "--warmup", "3"]

STEPS = [
    # The mission's command as the recipe's docstring writes it for one GPU; only its length and folders
    # change, and evaluation is off: the recipe evaluates after its last step, which recompiles the model
    # for inference and measures nothing that the training steps do not.
    Step("mission_mt5", "the mission's MT5 recipe trains on one GPU (samples/s, no fallback)",
         _train(MT5, 1, "mission", ["train.train_iter=20", "train.train_epoch=0", "train.log_period=5", NO_EVAL],
                ["train.train_iter=2", "train.train_epoch=0", NO_EVAL]), parse_train,
         # On the H200 the crashed run of 17d056b ended after its first compiled step at 70 s.
         est(100, 90)),
    Step("fast_paths", "the fast paths take no fallback and agree with the plain path at the first step",
         _pytest("gpu and not slow", FAST_PATH_TESTS), parse_pytest, est(110, 100)),
    Step("trainer_345M", "GPT-2 345M MFU as shipped (compiled) and its synchronous checkpoint save",
         _train(GPT_345M, 1, "gpt345M", TRAINER_345M, ["train.train_iter=3", NO_EVAL]), parse_train_with_save,
         est(50, 45, MEASURED_H200)),
    Step("tput_gpt_124M", "GPT-2 124M tokens/s eager and compiled (as shipped), micro-batch 12",
         _throughput("--size", "117M", "--micro-batch", "12", "--steps", "10", *SHORT, "--compile"), parse_throughput,
         est(60, 55)),
    Step("fp8_345M", "FP8 against bf16 at 345M (compare trainer_345M's tokens/s)",
         _train(GPT_345M, 1, "gpt345M_fp8", ["train.train_iter=20", *TRAINER_345M[1:], "train.fp8.enabled=True"],
                ["train.train_iter=2", NO_EVAL, "train.fp8.enabled=True"]), parse_train, est(60, 55, MEASURED_H200),
         cpu_refuses=True),
    # Measured with the benchmark's 5 blocks: 59 s (1.3B) and 63 s (Llama); 3 blocks predicted.
    Step("tput_gpt_1.3B", "GPT 1.3B MFU against transformers", _throughput("--size", "1.3B", *SHORT),
         parse_throughput, est(50, 45)),
    Step("tput_llama_1.1B", "Llama 1.1B MFU against transformers", _throughput("--model", "llama", "--size", "1.1B",
                                                                               *SHORT), parse_throughput, est(55, 50)),
    Step("stall_345M", "checkpoint stall at 345M, synchronous and async",
         lambda ctx: [ctx.python, "bench/checkpoint_stall.py", *(
             ["--smoke"] if ctx.dry else ["--device", "cuda", "--config", GPT_345M, "--seq-length", "1024",
                                          "--micro-batch", "8", "--rounds", "1", "--steps-per-save", "4"])],
         parse_stall, est(40)),
    Step("mt5_1gpu", "MT5 samples/s at LiBai's published one-GPU comparison (micro-batch 16, no accumulation)",
         _train(MT5, 1, "mt5", [*MT5_1GPU, "train.train_micro_batch_size=16", "train.train_iter=30",
                                "train.log_period=10"], [*MT5_1GPU, "train.train_iter=3"]), parse_train,
         # The crashed run of 17d056b stopped at its second step at 55 s.
         est(80, 75)),
    Step("demo_gpu", "the README demo on the GPU in bf16",
         _train(GPT_DEMO, 1, "demo", ["train.train_iter=60", "train.amp.enabled=True", "train.log_period=20"],
                ["train.train_iter=4", "train.amp.enabled=True"]), parse_train, est(30)),
    Step("resume_cpu", "that GPU checkpoint resumes on the CPU",
         _train(GPT_DEMO, 1, "demo", ["train.train_iter=70", "train.amp.enabled=True", "train.log_period=10"],
                ["train.train_iter=6", "train.amp.enabled=True"], resume=True), parse_resume, est(30),
         env={"CUDA_VISIBLE_DEVICES": ""}, needs="demo_gpu"),
    Step("ranks_tp2", "two ranks share the GPU over gloo, tensor parallel 2",
         _train(GPT_DEMO, 2, "tp2", ["train.dist.tensor_parallel_size=2", "train.train_iter=20", *TWO_RANKS],
                ["train.dist.tensor_parallel_size=2", "train.train_iter=3", "train.dist.backend=gloo", NO_EVAL]),
         parse_train, est(40)),
    Step("ranks_zero3", "that tp2 checkpoint resumes as ZeRO-3 over 2 ranks",
         _train(GPT_DEMO, 2, "tp2", ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=3",
                                     "train.train_iter=30", *TWO_RANKS],
                ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=3", "train.train_iter=5",
                 "train.dist.backend=gloo", NO_EVAL], resume=True), parse_resume, est(40), needs="ranks_tp2"),
    Step("tput_gpt_345M", "GPT 345M eager against transformers", _throughput("--size", "345M", *SHORT),
         parse_throughput, est(45)),
    # 8 of its tests ran in 190 s on the H200 (2026-11-28), the two full-depth MT5 runs among them.
    Step("gpu_tests", "the rest of the quick GPU suite (recipes' other fast paths, devices crossing, ranks)",
         _pytest("gpu and not slow", deselect=FAST_PATH_TESTS), parse_pytest, est(300)),
    Step("gpu_tests_slow", "the slow GPU suite (cross-device and shared-GPU multi-rank runs)",
         _pytest("gpu and slow"), parse_pytest, est(420)),
]
STEP_NAMES = [s.name for s in STEPS]
# The check of torch and the device before the steps, and the seconds a step past its limit may take
# to stop (SIGTERM, 5 s, SIGKILL, 5 s).
DEVICE_CHECK = est(10)
GRACE = 10.0
