"""Evaluation loop and the perplexity evaluator."""
from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext

import torch

from ..utils.distributed import all_reduce_sum

logger = logging.getLogger("libai_lite")


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


def inference_on_dataset(model, data_loader, evaluator: DatasetEvaluator, eval_iter: int | None = None, autocast=None,
                         loss_context=None, device: torch.device | str = "cpu", dp_group=None) -> dict:
    """Run `model` over at most `eval_iter` batches of `data_loader` and return `evaluator.evaluate()`.

    `autocast` and `loss_context` are context factories (the trainer's precision, and
    loss_parallel when the vocabulary is split over tensor-parallel ranks); `dp_group` the
    data-parallel group the evaluator combines over.
    """
    evaluator.process_group = dp_group
    evaluator.reset()
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    n = 0
    try:
        with torch.no_grad():
            for batch in data_loader:
                if eval_iter is not None and n >= eval_iter:
                    break
                batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
                with autocast() if autocast is not None else nullcontext(), \
                        loss_context() if loss_context is not None else nullcontext():
                    outputs = model(**batch)
                evaluator.process(batch, outputs)
                n += 1
    finally:
        model.train(was_training)
    results = evaluator.evaluate()
    logger.info(f"Evaluated {n} batches in {time.perf_counter() - start:.1f}s: "
                + "  ".join(f"{k}: {v:.4f}" for k, v in results.items()))
    return results


def inference_on_pipeline(stepper, data_loader, evaluator: DatasetEvaluator, eval_iter: int | None, group: int,
                          autocast=None, loss_context=None, dp_group=None) -> dict:
    """`inference_on_dataset` through a pipeline: `group` micro-batches go through the schedule at once."""
    device = stepper.device
    evaluator.process_group = dp_group
    evaluator.reset()
    start = time.perf_counter()
    n, pending = 0, []
    with torch.no_grad():
        for batch in data_loader:
            if eval_iter is not None and n >= max(eval_iter, group):
                break
            pending.append({k: v.to(device) for k, v in batch.items()})
            n += 1
            if len(pending) < group:
                continue
            inputs = {k: torch.cat([b[k] for b in pending]) for k in pending[0]}
            pending = []
            with autocast() if autocast is not None else nullcontext(), \
                    loss_context() if loss_context is not None else nullcontext():
                args, kwargs, labels = stepper.split_batch(inputs)
                outputs = stepper.eval_step(args, labels, kwargs)
            evaluator.process(inputs, outputs)
    results = evaluator.evaluate()
    logger.info(f"Evaluated {n - len(pending)} batches through the pipeline in {time.perf_counter() - start:.1f}s: "
                + "  ".join(f"{k}: {v:.4f}" for k, v in results.items()))
    return results
