"""Hugging Face model directories in and out of libai_lite models, without running pickled code.

Reading takes ``config.json`` plus ``model.safetensors``, a sharded ``model.safetensors.index.json``,
or ``pytorch_model.bin`` (or its index) loaded with ``torch.load(weights_only=True)``. Writing
gives ``config.json``, ``generation_config.json`` and ``model.safetensors`` that transformers'
``from_pretrained`` loads, plus the tokenizer files of the config's tokenizer.

Each project keeps its own key and layout mapping (``projects/GPT/modeling/hf_mapping.py``,
``projects/MT5/hf_mapping.py``: ``config_from_hf``, ``config_to_hf``, ``state_dict_from_hf``,
``state_dict_to_hf``, ``special_token_ids``, ``EMBEDDING_KEY``, ``VOCAB_KEYS``); this module finds it
through a registry of import paths (``register_hf_model``), so importing the core imports no project.
``tools/hf_convert.py`` is the command line on top of it.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import torch
from torch import nn

from ..utils.errors import UsageError

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_NAME = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"


# ----------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class HFModelSpec:
    """Where a Hugging Face ``model_type`` lives in libai_lite.

    Attributes:
        mapping: import path of the project's mapping module.
        model_class: ``"module:Class"`` of the pretraining module (built with ``Class(cfg)``).
        inner: attribute of the pretraining module whose state dict the mapping speaks.
        family: model types of one family accept each other's directories (T5 and mT5).
        finetune_config: import path of the project config a generated fine-tuning config starts from.
    """

    mapping: str
    model_class: str
    inner: str
    family: str
    finetune_config: str

    def mapping_module(self):
        return _import(self.mapping)

    def model_cls(self) -> type:
        module, _, name = self.model_class.partition(":")
        return getattr(_import(module), name)


_GPT = HFModelSpec("projects.GPT.modeling.hf_mapping", "projects.GPT.modeling.gpt_model:GPTForPreTraining",
                   "GPT_model", "gpt2", "projects.GPT.configs.gpt2_pretrain")
_T5 = HFModelSpec("projects.MT5.hf_mapping", "projects.MT5.mt5_model:MT5ForPreTraining",
                  "mt5_model", "t5", "projects.MT5.configs.mt5_pretrain")
_REGISTRY: dict[str, HFModelSpec] = {"gpt2": _GPT, "t5": _T5, "mt5": _T5}


def register_hf_model(model_type: str, spec: HFModelSpec) -> None:
    """Make Hugging Face ``model_type`` directories convertible with ``spec`` (a new project's mapping)."""
    _REGISTRY[model_type] = spec


def hf_model_types() -> list[str]:
    """The Hugging Face ``model_type`` values that can be converted."""
    return sorted(_REGISTRY)


def hf_spec(model_type: str) -> HFModelSpec:
    """The registry entry of ``model_type``; UsageError naming the supported ones otherwise."""
    if model_type not in _REGISTRY:
        raise UsageError(f"model type {model_type!r} cannot be converted; use one of {', '.join(hf_model_types())}")
    return _REGISTRY[model_type]


def spec_for_model(model) -> tuple[str, HFModelSpec]:
    """``(model_type, spec)`` for one of our pretraining modules, or its class."""
    cls = model if isinstance(model, type) else type(model)
    for model_type, spec in _REGISTRY.items():
        if issubclass(cls, spec.model_cls()):
            return model_type, spec
    known = sorted({s.model_class.rpartition(":")[2] for s in _REGISTRY.values()})
    raise UsageError(f"{cls.__name__} has no Hugging Face mapping; export supports {', '.join(known)}")


def _import(path: str):
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as e:
        # projects/ is not installed with the package; a checkout has it beside libai_lite/.
        root = Path(__file__).resolve().parents[2]
        if not (e.name or "").startswith("projects") or not (root / "projects").is_dir() or str(root) in sys.path:
            raise
        sys.path.append(str(root))
        return importlib.import_module(path)


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


# ------------------------------------------------------------------------------------- reading


def _check_dir(hf_dir: str) -> None:
    if not os.path.isdir(hf_dir):
        raise UsageError(f"Hugging Face directory {hf_dir} does not exist; pass the directory that holds "
                         f"config.json and the weights (e.g. a save_pretrained or Hub snapshot directory)")


def read_hf_config(hf_dir: str) -> dict:
    """``config.json`` of a Hugging Face model directory as a dict."""
    _check_dir(hf_dir)
    path = os.path.join(hf_dir, CONFIG_NAME)
    if not os.path.isfile(path):
        raise UsageError(f"{hf_dir} has no {CONFIG_NAME}; pass a Hugging Face model directory "
                         f"(save_pretrained writes config.json beside the weights)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} cannot be read as JSON ({type(e).__name__}: {e}); re-download or re-save it") from e
    if not isinstance(config, dict):
        raise UsageError(f"{path} is not a JSON object; re-download or re-save it")
    return config


def _read_index(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"{path} is not a weight index (no weight_map: {type(e).__name__}); re-download it") from e


def _load_safetensors(path: str) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError) as e:
        raise UsageError(f"{path} cannot be read as safetensors ({e}); re-download it") from e


