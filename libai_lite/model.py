"""The model protocol: everything the engine, the parallel code and the checkpointer learn from a model.

A model is an ``nn.Module`` a config builds (``LazyCall(MyLMForPreTraining)(cfg=...)``). The core
never names it, imports its project or reads a config key only it has; it asks the model:

Required
    ``forward(**batch) -> dict``: one micro-batch of the train loader in; the trainer uses the entries
        ``output_metrics()`` declares, evaluators others (``nll_sum``, ``num_tokens``).
    ``output_metrics() -> {name: Metric}``: which outputs are back-propagated (their sum is the step's
        ``total_loss``) and how each logged value reduces over micro-batches and data-parallel ranks.

Optional (the feature that needs it says so in one line when it is missing)
    ``tokens_per_sample(sample) -> int`` and ``flops_per_sample(sample) -> float`` of one unbatched
        training sample, for tokens/s and MFU (count FLOPs at construction: a pipeline removes pieces).
    ``max_seq_length``: the longest sequence the model takes (evaluators, generation).
    ``generate(input_ids, attention_mask, **options)`` (``libai_lite.inference.decode``'s options); an
        encoder-decoder's takes ``encoder_input_ids`` and ``decoder_start_token_id`` instead.
    ``special_token_ids(tokenizer) -> {"eos", "pad", "decoder_start"}``: the conventions the model's
        data was built with, when they are not the tokenizer's eos and pad (a T5 decoder starts at pad).
    Pipeline parallelism: ``pipeline_module()`` (the module to cut: its pieces carry
    ``layer_idx``, see ``libai_lite.parallel.pipeline``), ``pipeline_num_layers``, ``pipeline_tied``
    (``(source, copy)`` parameter paths shared by first and last stage, or None),
    ``pipeline_batch(batch) -> (first-stage args, every-stage kwargs, labels)``,
    ``pipeline_loss_fn(output, labels) -> loss`` and optionally ``pipeline_metrics(output, labels)``
    with ``pipeline_metric_names``.
    Context parallelism (``train.dist.context_parallel_size``): ``forward`` takes ``position_ids`` (each rank's
        global positions), and a back-propagated loss that is a mean over tokens names the output counting
        them, ``Metric(backward=True, tokens="num_tokens")`` (the sum of its 0/1 token weights), so the loss
        is the mean over the whole sequence; a loss without ``tokens`` is averaged over the cp ranks.
    Hugging Face: the project registers its mapping (``libai_lite.checkpoint.hf``) when its
    modeling package is imported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from torch import nn

from .utils.errors import UsageError

REDUCTIONS = ("mean", "sum", "max")


@dataclass(frozen=True)
class Metric:
    """How the trainer treats one entry of a model's output dict: ``backward``, added to the loss that is
    back-propagated; ``reduce``, how a step's value forms from its micro-batches and then the
    data-parallel ranks (``mean``: losses, accuracies; ``sum``: counts; ``max``: a worst case); ``tokens``, for
    a loss that is a mean over tokens, the output counting them (context parallelism re-weights by it)."""

    backward: bool = False
    reduce: str = "mean"
    tokens: str | None = None

    def __post_init__(self):
        if self.reduce not in REDUCTIONS:
            raise ValueError(f"Metric reduce={self.reduce!r}; use one of {REDUCTIONS}")


LOSS = Metric(backward=True)
MEAN = Metric()


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP's or a pipeline stage's wrapper (``.module``); FSDP2 wraps in place."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def output_metrics(model: nn.Module) -> dict[str, Metric]:
    """The model's declared outputs; one clear error when it declares none."""
    name = type(unwrap(model)).__name__
    fn = getattr(unwrap(model), "output_metrics", None)
    if not callable(fn):
        raise UsageError(f"{name} does not declare its outputs: give it output_metrics() returning "
                         f"{{'lm_loss': libai_lite.model.LOSS, ...}} (see libai_lite/model.py)")
    metrics = dict(fn())
    if not any(m.backward for m in metrics.values()):
        raise UsageError(f"{name}.output_metrics() marks no output as a loss (Metric(backward=True)); the trainer "
                         f"has nothing to back-propagate")
    return metrics


def loss_name(metrics: Mapping[str, Metric]) -> str:
    """The first back-propagated output: what a pipeline's loss function computes."""
    return next(name for name, m in metrics.items() if m.backward)


def sample_throughput(model: nn.Module, sample: Mapping) -> tuple[int | None, float | None]:
    """``(tokens, training FLOPs)`` of one sample as the model counts them (None where it does not)."""
    model = unwrap(model)
    tokens = model.tokens_per_sample(sample) if callable(getattr(model, "tokens_per_sample", None)) else None
    flops = model.flops_per_sample(sample) if callable(getattr(model, "flops_per_sample", None)) else None
    return (int(tokens) if tokens is not None else None), (float(flops) if flops is not None else None)


def max_seq_length(model: nn.Module) -> int | None:
    """The model's longest sequence, if it has one."""
    value = getattr(unwrap(model), "max_seq_length", None)
    return int(value) if value else None


def supports_pipeline(model: nn.Module) -> bool:
    """Whether the model tells the pipeline splitter how to cut it."""
    return callable(getattr(unwrap(model), "pipeline_module", None))


def pipeline_num_layers(model: nn.Module) -> int:
    """Layers the pipeline places (one stage id each)."""
    return int(getattr(unwrap(model), "pipeline_num_layers"))


def is_encoder_decoder(model: nn.Module) -> bool:
    """Whether the model reads an encoder input beside the decoder's (its ``forward`` takes ``encoder_input_ids``)."""
    import inspect

    return "encoder_input_ids" in inspect.signature(unwrap(model).forward).parameters


def special_token_ids(model: nn.Module, tokenizer) -> dict:
    """``eos``, ``pad`` and (encoder-decoder) ``decoder_start`` ids the model generates and scores with.

    The model's ``special_token_ids(tokenizer)`` when it has one; otherwise the tokenizer's eos (its
    end-of-document id when it names no eos), pad (else eos) and, for an encoder-decoder, bos (else pad).
    """
    fn = getattr(unwrap(model), "special_token_ids", None)
    if callable(fn):
        ids = dict(fn(tokenizer))
    elif tokenizer is None:
        ids = {"eos": None, "pad": 0}
    else:
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else getattr(tokenizer, "eod_id", None)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        ids = {"eos": eos, "pad": pad}
        if is_encoder_decoder(model):
            bos = getattr(tokenizer, "bos_token_id", None)
            ids["decoder_start"] = bos if bos is not None else pad
    ids["pad"] = ids.get("pad") if ids.get("pad") is not None else 0
    if is_encoder_decoder(model) and ids.get("decoder_start") is None:
        ids["decoder_start"] = ids["pad"]
    return ids
