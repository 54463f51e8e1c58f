"""The model protocol: everything the engine, the parallel code and the checkpointer learn from a model.

A model is an ``nn.Module`` a config builds; the core never names it or reads a config key only it has.
It must give ``forward(**batch) -> dict`` and ``output_metrics() -> {name: Metric}``. The rest is
optional and read only through the functions below; a model without a member loses only the feature
that needs it. ``libai_lite.lm.decoder`` and ``libai_lite.lm.seq2seq`` answer all of it for LMs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from torch import nn

from .utils.errors import UsageError

REDUCTIONS = ("mean", "sum", "max")


@dataclass(frozen=True)
class Metric:
    """How the trainer treats one entry of a model's output dict. ``backward`` entries are added to the
    back-propagated loss. ``reduce`` combines micro-batches and then data-parallel ranks. ``tokens`` names
    the output counting a token-mean loss's tokens, which context parallelism re-weights by."""

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
    """``(tokens, training FLOPs)`` of one unbatched training sample as the model counts them, through its
    ``tokens_per_sample(sample)`` and ``flops_per_sample(sample)`` (None where it has none). FLOPs are best
    counted at construction: a pipeline removes pieces."""
    model = unwrap(model)
    tokens = model.tokens_per_sample(sample) if callable(getattr(model, "tokens_per_sample", None)) else None
    flops = model.flops_per_sample(sample) if callable(getattr(model, "flops_per_sample", None)) else None
    return (int(tokens) if tokens is not None else None), (float(flops) if flops is not None else None)


def embedding_parameters(model: nn.Module) -> list | None:
    """The input word embedding's and output layer's weights on this model part (Megatron's embedding and
    output parameters, trained at ``optim.params.decoupled_lr``), from its ``embedding_parameters()``; None
    when it has none. Read after parallelizing, so they are the tensors the optimizer is given."""
    fn = getattr(unwrap(model), "embedding_parameters", None)
    return list(fn()) if callable(fn) else None


def max_seq_length(model: nn.Module) -> int | None:
    """The model's longest sequence (its ``max_seq_length``: evaluators, generation), if it has one."""
    value = getattr(unwrap(model), "max_seq_length", None)
    return int(value) if value else None


def supports_pipeline(model: nn.Module) -> bool:
    """Whether the model tells the pipeline splitter how to cut it (``pipeline_module``)."""
    return callable(getattr(unwrap(model), "pipeline_module", None))


def pipeline_module(model: nn.Module) -> nn.Module:
    """The module a pipeline cuts: ``model.pipeline_module()``, whose pieces carry ``layer_idx``
    (``libai_lite.parallel.pipeline_split``), else ``model`` itself."""
    fn = getattr(model, "pipeline_module", None)
    return fn() if callable(fn) else model


def pipeline_num_layers(model: nn.Module) -> int:
    """Layers the pipeline places (one stage id each): the model's ``pipeline_num_layers``."""
    return int(getattr(unwrap(model), "pipeline_num_layers"))


def stage_of_layer(model: nn.Module, dims) -> tuple[int, ...]:
    """Each pipeline layer's stage under the layout ``dims`` (``ParallelDims.stage_of_layer``); empty without a
    pipeline or for a model that cannot be pipelined (the layout check refuses that one, naming it)."""
    if dims.pipeline_parallel_size == 1 or not supports_pipeline(model):
        return ()
    return dims.stage_of_layer(pipeline_num_layers(model))


def pipeline_tied(module: nn.Module) -> tuple[str, str] | None:
    """``(source, copy)`` paths of the weight a pipeline module's first and last stage share (its
    ``pipeline_tied``), or None."""
    tied = getattr(unwrap(module), "pipeline_tied", None)
    return tuple(tied) if tied else None


def pipeline_hooks(model: nn.Module) -> tuple:
    """``(loss_fn, batch_fn, metrics_fn, metric_names)`` a pipeline schedule runs the model with.

    ``pipeline_loss_fn(output, labels) -> loss`` of the last stage's output (required);
    ``pipeline_batch(batch) -> (first-stage args, every-stage kwargs, labels)``; ``pipeline_metrics(output,
    labels) -> {name: scalar}`` with ``pipeline_metric_names`` (known on every rank), or None and ``()``.
    """
    return (model.pipeline_loss_fn, getattr(model, "pipeline_batch", None), getattr(model, "pipeline_metrics", None),
            getattr(model, "pipeline_metric_names", ()))


def tie_weights(module: nn.Module) -> None:
    """Re-point a module's shared weights through its ``tie_weights()``, when it declares one: whatever
    swaps parameters module by module (``to_empty()``, ``parallelize_module``) unties them."""
    if callable(tie := getattr(module, "tie_weights", None)):
        tie()


def is_encoder_decoder(model: nn.Module) -> bool:
    """Whether the model reads an encoder input beside the decoder's (its ``forward`` takes ``encoder_input_ids``);
    its ``generate(encoder_input_ids, encoder_attn_mask, decoder_start_token_id=, **options)`` then decodes."""
    import inspect

    return "encoder_input_ids" in inspect.signature(unwrap(model).forward).parameters


def special_token_ids(model: nn.Module, tokenizer) -> dict:
    """``eos``, ``pad`` and (encoder-decoder) ``decoder_start`` ids the model generates and scores with.

    The model's ``special_token_ids(tokenizer)`` when its data was built with other conventions (a T5
    decoder starts at pad); otherwise the tokenizer's eos (its end-of-document id when it names no eos),
    pad (else eos) and, for an encoder-decoder, bos (else pad).
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
