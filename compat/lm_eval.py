"""The `libai_lite` model of lm-evaluation-harness: any config + checkpoint, scored on the harness's tasks.

    python tools/eval_harness.py --model libai_lite --tasks lambada_openai --batch_size 8 \\
        --model_args config=projects/GPT/configs/gpt2_pretrain.py,checkpoint=output/gpt2_pretrain/model_final

`model_args`: `config`, `checkpoint`, `max_length`, `max_gen_toks`, `add_bos_token` (as the `hf` model's),
`verify` (checksums) and any dotted config override. Decoder-only models answer `loglikelihood`,
`loglikelihood_rolling` and `generate_until`; encoder-decoder models (context to the encoder) the first and
the last. Probabilities are over the tokenizer's real vocabulary, so LAMBADA equals `tools/evaluate.py
--task lambada`. The harness has no plugin entry point: importing this module registers the model.
"""
from __future__ import annotations

import logging

import torch

from libai_lite.engine.launch import build_eval_trainer
from libai_lite.evaluation.scoring import ScoringExample, score
from libai_lite.inference import pad_prompts
from libai_lite.model import is_encoder_decoder, max_seq_length, special_token_ids, unwrap
from libai_lite.utils.errors import UsageError

try:
    from lm_eval import utils as lm_eval_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as e:  # pragma: no cover - the [eval] extra is installed in CI
    raise UsageError("lm-evaluation-harness is not installed; install the extra: pip install -e '.[eval]'") from e

logger = logging.getLogger("libai_lite")

_OWN_ARGS = ("config", "checkpoint", "max_length", "max_gen_toks", "add_bos_token", "verify", "batch_size",
             "max_batch_size", "device")


def _override(key: str, value) -> str:
    if isinstance(value, bool):
        value = "true" if value else "false"
    return f"{key}={value}"


