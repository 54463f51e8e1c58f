"""fairseq-train's flags (fairseq/dataclass/configs.py, the ``language_modeling`` task, ``transformer_lm``,
the lr schedulers): what each means here, and the reader of a command line.

A flag is taken one to one (``DIRECT``, ``ARCH``), by a rule of its own (``RULES``, in ``translate``),
accepted with no effect (``NO_EFFECT``, named at start-up) or refused with what to do instead
(``REFUSED``). Problems are collected (``Problems``) and reported together in one error.
"""
from __future__ import annotations

import ast
import difflib
import shlex
from typing import Any, Callable, Dict, List, Optional

from libai_lite.utils.errors import UsageError


def _int(v: str) -> int:
    return int(float(v)) if "e" in v.lower() else int(v)


def _num(v: str) -> float:
    return float(v)


def _one_of_list(v: str) -> float:
    """fairseq's ``--lr``/``--update-freq`` take a list, one value per epoch: one value only here."""
    parts = [p for p in v.strip("[]").split(",") if p.strip()]
    if len(parts) != 1:
        raise ValueError("a value per epoch")
    return float(parts[0])


def betas(v: str) -> list:
    """``--adam-betas "(0.9, 0.98)"``: a Python tuple of two numbers, as fairseq evaluates it."""
    value = ast.literal_eval(v)
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(b, (int, float)) for b in value)):
        raise ValueError("not a pair")
    return [float(b) for b in value]


# flag -> (config key, converter).
DIRECT: Dict[str, tuple] = {
    "--adam-eps": ("optim.eps", _num),
    "--max-update": ("train.train_iter", _int),
    "--seed": ("train.seed", _int),
    "--log-interval": ("train.log_period", _int),
    "--save-dir": ("train.output_dir", str),
    "--save-interval-updates": ("train.checkpointer.period", _int),
    "--num-workers": ("dataloader.train.num_workers", _int),
    "--fp16-init-scale": ("train.amp.initial_scale", _num),
    "--fp16-scale-window": ("train.amp.growth_interval", _int),
    "--min-loss-scale": ("train.amp.min_loss_scale", _num),
}
# flag -> (fairseq's model argument, converter).
ARCH: Dict[str, tuple] = {
    "--decoder-layers": ("decoder_layers", _int),
    "--decoder-embed-dim": ("decoder_embed_dim", _int),
    "--decoder-ffn-embed-dim": ("decoder_ffn_embed_dim", _int),
    "--decoder-attention-heads": ("decoder_attention_heads", _int),
    "--dropout": ("dropout", _num),
    "--attention-dropout": ("attention_dropout", _num),
    "--activation-dropout": ("activation_dropout", _num),
    "--relu-dropout": ("activation_dropout", _num),
    "--activation-fn": ("activation_fn", str),
    "--max-target-positions": ("max_target_positions", _int),
    "--decoder-input-dim": ("decoder_input_dim", _int),
    "--decoder-output-dim": ("decoder_output_dim", _int),
}
ARCH_SWITCHES = ("--share-decoder-input-output-embed", "--decoder-learned-pos", "--no-scale-embedding",
                 "--decoder-normalize-before")
