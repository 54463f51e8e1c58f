"""Evaluating a built run: the periodic evaluation, `--eval-only` over every split, `tools/evaluate.py`."""
from __future__ import annotations

import inspect
import logging
import os

from ..config import instantiate
from ..config.instantiate import instantiate_target, instantiate_with
from ..model import max_seq_length
from .evaluator import EvalContext, brings_own_data, format_results, run_evaluator

logger = logging.getLogger("libai_lite")


def eval_context(layout, model, tokenizer, micro_batch_size: int, autocast, loss_context) -> EvalContext:
    """What evaluators get from a run: its `layout`, `model` (a ``ParallelModel``), batch size and the context
    factories of its precision (`autocast`) and of its loss over a vocabulary split over tp ranks."""
    return EvalContext(
        tokenizer=tokenizer, device=layout.device, dp_rank=layout.dp_rank, dp_size=layout.data_parallel_size,
        dp_group=layout.group("dp"), tensor_parallel_size=layout.tensor_parallel_size,
        micro_batch_size=int(micro_batch_size), max_seq_length=max_seq_length(model.source),
        autocast=autocast, loss_context=loss_context, pipeline=model.pipeline is not None,
    )


def build_test_loaders(nodes, model, context: EvalContext) -> list:
    """`(name, loader, None)` for each LazyCall in `dataloader.test` (LiBai's key), evaluated whole.

    The builder gets those of the run's tokenizer, sequence length, batch size and data-parallel layout
    that it accepts and the config leaves unset.
    """
    if not nodes:
        return []
    tokenizer = context.tokenizer
    runtime = {
        "tokenizer": tokenizer,
        "seq_length": context.max_seq_length,
        "micro_batch_size": context.micro_batch_size,
        "data_parallel_rank": context.dp_rank,
        "data_parallel_size": context.dp_size,
        "vocab_size": tokenizer.vocab_size if tokenizer is not None else None,
        # A pipeline schedule evaluates all its micro-batches at once.
        "batches_multiple_of": model.pipeline.n_microbatches if model.pipeline is not None else 1,
    }
    out = []
    for i, node in enumerate([nodes] if "_target_" in nodes else nodes):
        accepted = inspect.signature(instantiate_target(node)).parameters
        kwargs = {k: v for k, v in runtime.items() if k in accepted and node.get(k) is None}
        name = os.path.splitext(os.path.basename(str(node.get("data_path") or node.get("data_prefix") or "")))[0]
        out.append((name or f"test{i}", instantiate_with(node, **kwargs), None))
    return out


def evaluate_splits(evaluator_node, test_nodes, model, splits, context: EvalContext) -> dict:
    """`--eval-only`: the evaluator `evaluator_node` builds (`train.evaluation.evaluator`) on each
    `(name, loader, eval_iter)` of `splits` and each loader of `test_nodes` (`dataloader.test`), as
    `name/metric`; an evaluator that brings its own data runs once."""
    evaluator = instantiate(evaluator_node)
    if brings_own_data(evaluator):
        results = run_evaluator(evaluator, model, None, context)
    else:
        results = {}
        for split, loader, eval_iter in splits + build_test_loaders(test_nodes, model, context):
            if loader is not None:
                res = run_evaluator(evaluator, model, loader, context, eval_iter)
                results.update({f"{split}/{k}": v for k, v in res.items()})
    logger.info(f"Evaluation results: {format_results(results)}")
    return results
