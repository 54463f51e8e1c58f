"""Hugging Face model directories on disk, for any model: no key or layout of one model is known here.

Weights are read from ``model.safetensors`` or ``pytorch_model.bin`` (``torch.load(weights_only=True)``,
so no pickled code runs), either one sharded by its index; output is staged and appears only when complete.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from ..utils.errors import UsageError

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_NAME = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"


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
        if not os.path.isfile(index_path):
            continue
        try:
            with open(index_path, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UsageError(f"{index_path} is not a weight index (no weight_map: {type(e).__name__}); "
                             f"re-download it") from e
        missing = [s for s in shards if not os.path.isfile(os.path.join(hf_dir, s))]
        if missing:
            raise UsageError(f"{index_path} names the shard {missing[0]}, which is missing; download every shard")
        return {k: v for s in shards for k, v in load(os.path.join(hf_dir, s)).items()}
    raise UsageError(f"{hf_dir} has no weights ({SAFETENSORS_NAME}, {SAFETENSORS_INDEX}, {TORCH_NAME} or "
                     f"{TORCH_INDEX}); download the weights, not only the config")


@dataclass
class HFTokenizer:
    """One of our tokenizers found in a Hugging Face directory by a project's mapping: ``files`` ({name: path}),
    and the source of a ``LazyCall`` building it from those names in the folder ``_here`` with its import line.
    """

    tokenizer: object
    files: dict
    lazy_call: str
    import_line: str


# What a HuggingFaceTokenizer reads beside a tokenizer.json (the ids it names, add_bos_token), and the chat
# template transformers reads, kept so that an export of the import carries it.
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_JSON_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                             "chat_template.jinja")
GPT2_FILES = ("vocab.json", "merges.txt")
TOKENIZER_FORMATS = ("tokenizer.json", "gpt2")


def _tokenizer_json(hf_dir: str) -> HFTokenizer | None:
    from ..tokenizer import HuggingFaceTokenizer

    if not os.path.isfile(os.path.join(hf_dir, TOKENIZER_JSON)):
        return None
    names = (TOKENIZER_JSON, *TOKENIZER_JSON_SIDE_FILES)
    files = {n: os.path.join(hf_dir, n) for n in names if os.path.isfile(os.path.join(hf_dir, n))}
    return HFTokenizer(HuggingFaceTokenizer(hf_dir), files, "LazyCall(HuggingFaceTokenizer)(path=_here)",
                       "from libai_lite.tokenizer import HuggingFaceTokenizer")


def _gpt2_files(hf_dir: str) -> HFTokenizer | None:
    from ..tokenizer import GPT2Tokenizer

    vocab, merges = (os.path.join(hf_dir, n) for n in GPT2_FILES)
    if not (os.path.isfile(vocab) and os.path.isfile(merges)):
        return None
    try:
        tok = GPT2Tokenizer(vocab, merges)
    except ValueError as e:
        raise UsageError(f"the GPT-2 tokenizer files in {hf_dir} cannot be loaded: {e}") from e
    return HFTokenizer(tok, {"vocab.json": vocab, "merges.txt": merges},
                       'LazyCall(GPT2Tokenizer)(vocab_file=os.path.join(_here, "vocab.json"), '
                       'merges_file=os.path.join(_here, "merges.txt"))',
                       "from libai_lite.tokenizer import GPT2Tokenizer")


def find_hf_tokenizer(hf_dir: str, formats=TOKENIZER_FORMATS) -> HFTokenizer | None:
    """Our tokenizer for a Hugging Face directory's tokenizer files, or None when it holds none of ``formats``.

    ``formats`` are tried in order: ``"tokenizer.json"`` (a ``HuggingFaceTokenizer``, with its side files)
    and ``"gpt2"`` (``vocab.json`` + ``merges.txt``, a ``GPT2Tokenizer``). The order matters because GPT-2's
    Hub directories hold both.
    """
    finders = {"tokenizer.json": _tokenizer_json, "gpt2": _gpt2_files}
    unknown = [f for f in formats if f not in finders]
    if unknown:
        raise ValueError(f"unknown tokenizer format {unknown[0]!r}; known: {', '.join(finders)}")
    for fmt in formats:
        found = finders[fmt](hf_dir)
        if found is not None:
            return found
    return None


def _tokenizer_json_files(tokenizer) -> tuple[dict, dict, list[str]]:
    """A ``HuggingFaceTokenizer``'s files and a ``tokenizer_config.json`` naming every token it has an id for."""
    from ..tokenizer.huggingface import NAMED

    folder = os.path.dirname(os.path.abspath(tokenizer.tokenizer_file))
    files = {TOKENIZER_JSON: tokenizer.tokenizer_file}
    # generation_config.json is the model's (written from config.json), not the tokenizer's.
    for name in ("special_tokens_map.json", "chat_template.jinja"):
        if os.path.isfile(os.path.join(folder, name)):
            files[name] = os.path.join(folder, name)
    config = dict(tokenizer.tokenizer_config)
    # Without a class transformers 4 picks the model type's tokenizer class, which rewrites the tokenizer.json
    # template from add_bos_token; PreTrainedTokenizerFast (Llama 3's) loads the file as it is.
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    for key in NAMED:
        # An id our tokenizer took from generation_config.json, or a token named only in special_tokens_map.json,
        # is written down so that AutoTokenizer sees it too.
        token_id = getattr(tokenizer, f"{key}_id", None)
        if key not in config and token_id is not None:
            config[key] = tokenizer.id_to_token(token_id)
    return files, config, []