_LAUNCHER = "the launcher takes it: NPROC (and NODE) of bash tools/train.sh"
_LOGGED = "the log and metrics.json show loss, lr, tokens/s and the gradient norm every --log-interval updates"
_EPOCHS = "a run here is counted in updates (--max-update), not epochs"
_VALID = "the valid split is not read during training here (docs/migrating.md, fairseq)"
NO_EFFECT: Dict[str, str] = {
    "--no-progress-bar": _LOGGED, "--log-format": _LOGGED, "--log-file": "the log goes to --save-dir/log.txt",
    "--tensorboard-logdir": "TensorBoard events go to --save-dir", "--fp16-no-flatten-grads": "grads are not flattened",
    "--distributed-world-size": _LAUNCHER, "--distributed-num-procs": _LAUNCHER, "--nprocs-per-node": _LAUNCHER,
    "--distributed-port": "the launcher takes it: PORT for bash tools/train.sh", "--distributed-backend":
    "torch.distributed picks nccl on GPUs, gloo on the CPU", "--dataset-impl": "fairseq's mmap data-bin is read",
    "--skip-invalid-size-inputs-valid-test": _VALID, "--max-tokens-valid": _VALID, "--batch-size-valid": _VALID,
    "--valid-subset": _VALID, "--validate-interval": _VALID, "--validate-interval-updates": _VALID,
    "--disable-validation": _VALID, "--best-checkpoint-metric": _VALID, "--maximize-best-checkpoint-metric": _VALID,
    "--no-epoch-checkpoints": _EPOCHS, "--save-interval": _EPOCHS, "--keep-last-epochs": _EPOCHS,
    "--no-last-checkpoints": "the end of a run is always saved here (model_final)",
    "--required-batch-size-multiple": "batches are --batch-size blocks here, whole",
    "--fp16-scale-tolerance": "the loss scale halves at the first overflow",
    "--fp16-adam-stats": "Adam's moments are fp32 here", "--memory-efficient-fp16":
    "fp16 with fp32 master weights here: more memory than fairseq's, the same updates to rounding",
    "--memory-efficient-bf16": "bf16 autocast with fp32 master weights here",
    "--no-seed-provided": "--seed (1 by default) seeds the run", "--fix-batches-to-gpus": "batches are sharded by rank",
    "--use-old-adam": "one AdamW here", "--checkpoint-suffix": "checkpoints are named by iteration here",
    "--all-gather-list-size": "no list gathers here",
    "--empty-cache-freq": "PyTorch's caching allocator keeps its blocks",
    "--wandb-project": "Weights & Biases: write train.wandb.* overrides",
}
REFUSED: Dict[str, str] = {
    "--max-epoch": _EPOCHS + ": give --max-update", "--force-anneal": _EPOCHS, "--lr-shrink": _EPOCHS,
    "--adaptive-input": "no adaptive input here (projects/GPT's embedding is one matrix)",
    "--adaptive-softmax-cutoff": "no adaptive softmax here (projects/GPT's head is one matrix)",
    "--decoder-layerdrop": "no LayerDrop here", "--decoder-layers-to-keep": "no LayerDrop here",
    "--no-token-positional-embeddings": "projects/GPT always adds positions",
    "--layernorm-embedding": "projects/GPT has no norm after the embeddings",
    "--no-decoder-final-norm": "projects/GPT always ends with a final norm",
    "--quant-noise-pq": "no quantization noise here", "--add-bos-token": "documents start without <s> here",
    "--user-dir": "fairseq plugins are not loaded: express the model as a project here",
    "--restore-file": "a run resumes from its own --save-dir here; for weights only, train.load_weight=DIR",
    "--finetune-from-model": "train.load_weight=DIR (this project's checkpoint) loads weights only",
    "--reset-optimizer": "a resume restores model, optimizer and schedule together here",
    "--reset-lr-scheduler": "a resume restores model, optimizer and schedule together here",
    "--reset-dataloader": "a resume restores the data position with the rest here",
    "--reset-meters": "a resume restores model, optimizer and schedule together here",
    "--no-save-optimizer-state": "checkpoints always hold the optimizer here",
    "--cpu": "the run uses the GPUs it is launched on (CPU where there are none)",
    "--t-mult": "no cosine restarts here: drop it", "--threshold-loss-scale": "no loss-scale ceiling here: drop it",
}
RULES = ("--task", "--arch", "-a", "--criterion", "--optimizer", "--lr", "--adam-betas", "--weight-decay", "--wd",
         "--clip-norm", "--lr-scheduler", "--warmup-updates", "--warmup-init-lr", "--end-learning-rate", "--power",
         "--total-num-update", "--min-lr", "--lr-period-updates", "--batch-size", "--max-sentences", "--max-tokens",
         "--update-freq", "--tokens-per-sample", "--sample-break-mode", "--ddp-backend", "--fp16", "--bf16",
         "--keep-interval-updates", "--checkpoint-activations", "--no-save")