@register_model("libai_lite")
class LibaiLiteLM(TemplateLM):
    """lm-evaluation-harness model over a libai_lite config and checkpoint (see the module docstring)."""

    def __init__(self, config: str | None = None, checkpoint: str | None = None, max_length: int | None = None,
                 max_gen_toks: int = 256, add_bos_token: bool = False, verify: bool = True, batch_size=None,
                 max_batch_size=None,
                 device=None, **kwargs):
        super().__init__()
        if not config or not checkpoint:
            raise UsageError("the libai_lite model needs --model_args config=CONFIG.py,checkpoint=DIR")
        unknown = sorted(k for k in kwargs if "." not in k)
        if unknown:
            raise UsageError(f"unknown libai_lite model_args {unknown}: use {', '.join(_OWN_ARGS[:6])} or a dotted "
                             f"config override such as train.dist.tensor_parallel_size=2")
        if device not in (None, "cpu", "cuda") and not str(device).startswith("cuda"):
            raise UsageError(f"--device {device}: the libai_lite model runs where its config puts it "
                             f"(train.device); leave --device out")
        opts = [_override(k, v) for k, v in kwargs.items()]
        self._trainer = build_eval_trainer(str(config), str(checkpoint), opts, subdir="lm_eval", verify=bool(verify))
        trainer = self._trainer
        if trainer.model.pipeline is not None:
            raise UsageError("the harness does not run under pipeline parallelism; evaluate with "
                             "train.dist.pipeline_parallel_size=1 (the checkpoint loads on any layout)")
        if trainer.layout.data_parallel_size > 1:
            raise UsageError(f"the harness runs on one model replica, but the layout has data_parallel_size="
                             f"{trainer.layout.data_parallel_size}; launch as many processes as "
                             f"train.dist.tensor_parallel_size")
        if trainer.tokenizer is None:
            raise UsageError("the harness sends text: the config needs a tokenizer (tokenization.tokenizer)")
        self.tokenizer = trainer.tokenizer
        self._context = trainer.eval_context()
        self._module = trainer.model.module
        self._source = unwrap(trainer.model.source)
        self.backend = "seq2seq" if is_encoder_decoder(self._source) else "causal"
        self._ids = special_token_ids(self._source, self.tokenizer)
        if self._ids.get("eos") is None:
            raise UsageError(f"{type(self.tokenizer).__name__} has no end-of-text id; the harness needs one to "
                             f"condition on an empty context and to stop generation")
        self._max_length = int(max_length or max_seq_length(self._source) or 0)
        if self._max_length < 2:
            raise UsageError("the harness needs the model's longest sequence: pass max_length= in --model_args")
        self._max_gen_toks = int(max_gen_toks)
        self._add_bos = bool(add_bos_token)
        if self._add_bos and getattr(self.tokenizer, "bos_token_id", None) is None:
            raise UsageError(f"add_bos_token=True but {type(self.tokenizer).__name__} has no BOS token")
        self._batch_size = int(batch_size) if str(batch_size or "").isdigit() else self._context.micro_batch_size
        self._device = self._context.device

    # ------------------------------------------------------------------ what TemplateLM asks
    @property
    def eot_token_id(self) -> int:
        return int(self._ids["eos"])

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return int(bos) if bos is not None and self.backend == "causal" else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return type(self.tokenizer).__name__

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids of `string`; an encoder input ends with eos, as T5's training data does, and with
        `add_bos_token` a decoder-only model's request starts with BOS."""
        ids = list(self.tokenizer.encode(string))
        if self._add_bos and self.backend == "causal" and add_special_tokens is not False:
            ids.insert(0, int(self.tokenizer.bos_token_id))
        if self.backend == "seq2seq" and add_special_tokens is not False:
            ids.append(self.eot_token_id)
        return ids

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    def _score(self, examples) -> list[tuple[float, bool]]:
        return score(self._module, self._context, examples, batch_size=self._batch_size,
                     max_seq_length=self._max_length, vocab_size=int(self.tokenizer.vocab_size),
                     pad_id=int(self._ids["pad"]), decoder_start_id=self._ids.get("decoder_start"))

    def _example(self, context_enc: list[int], continuation_enc: list[int]):
        if not continuation_enc:
            raise UsageError("a request's continuation tokenizes to nothing; the task's target must be text")
        if len(continuation_enc) > self._max_length:
            raise UsageError(f"a continuation of {len(continuation_enc)} tokens is longer than max_length="
                             f"{self._max_length}")
        if self.backend == "seq2seq":
            return ScoringExample(list(continuation_enc), len(continuation_enc),
                                  encoder_ids=list(context_enc)[-self._max_length:])
        # The model reads ids[:-1]: keep the continuation and the nearest context.
        ids = (list(context_enc) + list(continuation_enc))[-(self._max_length + 1):]
        return ScoringExample(ids, len(continuation_enc))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self._score([self._example(ctx, cont) for _, ctx, cont in requests])
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood in windows of `max_length` tokens, each token predicted once."""
        if self.backend != "causal":
            raise UsageError("loglikelihood_rolling (perplexity tasks such as wikitext) needs a decoder-only model")
        examples, owner = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            windows = lm_eval_utils.get_rolling_token_windows(
                # The prefix token (BOS where the tokenizer has one) starts the document.
                token_list=self.tok_encode(text, add_special_tokens=False), prefix_token=self.prefix_token_id,
                max_seq_len=self._max_length, context_len=1)
            for context, pred in map(lm_eval_utils.make_disjoint_window, windows):
                examples.append(self._example(context, pred))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, self._score(examples)):
            totals[n] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with `do_sample`) continuations, cut before the first `until` string.

        Requests with the same generation options decode together, `batch_size` at a time.
        """
        import json

        groups: dict[str, list[int]] = {}
        for n, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(n)
        out = [""] * len(requests)
        for members in groups.values():
            gen_kwargs = dict(requests[members[0]].args[1])
            for b in range(0, len(members), self._batch_size):
                chunk = members[b:b + self._batch_size]
                texts = self._generate([requests[n].args[0] for n in chunk], dict(gen_kwargs))
                for n, text in zip(chunk, texts):
                    out[n] = text
                    self.cache_hook.add_partial("generate_until", requests[n].args, text)
        return out

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(gen_kwargs.pop("max_gen_toks", self._max_gen_toks))
        do_sample = bool(gen_kwargs.pop("do_sample", False))
        options = {k: gen_kwargs.pop(k) for k in ("temperature", "top_k", "top_p", "repetition_penalty")
                   if k in gen_kwargs}
        if options.get("temperature") == 0.0:  # the harness's way of asking for greedy decoding
            do_sample = False
            options.pop("temperature")
        if not do_sample:
            options = {k: v for k, v in options.items() if k == "repetition_penalty"}
        if gen_kwargs:
            logger.warning(f"libai_lite ignores the generation options {sorted(gen_kwargs)}")
        rows = [self.tok_encode(c) for c in contexts]
        if self.backend == "seq2seq":
            rows = [r[-self._max_length:] for r in rows]
            batch, mask = pad_prompts(rows, self._ids["pad"], side="right", device=self._device)
            options["decoder_start_token_id"] = self._ids["decoder_start"]
        else:
            # The prompt keeps its rightmost tokens, leaving room for max_gen_toks new ones.
            keep = max(self._max_length - max_new, 1)
            rows = [r[-keep:] for r in rows]
            batch, mask = pad_prompts(rows, self._ids["pad"], side="left", device=self._device)
            max_new = min(max_new, self._max_length - batch.shape[1])
        generator = torch.Generator(device=self._device).manual_seed(1234)
        out = self._source.generate(batch, mask, max_new_tokens=max_new, do_sample=do_sample,
                                    eos_token_id=self.eot_token_id, pad_token_id=self._ids["pad"],
                                    vocab_size=int(self.tokenizer.vocab_size), generator=generator, **options)
        new = out[:, 1:] if self.backend == "seq2seq" else out[:, batch.shape[1]:]
        texts = []
        for row in new.tolist():
            if self.eot_token_id in row:
                row = row[:row.index(self.eot_token_id)]
            text = self.tok_decode(row)
            cut = min((text.index(stop) for stop in until if stop and stop in text), default=len(text))
            texts.append(text[:cut])
        return texts
