"""Hugging Face weights in and out of libai_lite models, through the mapping each project registers.

A project's ``hf_mapping`` module describes its conversion as an ``HFMapping`` and calls
``register_hf_model``; the modeling package imports that module, so importing the model class registers
it. Export finds the mapping through the model's class MRO, import through the directory's ``model_type``.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from typing import Callable, Mapping

import torch
from torch import nn

from ..utils.errors import UsageError
from .dcp_io import build_empty
from .hf_io import HFTokenizer, read_hf_config, read_hf_state_dict, write_hf_dir
from .integrity import stored_rows


@dataclasses.dataclass(frozen=True)
class HFMapping:
    """How one project's pretraining module converts to and from Hugging Face directories.

    ``model_class(model_cfg)`` builds the module; ``model_types`` are the ``config.json`` ``model_type``
    values it reads. The converters work on the state dict of the module's ``inner``:
    ``config_from_hf``/``config_to_hf`` map ``config.json`` and ``model.cfg``, and
    ``state_dict_from_hf``/``state_dict_to_hf`` map ``(state dict, model.cfg)`` to the other side's.
    ``vocab_keys`` are our keys whose rows are the vocabulary, token embedding first (padded on import, cut
    on export). ``special_token_ids``, ``find_tokenizer`` and ``sentencepiece_config`` carry the tokenizer
    across (see ``hf_io.tokenizer_files``); ``finetune_config`` is the project config an import's fine-tuning
    config starts from; ``pipeline_num_layers`` maps ``model.cfg`` to ``train.dist.pipeline_num_layers``
    when that is not ``hidden_layers``.
    """

    model_class: type
    model_types: tuple[str, ...]
    inner: str
    config_from_hf: Callable[[Mapping], dict]
    config_to_hf: Callable[[Mapping], dict]
    state_dict_from_hf: Callable[[Mapping, Mapping], dict]
    state_dict_to_hf: Callable[[Mapping, Mapping], dict]
    vocab_keys: tuple[str, ...]
    special_token_ids: Callable[[object], dict] = lambda tokenizer: {}
    find_tokenizer: Callable[[str], HFTokenizer | None] = lambda hf_dir: None
    sentencepiece_config: Callable[[object], dict | None] = lambda tokenizer: None
    finetune_config: str | None = None
    pipeline_num_layers: Callable[[Mapping], int] | None = None


# Keyed by the class's import name, so a module executed again replaces its entry instead of adding one.
_MAPPINGS: dict[str, HFMapping] = {}


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_hf_model(mapping: HFMapping | str, **fields) -> HFMapping:
    """Make ``mapping.model_class`` (and its subclasses) convertible; a project's hf_mapping module calls this.

    ``mapping`` may be the calling module's ``__name__`` instead: its functions named as ``HFMapping``
    fields (``config_from_hf``, ``state_dict_to_hf``, ``find_tokenizer``, ...) join ``fields``.
    """
    if isinstance(mapping, str):
        module = sys.modules[mapping]
        named = {f.name: getattr(module, f.name) for f in dataclasses.fields(HFMapping)
                 if callable(getattr(module, f.name, None))}
        mapping = HFMapping(**{**named, **fields})
    if not getattr(mapping.config_from_hf, "_checked", False):
        mapping = dataclasses.replace(mapping, config_from_hf=_checked_config_reader(mapping.config_from_hf))
    _MAPPINGS[_class_name(mapping.model_class)] = mapping
    return mapping


def _checked_config_reader(read: Callable[[Mapping], dict]) -> Callable[[Mapping], dict]:
    """``read`` (a mapping's ``config_from_hf``) whose TypeError or ValueError on a ``config.json`` value of the
    wrong type (a string where a size goes) is one UsageError naming the entry."""

    @functools.wraps(read)
    def config_from_hf(hf_config: Mapping) -> dict:
        try:
            return read(hf_config)
        except UsageError:
            raise
        except (TypeError, ValueError) as e:
            raise UsageError(_bad_config_value(hf_config, e)) from e

    config_from_hf._checked = True
    return config_from_hf


def _bad_config_value(hf_config: Mapping, exc: Exception) -> str:
    """The refusal of a ``config.json`` whose reading failed with ``exc``, naming the entry it failed on when the
    error shows it (its value quoted, or its type named, by one entry only)."""
    text = str(exc)
    named = [k for k, v in hf_config.items() if isinstance(v, str) and repr(v) in text]
    if not named:
        named = [k for k, v in hf_config.items() if f"'{type(v).__name__}'" in text]
    what = (f"{named[0]}={hf_config[named[0]]!r} is not the number it should be" if len(named) == 1
            else "a value is not of the type the model reads")
    return (f"config.json: {what} ({type(exc).__name__}: {text}); correct it (transformers writes sizes as "
            f"integers and rates as numbers) or download the model again")


def hf_model_types() -> list[str]:
    """The Hugging Face ``model_type`` values that the registered mappings read."""
    return sorted({t for m in _MAPPINGS.values() for t in m.model_types})


def mapping_for_type(model_type: str) -> HFMapping:
    """The first registered mapping that reads ``model_type``; UsageError listing the registered types otherwise."""
    for mapping in _MAPPINGS.values():
        if model_type in mapping.model_types:
            return mapping
    raise UsageError(f"model type {model_type!r} has no registered Hugging Face mapping; use one of "
                     f"{', '.join(hf_model_types())} (a project registers its own with register_hf_model in its "
                     f"hf_mapping module)")


def mapping_for_model(model) -> HFMapping:
    """The mapping registered for ``model``'s class (an instance or a class) or the nearest base class."""
    cls = model if isinstance(model, type) else type(model)
    for base in cls.__mro__:
        if _class_name(base) in _MAPPINGS:
            return _MAPPINGS[_class_name(base)]
    known = ", ".join(sorted(m.model_class.__name__ for m in _MAPPINGS.values())) or "none"
    raise UsageError(f"{cls.__name__} has no Hugging Face mapping (registered: {known}); its project's hf_mapping "
                     f"module must call register_hf_model and be imported by its modeling package")


def detect_model_type(hf_config: Mapping, requested: str | None = None, where: str = "the model directory",
                      mapping: HFMapping | None = None) -> tuple[str, HFMapping]:
    """``(model_type, mapping)`` for a ``config.json``: ``requested`` if given and read by the same mapping.

    With ``mapping`` (a user's model class chose it) the directory must be one of its types.
    """
    found = hf_config.get("model_type")
    reader = mapping or next((m for m in _MAPPINGS.values() if found in m.model_types), None)
    if reader is None or found not in reader.model_types:
        who, types = ((mapping.model_class.__name__, mapping.model_types) if mapping
                      else ("libai_lite", hf_model_types()))
        raise UsageError(f"{where} holds a model_type={found!r} model (config.json); {who} converts {', '.join(types)}")
    if requested is not None and requested not in reader.model_types:
        if mapping is None:
            mapping_for_type(requested)  # an unknown type is named as such
        raise UsageError(f"{where} holds a {found!r} model (config.json model_type) but --model {requested} was "
                         f"given; use --model {found}")
    return requested or found, reader


class StateDictSource:
    """Hands out a state dict's tensors by name for a mapping, naming the first missing key in a UsageError.

    ``check_all_used`` then refuses keys nobody asked for, so a mapping never drops weights silently.
    """

    def __init__(self, sd: Mapping[str, torch.Tensor], what: str):
        self.sd, self.what, self.used = sd, what, set()

    def __call__(self, key: str) -> torch.Tensor:
        if key not in self.sd:
            raise UsageError(f"{self.what} has no '{key}': the weights do not match the config "
                             f"(another model or a truncated file)")
        self.used.add(key)
        return self.sd[key]

    def check_all_used(self, ignore=lambda key: False) -> None:
        extra = [k for k in self.sd if k not in self.used and not ignore(k)]
        if extra:
            raise UsageError(f"{self.what} has the unexpected key '{extra[0]}' ({len(extra)} in all): "
                             f"the weights belong to another architecture than the config describes")


def _load_converted(inner: nn.Module, sd: Mapping[str, torch.Tensor]) -> None:
    """Copy a mapping's state dict into the inner model, refusing any key or shape mismatch."""
    own = inner.state_dict()
    missing, unexpected = [k for k in own if k not in sd], [k for k in sd if k not in own]
    if missing:
        raise UsageError(f"the converted weights lack '{missing[0]}'; the mapping and the model disagree")
    if unexpected:
        raise UsageError(f"the converted weights hold '{unexpected[0]}', which the model does not have")
    key = next((k for k, t in own.items() if sd[k].shape != t.shape), None)
    if key is not None:
        raise UsageError(f"weight '{key}' has shape {list(sd[key].shape)} but config.json builds "
                         f"{list(own[key].shape)}: the config does not describe these weights")
    with torch.no_grad():
        inner.load_state_dict(dict(sd), strict=True)


def resize_vocab_rows(sd: Mapping[str, torch.Tensor], keys, vocab_size: int) -> dict:
    """Cut or grow the vocabulary rows of ``keys`` to ``vocab_size``; a tied pair stays one tensor.

    New rows are the mean of the existing ones, as in transformers' ``resize_token_embeddings``, so a padded
    id's logit is the mean logit and the model's predictions barely move.
    """
    out = dict(sd)
    done: dict[int, torch.Tensor] = {}
    for key in keys:
        if key not in out:
            continue
        t = out[key]
        if id(t) not in done:
            rows = t.shape[0]
            if vocab_size <= rows:
                done[id(t)] = t[:vocab_size]
            else:
                mean = t.float().mean(0, keepdim=True).to(t.dtype)
                done[id(t)] = torch.cat([t, mean.expand(vocab_size - rows, *t.shape[1:])])
        out[key] = done[id(t)]
    return out


def load_hf_model(hf_dir: str, model_type: str | None = None, vocab_size: int | None = None,
                  model_class: type | None = None) -> tuple[str, dict, nn.Module]:
    """``(model_type, model.cfg dict, module)`` for a Hugging Face directory: the module in eval mode on the CPU.

    ``model_type`` (default ``config.json``'s) must be read by the directory's mapping; ``model_class``
    (a user's class) is built through its own mapping. ``vocab_size`` pads the vocabulary as the trainer does.
    """
    hf_config = read_hf_config(hf_dir)
    chosen = mapping_for_model(model_class) if model_class is not None else None
    model_type, mapping = detect_model_type(hf_config, model_type, hf_dir, chosen)
    cfg = mapping.config_from_hf(hf_config)
    try:
        sd = mapping.state_dict_from_hf(read_hf_state_dict(hf_dir), cfg)
    except RuntimeError as e:  # a mapping's reshape of weights of another size than config.json gives
        raise UsageError(f"the weights in {hf_dir} do not fit its config.json: converting them failed "
                         f"({' '.join(str(e).split())}); they are of another model size than config.json describes; "
                         f"use the config.json saved with these weights") from e
    if vocab_size is not None and vocab_size != cfg["vocab_size"]:
        if vocab_size < cfg["vocab_size"]:
            raise UsageError(f"vocabulary size {vocab_size} is smaller than the model's {cfg['vocab_size']}")
        sd = resize_vocab_rows(sd, mapping.vocab_keys, vocab_size)
        cfg["vocab_size"] = int(vocab_size)
    module = build_empty(lambda: (model_class or mapping.model_class)(dict(cfg)))
    _load_converted(getattr(module, mapping.inner), sd)
    return model_type, cfg, module.eval()


def checkpoint_vocab_size(checkpoint_dir: str, model_class: type) -> int:
    """Rows of the token embedding in a DCP checkpoint of ``model_class``: the vocabulary the run padded to."""
    mapping = mapping_for_model(model_class)
    return stored_rows(checkpoint_dir, [f"{mapping.inner}.{mapping.vocab_keys[0]}"],
                       f"it was not saved from a {mapping.model_class.__name__}; check --config-file")


def save_hf_model(module: nn.Module, model_cfg: Mapping, output_dir: str, vocab_size: int | None = None,
                  tokenizer=None) -> tuple[dict, list[str]]:
    """Write ``module`` (whole, on one process) as a Hugging Face directory; returns its config and notes to print.

    Weights are float32; the vocabulary rows are cut to ``vocab_size`` (the tokenizer's real size) when
    given. A ``tokenizer`` of ours gets its files copied and its special token ids into the configs.
    """
    mapping = mapping_for_model(module)
    # One tensor per Parameter, so a tied pair stays one tensor under two names.
    by_param: dict[int, torch.Tensor] = {}
    sd = {}
    for key, t in getattr(module, mapping.inner).state_dict(keep_vars=True).items():
        if id(t) not in by_param:
            by_param[id(t)] = t.detach().to("cpu", torch.float32)
        sd[key] = by_param[id(t)]
    cfg = dict(model_cfg)
    rows = int(sd[mapping.vocab_keys[0]].shape[0])
    cfg["vocab_size"] = rows
    if vocab_size is not None:
        if vocab_size > rows:
            raise UsageError(f"the tokenizer has {vocab_size} ids but the checkpoint's embedding has {rows} rows: "
                             f"the config names another tokenizer than the run used; set tokenization.tokenizer")
        sd = resize_vocab_rows(sd, mapping.vocab_keys, vocab_size)
        cfg["vocab_size"] = int(vocab_size)
    hf_config = mapping.config_to_hf(cfg)
    if tokenizer is not None:
        hf_config.update({k: v for k, v in mapping.special_token_ids(tokenizer).items() if v is not None})
    notes = write_hf_dir(output_dir, hf_config, mapping.state_dict_to_hf(sd, cfg), tokenizer,
                         mapping.sentencepiece_config(tokenizer) if tokenizer is not None else None)
    return hf_config, notes


def export_probe(module: nn.Module, hf_config: Mapping) -> tuple[dict, torch.Tensor]:
    """A small fixed batch and ``module``'s logits on it, cut to the exported vocabulary: what ``check_hf_export``
    compares the written directory with. ``module`` is a pretraining module (``forward`` gives ``{"logits"}``)."""
    import inspect

    vocab = int(hf_config["vocab_size"])
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, vocab, (2, 8), generator=g)}
    if "decoder_input_ids" in inspect.signature(module.forward).parameters:
        batch["decoder_input_ids"] = torch.randint(0, vocab, (2, 6), generator=g)
    was_training = module.training
    module.eval()
    with torch.no_grad():
        if "decoder_input_ids" in batch:
            logits = module(batch["input_ids"], batch["decoder_input_ids"])["logits"]
        else:
            logits = module(batch["input_ids"])["logits"]
    module.train(was_training)
    return batch, logits[..., :vocab].float()


