"""Evaluators, what a run hands them, and the loop that feeds them.

A `DatasetEvaluator` is fed the batches of a loader the trainer built. An evaluator with an
`evaluate_model(model, context)` method instead reads and batches its own data (LAMBADA): the
trainer (periodic evaluation, `--eval-only`, `tools/evaluate.py`) calls it with the model it runs
and an `EvalContext`, and logs the returned dict like any evaluation result.
"""
from __future__ import annotations

import inspect
import logging
import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..config.instantiate import instantiate_target
from ..utils.distributed import all_reduce_max, all_reduce_sum
from ..utils.errors import UsageError
from ..utils.process import stop_requested

logger = logging.getLogger("libai_lite")


@dataclass
class EvalContext:
    """The run's pieces an evaluator needs.

    `autocast` and `loss_context` are context factories (precision; `loss_parallel` for a vocabulary
    split over tp ranks); results are summed over `dp_group`; sequence lengths should be multiples
    of `tensor_parallel_size`; `pipeline`: the model runs as pipeline stages (not callable as one).
    """

    tokenizer: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: Any = None
    tensor_parallel_size: int = 1
    micro_batch_size: int = 8
    max_seq_length: int | None = None
    autocast: Callable = nullcontext
    loss_context: Callable = nullcontext
    pipeline: bool = False


class ModelEvaluator:
    """Base for evaluators that bring their own data: implement `evaluate_model`."""

    def evaluate_model(self, model, context: EvalContext) -> dict:
        """Evaluate `model` and return `{metric name: float}`, identical on every rank."""
        raise NotImplementedError


def brings_own_data(evaluator) -> bool:
    """True when the trainer should call `evaluator.evaluate_model` instead of feeding it batches."""
    return callable(getattr(evaluator, "evaluate_model", None))


def check_evaluator(node, key: str = "train.evaluation.evaluator") -> None:
    """Refuse, before a run trains, an evaluator node it cannot evaluate with: none, a class that is neither a
    ``DatasetEvaluator`` (``reset``, ``process``, ``evaluate``) nor brings its own data (``evaluate_model``), or
    arguments its class does not take. A factory function is only called when the evaluation runs."""
    fix = "or set train.evaluation.enabled=False"
    if node is None or "_target_" not in node:
        raise UsageError(f"{key} is not set: the run evaluates with it; set it to a LazyCall of an evaluator "
                         f"(libai_lite.evaluation.PPLEvaluator), {fix}")
    target = instantiate_target(node)
    if not inspect.isclass(target):
        return
    name = node._target_ if isinstance(node._target_, str) else f"{target.__module__}.{target.__qualname__}"
    if not (brings_own_data(target) or all(callable(getattr(target, m, None)) for m in ("reset", "process",
                                                                                          "evaluate"))):
        raise UsageError(f"{key}._target_={name!r} is not an evaluator: it has neither reset, process and evaluate "
                         f"(a DatasetEvaluator, fed the valid batches) nor evaluate_model (one that reads its own "
                         f"data); set {key}._target_ to such a class (libai_lite.evaluation.PPLEvaluator), {fix}")
    kwargs = {k: None for k in node if k not in ("_target_", "_recursive_", "_partial_")}
    try:
        inspect.signature(target).bind(**kwargs)
    except TypeError as e:
        raise UsageError(f"{key}: {name} cannot be built from {sorted(kwargs)} ({e}); correct the arguments of {key}"
                         ) from None
    except ValueError:  # no signature to read (a builtin): the evaluation will say
        pass


class DatasetEvaluator:
    """Accumulates model outputs over an evaluation set: `reset`, `process` per batch, `evaluate` at the end.

    `process_group` (set by the inference loop) is the data-parallel group whose ranks saw the
    other batches; `evaluate` combines over it.
    """

    process_group = None

    def reset(self) -> None:
        raise NotImplementedError

    def process(self, inputs: dict, outputs: dict) -> None:
        raise NotImplementedError

    def evaluate(self) -> dict:
        raise NotImplementedError