def _load_torch(path: str) -> dict:
    import pickle

    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UsageError(f"{path} holds objects other than tensors and is not unpickled (weights_only); "
                         f"convert it to safetensors with the code that made it") from e
    except (OSError, RuntimeError, EOFError) as e:
        raise UsageError(f"{path} cannot be read as a PyTorch state dict ({type(e).__name__}); re-download it") from e
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise UsageError(f"{path} is not a state dict of tensors; pass a Hugging Face pytorch_model.bin")
    return dict(sd)


def read_hf_state_dict(hf_dir: str) -> dict:
    """All weights of a Hugging Face model directory, on the CPU (safetensors first, then ``weights_only`` torch)."""
    _check_dir(hf_dir)
    for single, index, load in ((SAFETENSORS_NAME, SAFETENSORS_INDEX, _load_safetensors),
                                (TORCH_NAME, TORCH_INDEX, _load_torch)):
        if os.path.isfile(os.path.join(hf_dir, single)):
            return load(os.path.join(hf_dir, single))
        index_path = os.path.join(hf_dir, index)
        if os.path.isfile(index_path):
            sd: dict = {}
            for shard in _read_index(index_path):
                shard_path = os.path.join(hf_dir, shard)
                if not os.path.isfile(shard_path):
                    raise UsageError(f"{index_path} names the shard {shard}, which is missing; download every shard")
                sd.update(load(shard_path))
            return sd
    raise UsageError(f"{hf_dir} has no weights ({SAFETENSORS_NAME}, {SAFETENSORS_INDEX}, {TORCH_NAME} or "
                     f"{TORCH_INDEX}); download the weights, not only the config")


def detect_model_type(hf_config: Mapping, requested: str | None = None, where: str = "the model directory") -> str:
    """The registry key for a ``config.json``: ``requested`` if given (and of its family), else its ``model_type``."""
    found = hf_config.get("model_type")
    if found not in _REGISTRY:
        raise UsageError(f"{where} holds a model_type={found!r} model (config.json); libai_lite converts "
                         f"{', '.join(hf_model_types())}")
    if requested is None:
        return found
    if hf_spec(requested).family != _REGISTRY[found].family:
        raise UsageError(f"{where} holds a {found!r} model (config.json model_type) but --model {requested} was "
                         f"given; use --model {found}")
    return requested


# ------------------------------------------------------------------------------ our models


def build_model(model_type: str, model_cfg: Mapping) -> nn.Module:
    """Our pretraining module for ``model_cfg``, allocated on the CPU but not initialised (weights come next).

    Built on the meta device, so a billion-parameter model costs no random initialisation.
    """
    spec = hf_spec(model_type)
    with torch.device("meta"):
        module = spec.model_cls()(dict(model_cfg))
    module.to_empty(device="cpu")
    # to_empty swaps parameters one module at a time, which unties a shared LM head.
    tie = getattr(getattr(module, spec.inner), "tie_weights", None)
    if callable(tie):
        tie()
    return module


