"""LAMBADA cloze evaluation: can the model produce the last word of a passage?

JSON lines with a `text` field (the public `lambada_test.jsonl` format) whose last word is the
target; the context is everything before it, and the target is tokenized with the space in front
(`" word"`, the byte-level BPE convention). A passage is right when the greedy prediction at every target
position is the target token. Reports `lambada_acc`, `lambada_ppl` (exp of the mean NLL over
target tokens) and the counts behind them; used as `train.evaluation.evaluator` or through
`tools/evaluate.py --task lambada`.
"""
from __future__ import annotations

import inspect
import logging
import math
import re
import time
from dataclasses import dataclass

import torch
from torch import nn

from ..data.gpt_dataset import IGNORE_INDEX
from ..data.jsonl_dataset import read_jsonl
from ..utils.distributed import all_reduce_sum
from ..utils.errors import UsageError
from .evaluator import EvalContext, ModelEvaluator, eval_mode, format_results

logger = logging.getLogger("libai_lite")

_LAST_WORD = re.compile(r"^(.*\S)\s+(\S+)\s*$", re.DOTALL)


def split_last_word(text: str) -> tuple[str, str] | None:
    """`(context, target word)` of a passage, or None when it has fewer than two words."""
    m = _LAST_WORD.match(text)
    return (m.group(1), m.group(2)) if m else None


def load_lambada(path, json_key: str = "text") -> list[tuple[str, str]]:
    """`(context, target word)` for every passage of a LAMBADA-format JSON-lines file."""
    pairs = []
    for n, text in read_jsonl(path, json_key):
        pair = split_last_word(text)
        if pair is None:
            raise UsageError(f"{path} line {n} has fewer than two words; a LAMBADA passage needs context "
                             f"before its last word")
        pairs.append(pair)
    return pairs


@dataclass
class LambadaExample:
    """Token ids of context + target (context cut on the left to fit) and how many are target."""

    ids: list[int]
    num_target: int


def tokenize_lambada(pairs, tokenizer, max_seq_length: int) -> tuple[list[LambadaExample], int]:
    """Tokenize `(context, word)` pairs as context + `" " + word`; returns the examples and how many were cut.

    The model reads `ids[:-1]`, so an example fits when it has at most `max_seq_length + 1`
    tokens; longer ones keep their rightmost tokens (the target and the nearest context).
    """
    contexts = tokenizer.encode_batch([c for c, _ in pairs])
    targets = tokenizer.encode_batch([" " + w for _, w in pairs])
    examples, cut = [], 0
    for (ctx_text, word), ctx, tgt in zip(pairs, contexts, targets):
        if not ctx or not tgt:
            raise UsageError(f"the passage ending in {word!r} tokenizes to an empty context or target; "
                             f"check the tokenizer matches the data")
        if len(tgt) > max_seq_length:
            raise UsageError(f"the target word {word[:40]!r} is {len(tgt)} tokens, more than max_seq_length="
                             f"{max_seq_length}; evaluate with a model that reads longer sequences")
        ids = ctx + tgt
        if len(ids) > max_seq_length + 1:
            ids = ids[-(max_seq_length + 1):]
            cut += 1
        examples.append(LambadaExample(ids, len(tgt)))
    return examples, cut