class PPLEvaluator(DatasetEvaluator):
    """Perplexity = exp of the token-weighted mean NLL, summed over every data-parallel rank.

    Needs the model's `nll_sum` and `num_tokens` outputs, so batches with different numbers of
    real (non-padding) tokens are weighted correctly.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._nll = 0.0
        self._tokens = 0.0

    def process(self, inputs: dict, outputs: dict) -> None:
        self._nll += float(outputs["nll_sum"].detach().float().sum())
        self._tokens += float(outputs["num_tokens"].detach().float().sum())

    def evaluate(self) -> dict:
        nll, tokens = all_reduce_sum([self._nll, self._tokens], group=self.process_group)
        if tokens == 0:
            logger.warning("Perplexity evaluation saw no tokens; check train.evaluation.eval_iter and the valid split")
            return {}
        mean = nll / tokens
        return {"PPL": math.exp(min(mean, 80.0)), "lm_loss": mean, "tokens": tokens}


def format_results(results: dict) -> str:
    return "  ".join(f"{k}: {v:.4f}" for k, v in results.items())


@contextmanager
def eval_mode(model):
    """`model` in eval mode without autograd; its mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


# Seconds between two "Inference done X/Y" lines (LiBai's progress line); a shorter evaluation logs none.
PROGRESS_EVERY_S = 10.0


class EvaluationStopped(Exception):
    """A stop signal (on any rank) ended an evaluation early; the trainer checkpoints and stops as in training."""


def _total_batches(data_loader, limit: int | None) -> int | None:
    try:
        n = len(data_loader)
    except TypeError:
        return limit
    return n if limit is None else min(n, limit)


def _progress_line(done: int, total: int | None, start: float) -> str:
    elapsed = time.perf_counter() - start
    if not total:
        return f"Inference done {done} batches in {elapsed:.0f}s"
    eta = elapsed * (total - done) / max(done, 1)
    return f"Inference done {done}/{total}. {elapsed / max(done, 1):.4f} s/iter. ETA={eta:.0f}s"


def inference_on_dataset(model, data_loader, evaluator: DatasetEvaluator, eval_iter: int | None = None,
                         context: EvalContext | None = None, pipeline=None) -> dict:
    """Run `model` over at most `eval_iter` batches of `data_loader` and return `evaluator.evaluate()`.

    `context` gives the device, precision and loss contexts and the data-parallel group. With `pipeline`
    (a ``PipelineStepper``), `eval_iter` is rounded up to whole schedule steps. Progress is logged every
    ``PROGRESS_EVERY_S``; a stop signal deferred by the trainer ends evaluation at the next batch on every
    rank with ``EvaluationStopped``.
    """
    context = context or EvalContext()
    group = pipeline.n_microbatches if pipeline is not None else 1
    limit = None if eval_iter is None else -(-eval_iter // group) * group
    evaluator.process_group = context.dp_group
    evaluator.reset()
    start = last_log = time.perf_counter()
    total = _total_batches(data_loader, limit)
    n, pending = 0, []
    with eval_mode(model):
        for batch in data_loader:
            if limit is not None and n + len(pending) >= limit:
                break
            # All ranks agree (a signal may reach one rank first): a rank leaving alone would leave
            # the others waiting in the model's collectives.
            if all_reduce_max([1.0 if stop_requested() is not None else 0.0])[0] > 0:
                raise EvaluationStopped(f"evaluation stopped by a stop signal after {n}"
                                        f"{'/' + str(total) if total else ''} batches")
            if time.perf_counter() - last_log >= PROGRESS_EVERY_S:
                last_log = time.perf_counter()
                logger.info(_progress_line(n, total, start))
            pending.append({k: v.to(context.device, non_blocking=True) for k, v in batch.items()})
            if len(pending) < group:
                continue
            inputs = pending[0] if group == 1 else {k: torch.cat([b[k] for b in pending]) for k in pending[0]}
            n, pending = n + len(pending), []
            with context.autocast(), context.loss_context():
                if pipeline is None:
                    outputs = model(**inputs)
                else:
                    args, kwargs, labels = pipeline.split_batch(inputs)
                    outputs = pipeline.eval_step(args, labels, kwargs)
            evaluator.process(inputs, outputs)
    results = evaluator.evaluate()
    where = " through the pipeline" if pipeline is not None else ""
    logger.info(f"Evaluated {n} batches{where} in {time.perf_counter() - start:.1f}s: {format_results(results)}")
    return results


def run_evaluator(evaluator, model, loader, context: EvalContext, eval_iter: int | None = None) -> dict:
    """`evaluator` on `model` (a ``ParallelModel``): over at most `eval_iter` batches of `loader`, or its own data."""
    if brings_own_data(evaluator):
        return evaluator.evaluate_model(model.module, context)
    return inference_on_dataset(model.module, loader, evaluator, eval_iter, context, model.pipeline)