def load_converted_state_dict(module: nn.Module, model_type: str, sd: Mapping[str, torch.Tensor]) -> None:
    """Copy a mapping's state dict into ``module``'s inner model, refusing any key or shape mismatch."""
    inner = getattr(module, hf_spec(model_type).inner)
    own = inner.state_dict()
    missing = [k for k in own if k not in sd]
    if missing:
        raise UsageError(f"the converted weights lack '{missing[0]}'; the mapping and the model disagree")
    unexpected = [k for k in sd if k not in own]
    if unexpected:
        raise UsageError(f"the converted weights hold '{unexpected[0]}', which the model does not have")
    for key, tensor in own.items():
        if tuple(sd[key].shape) != tuple(tensor.shape):
            raise UsageError(f"weight '{key}' has shape {list(sd[key].shape)} but config.json builds "
                             f"{list(tensor.shape)}: the config does not describe these weights")
    with torch.no_grad():
        inner.load_state_dict(dict(sd), strict=True)


def resize_vocab_rows(sd: Mapping[str, torch.Tensor], keys, vocab_size: int) -> dict:
    """Cut or grow the vocabulary rows of ``keys`` to ``vocab_size``.

    New rows are the mean of the existing ones, as transformers' ``resize_token_embeddings`` does:
    a padded id's logit is then the mean logit, so all padded ids together take at most
    (added / original) of the probability mass and the model's predictions barely move.
    A tied pair (one tensor under two keys) stays one tensor.
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


def convert_hf_dir(hf_dir: str, model_type: str | None = None, vocab_size: int | None = None):
    """``(model_type, model.cfg, module)`` from a Hugging Face directory; ``vocab_size`` pads the vocabulary rows.

    See ``load_hf_model``; with ``vocab_size`` (at least the directory's) the embedding and head get
    extra rows (``resize_vocab_rows``) so the model matches what the trainer builds for a padded vocabulary.
    """
    hf_config = read_hf_config(hf_dir)
    model_type = detect_model_type(hf_config, model_type, hf_dir)
    mapping = hf_spec(model_type).mapping_module()
    cfg = mapping.config_from_hf(hf_config)
    sd = mapping.state_dict_from_hf(read_hf_state_dict(hf_dir), cfg)
    if vocab_size is not None and vocab_size != cfg["vocab_size"]:
        if vocab_size < cfg["vocab_size"]:
            raise UsageError(f"vocabulary size {vocab_size} is smaller than the model's {cfg['vocab_size']}")
        sd = resize_vocab_rows(sd, mapping.VOCAB_KEYS, vocab_size)
        cfg["vocab_size"] = int(vocab_size)
    module = build_model(model_type, cfg)
    load_converted_state_dict(module, model_type, sd)
    return model_type, cfg, module.eval()


def load_hf_model(hf_dir: str, model_type: str | None = None) -> tuple[str, dict, torch.nn.Module]:
    """Load a Hugging Face GPT-2 / T5 / mT5 directory as our pretraining module.

    Returns ``(model_type, model_cfg, module)``: the registry key (``model_type`` if given, else
    ``config.json``'s: "gpt2", "t5" or "mt5"), our ``model.cfg`` dict (for T5-family models its
    ``model_type`` is the architecture: "t5" for ReLU, "mt5" for gated-GELU, whatever the HF name)
    and ``GPTForPreTraining`` / ``MT5ForPreTraining`` with the weights, in eval mode, on the CPU,
    with exactly the directory's vocabulary.
    """
    return convert_hf_dir(hf_dir, model_type)


def checkpoint_vocab_size(checkpoint_dir: str, model_type: str) -> int:
    """Rows of the token embedding stored in a DCP checkpoint (the padded vocabulary it was trained with)."""
    import torch.distributed.checkpoint as dcp

    spec = hf_spec(model_type)
    try:
        meta = dcp.FileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - any unreadable metadata means a corrupt checkpoint
        raise UsageError(f"checkpoint {checkpoint_dir} cannot be read ({type(e).__name__}: {e}); "
                         f"point --checkpoint to a complete checkpoint directory") from e
    key = f"model.{spec.inner}.{spec.mapping_module().EMBEDDING_KEY}"
    if key not in meta:
        raise UsageError(f"checkpoint {checkpoint_dir} has no '{key[len('model.'):]}': it was not saved from a "
                         f"{spec.model_class.rpartition(':')[2]}; check --config-file")
    return int(meta[key].size[0])


# ---------------------------------------------------------------------------------- tokenizers


@dataclass
class HFTokenizer:
    """A tokenizer found in a Hugging Face directory, as one of ours.

    ``files`` maps file names to paths in the directory; ``lazy_call`` is the source of the
    ``LazyCall`` that builds it from those names beside a config file (``_here`` is that folder).
    """

    tokenizer: object
    files: dict
    lazy_call: str
    import_line: str


def find_hf_tokenizer(hf_dir: str, model_type: str) -> HFTokenizer | None:
    """Our tokenizer for ``hf_dir``'s files (GPT-2 ``vocab.json`` + ``merges.txt``, T5 ``spiece.model``), or None."""
    from ..tokenizer import GPT2Tokenizer, SentencePieceTokenizer

    family = hf_spec(model_type).family
    path = lambda name: os.path.join(hf_dir, name)  # noqa: E731
    if family == "gpt2" and os.path.isfile(path("vocab.json")) and os.path.isfile(path("merges.txt")):
        try:
            tok = GPT2Tokenizer(path("vocab.json"), path("merges.txt"))
        except ValueError as e:
            raise UsageError(f"the GPT-2 tokenizer files in {hf_dir} cannot be loaded: {e}") from e
        return HFTokenizer(
            tok, {"vocab.json": path("vocab.json"), "merges.txt": path("merges.txt")},
            'LazyCall(GPT2Tokenizer)(vocab_file=os.path.join(_here, "vocab.json"), '
            'merges_file=os.path.join(_here, "merges.txt"))',
            "from libai_lite.tokenizer import GPT2Tokenizer",
        )
    if family == "t5" and os.path.isfile(path("spiece.model")):
        extra_ids = 100  # transformers' T5Tokenizer default
        tok_cfg = path("tokenizer_config.json")
        if os.path.isfile(tok_cfg):
            try:
                with open(tok_cfg, encoding="utf-8") as f:
                    extra_ids = int(json.load(f).get("extra_ids", extra_ids))
            except (OSError, ValueError, TypeError, AttributeError) as e:
                raise UsageError(f"{tok_cfg} cannot be read ({type(e).__name__}); re-download it") from e
        try:
            tok = SentencePieceTokenizer(path("spiece.model"), extra_ids=extra_ids, style="t5")
        except ValueError as e:
            raise UsageError(f"the SentencePiece model in {hf_dir} cannot be loaded: {e}") from e
        return HFTokenizer(
            tok, {"spiece.model": path("spiece.model")},
            f'LazyCall(SentencePieceTokenizer)(model_file=os.path.join(_here, "spiece.model"), '
            f'extra_ids={extra_ids}, style="t5")',
            "from libai_lite.tokenizer import SentencePieceTokenizer",
        )
    return None


def _tokenizer_files(tokenizer) -> tuple[dict, dict | None, list[str]]:
    """``({name: source path}, tokenizer_config or None, notes)`` to make an exported directory usable."""
    from ..tokenizer import BertTokenizer, GPT2Tokenizer, SentencePieceTokenizer

    if isinstance(tokenizer, GPT2Tokenizer):
        return {"vocab.json": tokenizer.vocab_file, "merges.txt": tokenizer.merges_file}, None, []
    if isinstance(tokenizer, SentencePieceTokenizer):
        extra = len(getattr(tokenizer, "additional_special_tokens_ids", []) or [])
        if getattr(tokenizer, "style", None) == "t5":
            return {"spiece.model": tokenizer.model_file}, {"tokenizer_class": "T5Tokenizer", "extra_ids": extra}, []
        return {"spiece.model": tokenizer.model_file}, None, [
            "the SentencePiece tokenizer uses Megatron's id convention (special tokens appended after the "
            "pieces), which transformers' T5Tokenizer does not reproduce; tokenize with libai_lite"]
    if isinstance(tokenizer, BertTokenizer):
        return {"vocab.txt": tokenizer.vocab_file}, None, [
            "vocab.txt is copied, but the [BOS]/[EOS]/<extra_id_*> tokens libai_lite appends to a BERT "
            "vocabulary are not described for transformers; tokenize with libai_lite"]
    return {}, None, [f"{type(tokenizer).__name__} has no known files; copy the tokenizer files yourself"]


# ------------------------------------------------------------------------------------- writing


def _save_safetensors(tensors: Mapping[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    seen: set[int] = set()
    out = {}
    for key, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share memory (views of one fused matrix, tied copies).
        ptr = t.untyped_storage().data_ptr()
        out[key] = t.clone() if ptr in seen else t
        seen.add(ptr)
    save_file(out, path, metadata={"format": "pt"})


def _write_json(obj, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def save_hf_model(module: nn.Module, model_cfg: Mapping, output_dir: str, vocab_size: int | None = None,
                  tokenizer=None) -> tuple[dict, list[str]]:
    """Write ``module`` (one of our pretraining modules, whole, on one process) as a Hugging Face directory.

    ``output_dir`` gets ``config.json``, ``generation_config.json`` and ``model.safetensors``
    (float32, as trained); the vocabulary is the module's rows, cut to ``vocab_size`` when given
    (the tokenizer's real size: padded rows are never produced by it). With ``tokenizer`` (one of
    ours) its files are copied and the special token ids go into the configs. Returns the HF config
    and notes worth printing.
    """
    model_type, spec = spec_for_model(module)
    mapping = spec.mapping_module()
    inner = getattr(module, spec.inner)
    # One tensor per Parameter, so a tied pair stays one tensor under two names.
    by_param: dict[int, torch.Tensor] = {}
    sd = {}
    for key, t in inner.state_dict(keep_vars=True).items():
        if id(t) not in by_param:
            by_param[id(t)] = t.detach().to("cpu", torch.float32)
        sd[key] = by_param[id(t)]
    cfg = dict(model_cfg)
    rows = int(sd[mapping.EMBEDDING_KEY].shape[0])
    cfg["vocab_size"] = rows
    if vocab_size is not None:
        if vocab_size > rows:
            raise UsageError(f"the tokenizer has {vocab_size} ids but the checkpoint's embedding has {rows} rows: "
                             f"the config names another tokenizer than the run used; set tokenization.tokenizer")
        sd = resize_vocab_rows(sd, mapping.VOCAB_KEYS, vocab_size)
        cfg["vocab_size"] = int(vocab_size)
    hf_config = mapping.config_to_hf(cfg)
    hf_sd = mapping.state_dict_to_hf(sd, cfg)
    notes: list[str] = []
    files: dict = {}
    tok_config = None
    if tokenizer is not None:
        hf_config.update({k: v for k, v in mapping.special_token_ids(tokenizer).items() if v is not None})
        files, tok_config, notes = _tokenizer_files(tokenizer)

    os.makedirs(output_dir, exist_ok=True)
    _save_safetensors(hf_sd, os.path.join(output_dir, SAFETENSORS_NAME))
    _write_json(hf_config, os.path.join(output_dir, CONFIG_NAME))
    generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
                  if hf_config.get(k) is not None}
    _write_json(generation, os.path.join(output_dir, "generation_config.json"))
    for name, src in files.items():
        shutil.copyfile(src, os.path.join(output_dir, name))
    if tok_config is not None:
        _write_json(tok_config, os.path.join(output_dir, "tokenizer_config.json"))
    return hf_config, notes


# ------------------------------------------------------------------------------ output folders


def check_output_dir(output: str, force: bool = False) -> None:
    """Refuse an output directory that exists and is not empty, unless ``force``."""
    if os.path.exists(output) and not force and (not os.path.isdir(output) or os.listdir(output)):
        raise UsageError(f"output {output} exists and is not empty; choose a new --output or add --force to replace it")


@contextlib.contextmanager
def staged_output_dir(output: str, force: bool = False, promote: str | None = None) -> Iterator[str]:
    """Yield ``OUTPUT.tmp`` to write into; on success it (or its subfolder ``promote``) becomes ``output``.

    On any failure the staging folder is removed, so ``output`` is either complete or untouched.
    """
    check_output_dir(output, force)
    output = os.path.abspath(output)
    tmp = output + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        yield tmp
        source = os.path.join(tmp, promote) if promote else tmp
        if os.path.isdir(output) and not os.path.islink(output):
            shutil.rmtree(output)
        elif os.path.lexists(output):
            os.remove(output)
        os.replace(source, output)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
