"""Evaluators run by the trainer's eval hook and by `--eval-only`."""
from .evaluator import DatasetEvaluator, PPLEvaluator, inference_on_dataset, inference_on_pipeline

__all__ = ["DatasetEvaluator", "PPLEvaluator", "inference_on_dataset", "inference_on_pipeline"]
