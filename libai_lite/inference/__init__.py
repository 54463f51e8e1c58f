"""Text generation: the decoding loop models' ``generate`` methods share, and its logits processors."""
from .generation import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    build_logits_processors,
    decode,
    eval_mode,
    gather_logits,
    pad_prompts,
    tensor_parallel_group,
)

__all__ = [
    "LogitsProcessorList",
    "RepetitionPenaltyLogitsProcessor",
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "build_logits_processors",
    "decode",
    "eval_mode",
    "gather_logits",
    "pad_prompts",
    "tensor_parallel_group",
]
