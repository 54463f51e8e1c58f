"""Autoregressive decoding shared by decoder-only and encoder-decoder models, and its logits processors.

A model's ``generate`` supplies ``step(tokens) -> logits [batch, vocab]``, fed first the prompt and then
each row's new token, keeping its own cache or not. ``decode`` handles the rest: the real vocabulary,
the processors, greedy or seeded sampling, EOS and padding per row. The processors follow Hugging
Face's ``LogitsProcessor`` semantics and run in LiBai's order: repetition penalty, temperature, top-k, top-p.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from ..utils.errors import UsageError

__all__ = ["LogitsProcessorList", "RepetitionPenaltyLogitsProcessor", "TemperatureLogitsWarper", "TopKLogitsWarper",
           "TopPLogitsWarper", "build_logits_processors", "decode", "eval_mode", "gather_logits", "pad_prompts",
           "tensor_parallel_group"]


class RepetitionPenaltyLogitsProcessor:
    """CTRL's penalty: scores of tokens already in ``input_ids`` are divided by ``penalty`` when positive
    and multiplied by it when negative. Ids outside ``[0, vocab)`` (``decode``'s masked padding) do not count.
    """

    def __init__(self, penalty: float):
        if not penalty > 0:
            raise UsageError(f"repetition_penalty={penalty} must be > 0; use 1.0 for none or e.g. 1.2 "
                             f"(--repetition-penalty)")
        self.penalty = float(penalty)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        # Ids that must not count go to an extra column that is dropped afterwards.
        ids = torch.where((input_ids >= 0) & (input_ids < vocab), input_ids, vocab)
        padded = nn.functional.pad(scores, (0, 1))
        seen = torch.gather(padded, 1, ids)
        seen = torch.where(seen < 0, seen * self.penalty, seen / self.penalty)
        return padded.scatter(1, ids, seen)[:, :vocab]


class TemperatureLogitsWarper:
    """Divide scores by ``temperature`` (< 1 sharpens the distribution, > 1 flattens it)."""

    def __init__(self, temperature: float):
        if not temperature > 0:
            raise UsageError(f"temperature={temperature} must be > 0; use --greedy for deterministic decoding")
        self.temperature = float(temperature)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores / self.temperature


class TopKLogitsWarper:
    """Keep the ``top_k`` highest scores (and any tied with the k-th), set the rest to ``filter_value``."""

    def __init__(self, top_k: int, filter_value: float = -float("inf"), min_tokens_to_keep: int = 1):
        if not isinstance(top_k, int) or top_k < 1:
            raise UsageError(f"top_k={top_k} must be a positive integer; use 0 to turn top-k filtering off")
        self.top_k = max(top_k, min_tokens_to_keep)
        self.filter_value = filter_value

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        k = min(self.top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        return scores.masked_fill(scores < kth, self.filter_value)


class TopPLogitsWarper:
    """Nucleus filtering: keep the smallest set of most likely tokens whose probabilities sum to at
    least ``top_p``; the others get ``filter_value``. At least ``min_tokens_to_keep`` always stay.
    """

    def __init__(self, top_p: float, filter_value: float = -float("inf"), min_tokens_to_keep: int = 1):
        if not 0.0 < top_p <= 1.0:
            raise UsageError(f"top_p={top_p} must be in (0, 1]; use 1.0 to turn nucleus filtering off")
        self.top_p = float(top_p)
        self.filter_value = filter_value
        self.min_tokens_to_keep = min_tokens_to_keep

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # Ascending order: everything whose cumulative mass stays within the discarded 1 - top_p tail goes.
        remove = cumulative <= (1 - self.top_p)
        remove[..., -self.min_tokens_to_keep :] = False
        remove = remove.scatter(1, order, remove)
        return scores.masked_fill(remove, self.filter_value)


class LogitsProcessorList(list):
    """Processors applied one after another: ``processors(input_ids, scores) -> scores``."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for processor in self:
            scores = processor(input_ids, scores)
        return scores


def build_logits_processors(do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                            repetition_penalty: float = 1.0) -> LogitsProcessorList:
    """The processors for these options, in Hugging Face's order; the warpers only when sampling.

    Neutral values (``repetition_penalty=1``, ``temperature=1``, ``top_k=0``, ``top_p=1``) add
    nothing. Out-of-range values raise ``UsageError``.
    """
    # Every value is validated (the constructors refuse bad ones) even where greedy decoding ignores it.
    candidates = [
        (repetition_penalty != 1.0, RepetitionPenaltyLogitsProcessor(repetition_penalty)),
        (do_sample and temperature != 1.0, TemperatureLogitsWarper(temperature)),
        (do_sample and top_k != 0, TopKLogitsWarper(top_k) if top_k != 0 else None),
        (do_sample and top_p != 1.0, TopPLogitsWarper(top_p)),
    ]
    return LogitsProcessorList(p for use, p in candidates if use)


@contextlib.contextmanager
def eval_mode(module: nn.Module):
    """Run the body with ``module`` in eval mode (no dropout) and restore its mode after."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)


def tensor_parallel_group(module: nn.Module):
    """The process group a tensor-parallel ``module``'s DTensor parameters live on; None for a plain module."""
    from torch.distributed.tensor import DTensor

    for p in module.parameters():
        if isinstance(p, DTensor) and p.device_mesh.size() > 1:
            return p.device_mesh.get_group()
    return None


def gather_logits(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary local logits from a vocab-sharded DTensor (a tensor-parallel LM head); others pass through."""
    from torch.distributed.tensor import DTensor

    return logits.full_tensor() if isinstance(logits, DTensor) else logits


@torch.no_grad()
def decode(
    step: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor, *, max_new_tokens: int, vocab_size: int,
    do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    repetition_penalty: float = 1.0, eos_token_id: Union[int, Sequence[int], None] = None,
    pad_token_id: Optional[int] = None, generator: Optional[torch.Generator] = None,
    ignore_mask: Optional[torch.Tensor] = None, sync_group=None, return_logits: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Extend ``input_ids`` ``[batch, len]`` by up to ``max_new_tokens`` tokens chosen from ``step``'s logits.

    ``step`` gets ``input_ids``, then each chosen ``[batch, 1]`` column. Ids at or above ``vocab_size``
    (embedding padding) are never chosen. Greedy unless ``do_sample``, drawing from ``generator``. A row ends
    at an ``eos_token_id`` and is then filled with ``pad_token_id`` (default the first EOS id); decoding
    stops when every row has ended. ``ignore_mask`` keeps prompt padding out of the repetition penalty.
    Under tensor parallelism every rank takes ``sync_group``'s first rank's choice. Returns
    ``[batch, len + new]`` and, with ``return_logits``, the raw logits ``[batch, new, vocab_size]``.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise UsageError(f"max_new_tokens={max_new_tokens} must be a non-negative integer (--max-new-tokens)")
    processors = build_logits_processors(do_sample, temperature, top_k, top_p, repetition_penalty)
    device = input_ids.device
    eos = None if eos_token_id is None else torch.tensor(
        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), dtype=torch.long, device=device)
    if pad_token_id is None and eos is not None:
        pad_token_id = int(eos[0])
    src = dist.get_global_rank(sync_group, 0) if sync_group is not None else None

    sequences = input_ids
    counted = input_ids if ignore_mask is None else input_ids.masked_fill(ignore_mask, -1)
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=device)
    kept: List[torch.Tensor] = []
    logits = step(input_ids) if max_new_tokens else None
    for i in range(max_new_tokens):
        if logits.shape[-1] < vocab_size:
            raise UsageError(f"vocab_size={vocab_size} exceeds the model's {logits.shape[-1]} output logits; "
                             f"pass the tokenizer's vocabulary size")
        scores = logits[:, :vocab_size].float()
        if return_logits:
            kept.append(scores)
        scores = processors(counted, scores)
        if do_sample:
            next_tokens = torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)
        else:
            next_tokens = scores.argmax(dim=-1)
        if src is not None:
            dist.broadcast(next_tokens, src=src, group=sync_group)
        if eos is not None:
            next_tokens = torch.where(finished, torch.full_like(next_tokens, pad_token_id), next_tokens)
            finished = finished | torch.isin(next_tokens, eos)
        sequences = torch.cat([sequences, next_tokens[:, None]], dim=1)
        counted = torch.cat([counted, next_tokens[:, None]], dim=1)
        if i + 1 == max_new_tokens or (eos is not None and bool(finished.all())):
            break
        logits = step(next_tokens[:, None])
    if return_logits:
        empty = torch.empty(input_ids.shape[0], 0, vocab_size, device=device)
        return sequences, (torch.stack(kept, dim=1) if kept else empty)
    return sequences


def pad_prompts(
    prompts: Iterable[Sequence[int]], pad_token_id: int, side: str = "left", device=None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Batch token-id lists of different lengths: ``(ids, attention_mask)`` padded on ``side``.

    Decoder-only models take left padding (every row's last token sits in the last column, so
    the next token of every row comes from the same position); encoders take right padding.
    """
    rows = [torch.tensor([int(i) for i in p], dtype=torch.long) for p in prompts]
    if not rows or any(len(r) == 0 for r in rows):
        raise UsageError("every prompt needs at least one token; remove empty prompts")
    ids = pad_sequence(rows, batch_first=True, padding_value=int(pad_token_id), padding_side=side)
    mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_value=0, padding_side=side)
    return ids.to(device), mask.to(device)
