"""Evaluators that bring their own data (LAMBADA, ...) and what the trainer hands them.

A `DatasetEvaluator` is fed the batches of a loader the trainer built. An evaluator with an
`evaluate_model(model, context)` method instead reads and batches its own data; the trainer
(periodic evaluation, `--eval-only`, `tools/evaluate.py`) calls it with the model it runs and an
`EvalContext`, and logs the returned dict like any evaluation result.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class EvalContext:
    """The run's pieces an evaluator needs.

    `autocast` and `loss_context` are context factories (the run's precision, and `loss_parallel`
    when the vocabulary is split over tensor-parallel ranks); `dp_group` is the data-parallel
    process group results are summed over; inputs' sequence length should be a multiple of
    `tensor_parallel_size` (sequence parallelism splits it); `pipeline` is True when the model
    runs as pipeline stages (then `model` is not callable as one module).
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