def check_decoder_only(model: nn.Module) -> None:
    """Refuse a model that cannot be called as `model(input_ids=...)` (an encoder-decoder, ...)."""
    # DDP keeps the model in `.module`; FSDP2 and tensor parallelism keep the class.
    inner = getattr(model, "module", model)
    params = inspect.signature(inner.forward).parameters
    required = {n for n, p in params.items() if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if "input_ids" not in params or required - {"input_ids"}:
        raise UsageError(f"LAMBADA needs a decoder-only language model called as model(input_ids); "
                         f"{type(inner).__name__} needs {sorted(required)}: evaluate a causal language model")


def greedy_tokens(logits, mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Argmax over the first `vocab_size` ids (never a padding row) at the `mask` positions of `[batch, seq, vocab]`
    logits, lowest id on ties.

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
    return logits[:, :vocab_size].float().argmax(-1)


class LambadaEvaluator(ModelEvaluator):
    """LAMBADA accuracy and target perplexity over a JSON-lines file (see the module docstring).

    `batch_size` defaults to the run's `train.test_micro_batch_size`, `max_seq_length` to the
    model's. Passages are split over data-parallel ranks (each counted once) and the results
    summed over them; tensor parallelism is supported, pipeline parallelism is not.
    """

    def __init__(self, data_path: str, json_key: str = "text", batch_size: int | None = None,
                 max_seq_length: int | None = None):
        self.data_path = str(data_path)
        self.json_key = json_key
        self.batch_size = batch_size
        self.max_seq_length = max_seq_length

    def evaluate_model(self, model, context: EvalContext) -> dict:
        """Evaluate `model` on the file; the result is identical on every rank."""
        if context.pipeline:
            raise UsageError("LAMBADA evaluation does not run under pipeline parallelism; evaluate the checkpoint "
                             "with train.dist.pipeline_parallel_size=1 (it loads on any layout)")
        if context.tokenizer is None:
            raise UsageError("LAMBADA evaluation needs the config's tokenizer (tokenization.tokenizer)")
        max_len = self.max_seq_length or context.max_seq_length
        if not max_len:
            raise UsageError("LAMBADA evaluation needs the model's max_seq_length; pass max_seq_length=")
        check_decoder_only(model)
        start = time.perf_counter()
        examples, cut = tokenize_lambada(load_lambada(self.data_path, self.json_key), context.tokenizer, int(max_len))
        if cut:
            logger.warning(f"{cut} of {len(examples)} LAMBADA passages in {self.data_path} are longer than "
                           f"max_seq_length={max_len} tokens: their context keeps the rightmost tokens")
        batch_size = int(self.batch_size or context.micro_batch_size)
        sums = self._run(model, context, examples, batch_size, int(max_len))
        correct, nll, tokens, count = all_reduce_sum(sums, group=context.dp_group)
        results = {
            "lambada_acc": correct / count,
            "lambada_ppl": math.exp(min(nll / tokens, 80.0)),
            "lambada_examples": count,
            "lambada_target_tokens": tokens,
        }
        logger.info(f"LAMBADA on {self.data_path}: {int(correct)}/{int(count)} passages right in "
                    f"{time.perf_counter() - start:.1f}s: {format_results(results)}")
        return results

    @staticmethod
    def _shard(n: int, rank: int, size: int) -> list[int]:
        """This rank's passages, padded with -1 (a passage that counts zero) to ceil(n / size).

        Equal counts keep ranks in step: under ZeRO-3 every forward gathers parameters
        over the data-parallel group.
        """
        per = -(-n // size)
        mine = list(range(rank * per, min(n, (rank + 1) * per)))
        return mine + [-1] * (per - len(mine))

    def _run(self, model, context: EvalContext, examples: list[LambadaExample], batch_size: int,
             max_len: int) -> list[float]:
        from ..layers import ParallelCrossEntropyLoss

        order = self._shard(len(examples), context.dp_rank, context.dp_size)
        # Longest first: less padding per batch, and memory trouble shows at once.
        order.sort(key=lambda i: -len(examples[i].ids) if i >= 0 else 0)
        vocab = int(context.tokenizer.vocab_size)
        pad = getattr(context.tokenizer, "eod_id", None) or 0
        multiple = max(int(context.tensor_parallel_size), 1)
        cross_entropy = ParallelCrossEntropyLoss()
        totals = torch.zeros(4, dtype=torch.float64)
        with eval_mode(model):
            for b in range(0, len(order), batch_size):
                idx = order[b:b + batch_size]
                batch = [examples[max(i, 0)] for i in idx]
                weight = torch.tensor([1.0 if i >= 0 else 0.0 for i in idx], dtype=torch.float64)
                # Sequence parallelism splits the sequence over tp ranks: keep it divisible.
                length = min(-(-max(len(e.ids) - 1 for e in batch) // multiple) * multiple, max_len)
                input_ids = torch.full((len(batch), length), pad, dtype=torch.long)
                labels = torch.full((len(batch), length), IGNORE_INDEX, dtype=torch.long)
                for row, ex in enumerate(batch):
                    n = len(ex.ids) - 1
                    input_ids[row, :n] = torch.tensor(ex.ids[:-1])
                    labels[row, n - ex.num_target:n] = torch.tensor(ex.ids[-ex.num_target:])
                input_ids, labels = input_ids.to(context.device), labels.to(context.device)
                mask = labels != IGNORE_INDEX
                with context.loss_context():
                    with context.autocast():
                        outputs = model(input_ids=input_ids)
                    logits = outputs["logits"] if isinstance(outputs, dict) else outputs
                    nll = cross_entropy(logits, labels)
                    # Teacher forcing over the target span equals greedy generation of the whole
                    # word: while every earlier target token is predicted right, the model's
                    # greedy prefix is exactly the target prefix fed here, and the first miss
                    # makes the passage wrong either way.
                    hits = greedy_tokens(logits, mask, vocab) == labels[mask]
                misses = torch.zeros(len(batch), device=context.device).index_add_(0, mask.nonzero()[:, 0],
                                                                                  (~hits).float())
                rows = torch.stack([(misses == 0).double(), nll.double().sum(-1), mask.sum(-1).double()]).cpu()
                totals += torch.cat([(rows * weight).sum(-1), weight.sum()[None]])
        return totals.tolist()