def tokenizer_files(tokenizer, sentencepiece_config: dict | None = None) -> tuple[dict, dict | None, list[str]]:
    """``({name: source path}, tokenizer_config or None, notes)`` to make an exported directory usable.

    ``sentencepiece_config``: the ``tokenizer_config.json`` with which transformers reads a SentencePiece
    tokenizer as the model's own (the project's mapping declares it); without one the ids are not described.
    """
    from ..tokenizer import BertTokenizer, GPT2Tokenizer, HuggingFaceTokenizer, SentencePieceTokenizer

    if isinstance(tokenizer, HuggingFaceTokenizer):
        return _tokenizer_json_files(tokenizer)
    if isinstance(tokenizer, GPT2Tokenizer):
        return {"vocab.json": tokenizer.vocab_file, "merges.txt": tokenizer.merges_file}, None, []
    if isinstance(tokenizer, SentencePieceTokenizer):
        if sentencepiece_config is not None:
            return {"spiece.model": tokenizer.model_file}, sentencepiece_config, []
        return {"spiece.model": tokenizer.model_file}, None, [
            "the SentencePiece tokenizer uses Megatron's id convention (special tokens appended after the "
            "pieces), which transformers' T5Tokenizer does not reproduce; tokenize with libai_lite"]
    if isinstance(tokenizer, BertTokenizer):
        return {"vocab.txt": tokenizer.vocab_file}, None, [
            "vocab.txt is copied, but the [BOS]/[EOS]/<extra_id_*> tokens libai_lite appends to a BERT "
            "vocabulary are not described for transformers; tokenize with libai_lite"]
    return {}, None, [f"{type(tokenizer).__name__} has no known files; copy the tokenizer files yourself"]


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
    # safetensors creates the file 0600; the directory's other files follow the umask (0644 under 022).
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _write_json(obj, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def write_hf_dir(output_dir: str, hf_config: Mapping, hf_sd: Mapping[str, torch.Tensor], tokenizer=None,
                 sentencepiece_config: dict | None = None) -> list[str]:
    """Write a Hugging Face directory: config, generation config (its token ids), weights, tokenizer files
    (``sentencepiece_config`` as ``tokenizer_files`` takes it). Returns notes worth printing about the tokenizer.
    """
    files, tok_config, notes = (tokenizer_files(tokenizer, sentencepiece_config) if tokenizer is not None
                                else ({}, None, []))
    os.makedirs(output_dir, exist_ok=True)
    _save_safetensors(hf_sd, os.path.join(output_dir, SAFETENSORS_NAME))
    _write_json(dict(hf_config), os.path.join(output_dir, CONFIG_NAME))
    generation = {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
                  if hf_config.get(k) is not None}
    _write_json(generation, os.path.join(output_dir, "generation_config.json"))
    for name, src in files.items():
        shutil.copyfile(src, os.path.join(output_dir, name))
    if tok_config is not None:
        _write_json(tok_config, os.path.join(output_dir, "tokenizer_config.json"))
    return notes


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
    try:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
        yield tmp
        source = os.path.join(tmp, promote) if promote else tmp
        if os.path.isdir(output) and not os.path.islink(output):
            shutil.rmtree(output)
        elif os.path.lexists(output):
            os.remove(output)
        os.replace(source, output)
    except OSError as e:
        # A write of the output (a read-only or full filesystem), not a read of an input, is the output's fault.
        if e.filename is not None and not os.path.abspath(os.fspath(e.filename)).startswith(output):
            raise
        fix = "free space there" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "make its folder writable"
        raise UsageError(f"cannot write {output}: {e.strerror or e}; {fix} or give --output another path "
                         f"(nothing was kept)") from e
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
