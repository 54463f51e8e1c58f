"""LAMBADA cloze evaluation: can the model produce the last word of a passage?

Reads JSON lines with a `text` field whose last word is the target, tokenized with its leading space.
A passage is right when the greedy prediction at every target position is the target token. Reports
`lambada_acc`, `lambada_ppl` (exp of the mean NLL over target tokens) and their counts; used as
`train.evaluation.evaluator` or through `tools/evaluate.py --task lambada`.
"""
from __future__ import annotations

import inspect
import logging
import math
import re
import time

from torch import nn

from ..data.jsonl_dataset import read_jsonl
from ..utils.distributed import all_reduce_sum
from ..utils.errors import UsageError
from .evaluator import EvalContext, ModelEvaluator, format_results
from .scoring import ScoringExample, score

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


def tokenize_lambada(pairs, tokenizer, max_seq_length: int) -> tuple[list[ScoringExample], int]:
    """Tokenize `(context, word)` pairs as context + `" " + word`; returns the examples and how many were cut.

    The context starts with BOS when the tokenizer adds one, as transformers' `tokenizer(context)` does.
    The model reads `ids[:-1]`, so an example fits in `max_seq_length + 1` tokens; longer ones keep the BOS
    and their rightmost tokens.
    """
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos_token else []
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
        if len(bos) + len(ids) > max_seq_length + 1:
            ids = ids[-(max_seq_length + 1 - len(bos)):]
            cut += 1
        ids = bos + ids
        examples.append(ScoringExample(ids, len(tgt)))
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


class LambadaEvaluator(ModelEvaluator):
    """LAMBADA accuracy and target perplexity over a JSON-lines file.

    `batch_size` defaults to `train.test_micro_batch_size`, `max_seq_length` to the model's. Passages are
    split over data-parallel ranks and results summed; tensor parallelism works, pipeline parallelism does not.
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

    def _run(self, model, context: EvalContext, examples: list[ScoringExample], batch_size: int,
             max_len: int) -> list[float]:
        """`[passages right, target NLL, target tokens, passages]` of this rank's share."""
        order = self._shard(len(examples), context.dp_rank, context.dp_size)
        tokenizer = context.tokenizer
        pad = getattr(tokenizer, "eod_id", None) or 0
        # Teacher forcing over the target span equals greedy generation of the whole word: while
        # every earlier target token is predicted right, the model's greedy prefix is exactly the
        # target prefix fed here, and the first miss makes the passage wrong either way.
        scored = score(model, context, [examples[max(i, 0)] for i in order], batch_size=batch_size,
                       max_seq_length=max_len, vocab_size=int(tokenizer.vocab_size), pad_id=pad)
        totals = [0.0, 0.0, 0.0, 0.0]
        for i, (logprob, greedy) in zip(order, scored):
            if i >= 0:
                totals = [totals[0] + greedy, totals[1] - logprob, totals[2] + examples[i].num_target, totals[3] + 1]
        return totals