KNOWN = sorted(set(DIRECT) | set(ARCH) | set(ARCH_SWITCHES) | set(NO_EFFECT) | set(REFUSED) | set(RULES))
SWITCHES = set(ARCH_SWITCHES) | {"--fp16", "--bf16", "--checkpoint-activations", "--no-save", "--cpu",
                                 "--no-progress-bar", "--fp16-no-flatten-grads",
                                 "--skip-invalid-size-inputs-valid-test",
                                 "--disable-validation", "--maximize-best-checkpoint-metric", "--no-epoch-checkpoints",
                                 "--no-last-checkpoints", "--memory-efficient-fp16", "--memory-efficient-bf16",
                                 "--fp16-adam-stats", "--no-seed-provided", "--fix-batches-to-gpus", "--use-old-adam",
                                 "--adaptive-input", "--no-token-positional-embeddings", "--layernorm-embedding",
                                 "--no-decoder-final-norm", "--add-bos-token", "--reset-optimizer",
                                 "--reset-lr-scheduler", "--reset-dataloader", "--reset-meters",
                                 "--no-save-optimizer-state"}


class Problems(list):
    """``(flag, reason)`` of every flag not taken; one error names them all."""

    def add(self, flag: str, reason: str) -> None:
        self.append((flag, reason))

    def message(self) -> str:
        count = f"{len(self)} problems" if len(self) > 1 else "a problem"
        return f"{count} with the fairseq-train flags, each with its reason: " + "; ".join(
            f"{flag} ({reason})" for flag, reason in self)


def parse(text: str, problems: Problems):
    """(positional arguments, flag -> its values) of a fairseq-train command line; unknown flags are problems."""
    try:
        tokens = shlex.split(text.replace("\\\n", " "))
    except ValueError as e:
        raise UsageError(f"fairseq-train arguments cannot be split into words ({e}): check their quotes") from None
    if tokens[:1] == ["fairseq-train"]:
        tokens = tokens[1:]
    positional: List[str] = []
    given: Dict[str, List[str]] = {}
    current: Optional[List[str]] = None
    for token in tokens:
        if token.startswith("-") and not _is_number(token):
            name, eq, value = token.partition("=")
            name = "--arch" if name == "-a" else name
            if name not in KNOWN:
                near = difflib.get_close_matches(name, KNOWN, n=1, cutoff=0.85)
                problems.add(name, "not known here" + (f"; did you mean {near[0]}?" if near else ""))
                current = []
                continue
            current = given[name] = [value] if eq else []
            if name in SWITCHES and not eq:
                current = None
        elif current is None:
            positional.append(token)
        else:
            current.append(token)
            if len(current) == 1:
                current = None  # fairseq's flags take one value; what follows is positional
    return positional, given


def _is_number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False


class Reader:
    """Values of the given flags, converted; a bad value is a problem, not an exception."""

    def __init__(self, given: Dict[str, List[str]], problems: Problems):
        self.given, self.problems = given, problems

    def one(self, name: str, convert: Callable = str, default: Any = None) -> Any:
        if name not in self.given:
            return default
        values = self.given[name]
        if name in SWITCHES:
            if values:
                self.problems.add(name, f"takes no value, got {' '.join(values)}")
            return True
        if len(values) != 1:
            self.problems.add(name, f"takes one value, got {len(values)}")
            return default
        try:
            return convert(values[0])
        except (ValueError, SyntaxError) as e:
            if convert is betas:
                what = "a (beta1, beta2) pair"
            elif "epoch" in str(e):
                what = "one value (a value per epoch is not taken)"
            else:
                what = "a number"
            self.problems.add(name, f"{values[0]!r} is not {what}")
            return default
