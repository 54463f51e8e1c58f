"""Evaluators run by the trainer's eval hook and by `--eval-only`."""
from .evaluator import DatasetEvaluator, PPLEvaluator, inference_on_dataset, run_evaluator
from .lambada import LambadaEvaluator
from .model_evaluator import EvalContext, ModelEvaluator, brings_own_data

__all__ = ["DatasetEvaluator", "EvalContext", "LambadaEvaluator", "ModelEvaluator", "PPLEvaluator", "brings_own_data",
           "inference_on_dataset", "run_evaluator"]
