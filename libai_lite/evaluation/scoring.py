"""Log-likelihood of target tokens under a model, the question LAMBADA and lm-evaluation-harness ask.

A `ScoringExample` holds the tokens a model reads and how many at the end are the target; `score`
returns, per example, the summed log-probability of the target and whether greedy decoding produces it.
Probabilities are over the tokenizer's real vocabulary: the embedding's padding rows take no mass, as in
the Hugging Face model the checkpoint converts to.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.gpt_dataset import IGNORE_INDEX
from .evaluator import EvalContext, eval_mode


@dataclass
class ScoringExample:
    """Decoder-only: `ids` = context + target, the last `num_target` of them scored (the model reads
    `ids[:-1]`). Encoder-decoder: `encoder_ids` is the context and `ids` the target, all scored."""

    ids: list[int]
    num_target: int
    encoder_ids: list[int] | None = None


def target_logits(logits, mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """fp32 logits over the first `vocab_size` ids at the `mask` positions of `[batch, seq, vocab]` logits.

    Logits whose vocabulary is split over tensor-parallel ranks (a DTensor sharded on its last
    dim) are gathered only at the masked positions: a few rows, not the whole batch.
    """
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(logits, DTensor):
        placements = logits.placements
        if len(placements) == 1 and placements[0].is_shard() and placements[0].dim % logits.ndim == logits.ndim - 1:
            # The padded vocabulary divides evenly over tensor-parallel ranks (check_declared_splits).
            picked = DTensor.from_local(logits.to_local()[mask], logits.device_mesh, [Shard(1)], run_check=False)
            logits = picked.full_tensor()
        else:
            logits = logits.full_tensor()[mask]
    else:
        logits = logits[mask]
    return logits[:, :vocab_size].float()


def greedy_tokens(logits, mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Argmax over the first `vocab_size` ids (never a padding row) at the `mask` positions, lowest id on ties."""
    return target_logits(logits, mask, vocab_size).argmax(-1)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _decoder_batch(batch: list[ScoringExample], pad: int, multiple: int, max_len: int):
    length = min(_round_up(max(len(e.ids) - 1 for e in batch), multiple), max_len)
    input_ids = torch.full((len(batch), length), pad, dtype=torch.long)
    labels = torch.full((len(batch), length), IGNORE_INDEX, dtype=torch.long)
    for row, ex in enumerate(batch):
        n = len(ex.ids) - 1
        input_ids[row, :n] = torch.tensor(ex.ids[:-1])
        labels[row, n - ex.num_target:n] = torch.tensor(ex.ids[-ex.num_target:])
    return {"input_ids": input_ids}, labels


def _encoder_decoder_batch(batch: list[ScoringExample], pad: int, decoder_start: int, multiple: int):
    # Right padding throughout: the encoder masks it, and the decoder's causal attention never lets
    # a real position read the padding after it.
    enc_len = _round_up(max(len(e.encoder_ids) for e in batch), multiple)
    dec_len = _round_up(max(len(e.ids) for e in batch), multiple)
    enc = torch.full((len(batch), enc_len), pad, dtype=torch.long)
    dec = torch.full((len(batch), dec_len), pad, dtype=torch.long)
    labels = torch.full((len(batch), dec_len), IGNORE_INDEX, dtype=torch.long)
    for row, ex in enumerate(batch):
        enc[row, :len(ex.encoder_ids)] = torch.tensor(ex.encoder_ids)
        dec[row, :len(ex.ids)] = torch.tensor([decoder_start] + ex.ids[:-1])
        labels[row, :len(ex.ids)] = torch.tensor(ex.ids)
    enc_lengths = torch.tensor([len(e.encoder_ids) for e in batch])
    inputs = {"encoder_input_ids": enc, "decoder_input_ids": dec,
              "encoder_attn_mask": torch.arange(enc_len)[None] < enc_lengths[:, None],
              "decoder_attn_mask": labels != IGNORE_INDEX}
    return inputs, labels


@torch.no_grad()
def score(model, context: EvalContext, examples: list[ScoringExample], *, batch_size: int, max_seq_length: int,
          vocab_size: int, pad_id: int = 0, decoder_start_id: int | None = None) -> list[tuple[float, bool]]:
    """`(log-probability of the target, greedy decoding gives the target)` for each example, in order.

    Decoder-only examples must fit `max_seq_length + 1` tokens (cut them on the left first); encoder-decoder
    examples (`encoder_ids` set) need `decoder_start_id`. Longest examples are batched first, so memory
    trouble shows at once; lengths are rounded up to a multiple of the tensor-parallel size for sequence
    parallelism. Every tensor-parallel rank must call it with the same examples.
    """
    if not examples:
        return []
    order = sorted(range(len(examples)), key=lambda i: -(len(examples[i].ids) + len(examples[i].encoder_ids or ())))
    multiple = max(int(context.tensor_parallel_size), 1)
    out: list[tuple[float, bool] | None] = [None] * len(examples)
    with eval_mode(model):
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            batch = [examples[i] for i in idx]
            if batch[0].encoder_ids is not None:
                inputs, labels = _encoder_decoder_batch(batch, pad_id, decoder_start_id, multiple)
            else:
                inputs, labels = _decoder_batch(batch, pad_id, multiple, max_seq_length)
            inputs = {k: v.to(context.device) for k, v in inputs.items()}
            labels = labels.to(context.device)
            mask = labels != IGNORE_INDEX
            with context.autocast():
                outputs = model(**inputs)
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs
            rows = target_logits(logits, mask, vocab_size)
            wanted = labels[mask]
            token_logprob = rows.log_softmax(-1).gather(1, wanted[:, None])[:, 0].double()
            hit = rows.argmax(-1) == wanted
            which = mask.nonzero()[:, 0]
            logprob = torch.zeros(len(batch), dtype=torch.float64, device=rows.device).index_add_(0, which, token_logprob)
            misses = torch.zeros(len(batch), device=rows.device).index_add_(0, which, (~hit).float())
            for i, lp, miss in zip(idx, logprob.tolist(), misses.tolist()):
                out[i] = (lp, miss == 0)
    return out