def check_hf_export(hf_dir: str, hf_config: Mapping, probe: tuple[dict, torch.Tensor], model_class: type) -> str:
    """Refuse an export that transformers runs as another model than ``model_class``: its logits on the probe batch
    (``export_probe``) must be those of the written directory loaded with transformers. A mapping registered for a
    copied project still writes the original's ``model_type``, whatever the copy's code computes. Returns the note
    that says what was checked (or why it was not)."""
    arch = (hf_config.get("architectures") or ["?"])[0]
    try:
        import transformers
    except ImportError:
        return (f"the export was not checked against transformers (not installed): pip install transformers to "
                f"check that {arch} computes what {model_class.__name__} computes")
    batch, ours = probe
    try:
        config = transformers.AutoConfig.from_pretrained(hf_dir)
        auto = (transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder
                else transformers.AutoModelForCausalLM)
        hf = auto.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    except Exception as e:  # noqa: BLE001 - an architecture this transformers version lacks is said, not fatal
        return (f"the export was not checked against transformers {transformers.__version__}: it could not load "
                f"{arch} ({type(e).__name__}: {' '.join(str(e).split())[:200]})")
    with torch.no_grad():
        theirs = hf(**batch).logits.float()
    del hf
    scale = float(theirs.abs().max())
    diff = float((ours - theirs).abs().max()) if ours.shape == theirs.shape else float("inf")
    if not diff <= 1e-3 * (1.0 + scale):
        mapping = mapping_for_model(model_class)
        raise UsageError(
            f"{model_class.__name__} does not compute what the exported {arch} (model_type "
            f"{hf_config.get('model_type')!r}, written by the mapping of {mapping.state_dict_to_hf.__module__}) "
            f"computes: their logits on a probe batch differ by up to {diff:.3g} (largest logit {scale:.3g}), so "
            f"transformers would generate other tokens; give {model_class.__name__}'s project a Hugging Face mapping "
            f"of its own (register_hf_model with a model_type and converters that run its code), or export with the "
            f"original project; nothing was written")
    return (f"checked: transformers' {arch} gives {model_class.__name__}'s logits on a probe batch "
            f"(largest difference {diff:.2g})")
