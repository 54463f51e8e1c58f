"""Evaluators run by the trainer's eval hook and by `--eval-only`."""
from .evaluator import (DatasetEvaluator, EvalContext, ModelEvaluator, PPLEvaluator, brings_own_data,
                        check_evaluator, inference_on_dataset, run_evaluator)
from .lambada import LambadaEvaluator

__all__ = ["DatasetEvaluator", "EvalContext", "LambadaEvaluator", "ModelEvaluator", "PPLEvaluator", "brings_own_data",
           "check_evaluator", "inference_on_dataset", "run_evaluator"]
