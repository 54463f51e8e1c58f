"""Hugging Face ``tokenizer.json`` (Llama 3, Mistral, Qwen2, ...) on the ``tokenizers`` library alone."""
from __future__ import annotations

import json
import os
from typing import Optional

from tokenizers import AddedToken, Tokenizer

from libai_lite.utils.errors import UsageError

from .base import TokenizersBackend, check_file, first_line

TOKENIZER_FILE = "tokenizer.json"
FIX = ("set tokenization.tokenizer.path (tools/preprocess_data.py: --tokenizer-model) to a directory "
       "holding the model's tokenizer.json (transformers' save_pretrained writes one)")
NAMED = ("bos_token", "eos_token", "pad_token", "unk_token")


def _read_json(path: str) -> dict:
    """A side file's JSON object, or {} when the file is absent."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {path} ({first_line(e)}); fix it or re-save the tokenizer with "
                         f"transformers' save_pretrained") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} holds a JSON {type(data).__name__}, not an object; re-save the tokenizer with "
                         f"transformers' save_pretrained")
    return data


def _added_token(value) -> Optional[AddedToken]:
    """An ``AddedToken`` from a config entry: a string or transformers' serialised ``{"content": ...}``."""
    if not value or isinstance(value, str):
        return AddedToken(value, special=True, normalized=False) if value else None
    fields = {k: v for k, v in value.items() if k in ("content", "single_word", "lstrip", "rstrip", "normalized")}
    return AddedToken(**fields, special=value.get("special", True))


class HuggingFaceTokenizer(TokenizersBackend):
    """A Hugging Face fast tokenizer read from ``tokenizer.json``, with ids as ``transformers.AutoTokenizer``'s.

    ``path`` is a directory holding ``tokenizer.json``, or that file. ``tokenizer_config.json`` and
    ``special_tokens_map.json`` beside it name the bos/eos/pad/unk tokens; one missing from ``tokenizer.json``
    is appended, as transformers does. ``generation_config.json`` supplies an id neither file names (its
    first when it lists several). ``tokenizer_config`` is ``tokenizer_config.json`` as read (``{}`` if absent).

    ``encode(text)`` gives the bare ids; ``add_special_tokens=True`` adds what the ``tokenizer.json``
    template adds (BOS for Llama and Mistral, nothing for Qwen2), as in transformers 5, whatever
    ``add_bos_token`` says. Special-token strings in a text encode as their ids. ``eod_id`` is the eos id;
    ``vocab_size`` is the highest id plus one.
    """

    def __init__(self, path):
        path = "" if path is None else os.fspath(path)
        file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
        try:
            self.tokenizer_file = check_file(file, "Hugging Face tokenizer.json", FIX)
        except (OSError, ValueError) as e:
            raise UsageError(str(e)) from None
        try:
            self._tok = Tokenizer.from_file(self.tokenizer_file)
        except Exception as e:  # tokenizers raises plain Exception on a bad file
            raise UsageError(f"cannot load {self.tokenizer_file} ({first_line(e)}); pass a tokenizer.json "
                             f"written by tokenizers or transformers") from None
        folder = os.path.dirname(os.path.abspath(self.tokenizer_file))
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        # Kept for export, which writes it beside a copy of tokenizer.json (see checkpoint/hf_io.py).
        self.tokenizer_config = config
        generation = _read_json(os.path.join(folder, "generation_config.json"))
        named = {k: config[k] for k in NAMED if k in config}
        # transformers 5 reads special_tokens_map.json only for configs older than added_tokens_decoder,
        # and then lets it override tokenizer_config.json.
        if "added_tokens_decoder" not in config:
            special_map = _read_json(os.path.join(folder, "special_tokens_map.json"))
            named.update({k: special_map[k] for k in NAMED if k in special_map})

        # The tokens transformers adds when tokenizer.json lacks them, in its order.
        listed = [t for _, t in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0]))]
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = list(extra.values()) if isinstance(extra, dict) else list(extra)
        tokens = [_added_token(t) for t in listed + list(named.values()) + extra]
        missing = {t.content: t for t in tokens if t is not None and self._tok.token_to_id(t.content) is None}
        if missing:
            self._tok.add_special_tokens(list(missing.values()))
        self._tok.encode_special_tokens = bool(config.get("split_special_tokens", False))

        def token_id(key: str) -> Optional[int]:
            if key in named:
                token = _added_token(named[key])
                return None if token is None else self._tok.token_to_id(token.content)
            ids = generation.get(f"{key}_id")
            return ids[0] if isinstance(ids, list) and ids else ids if isinstance(ids, int) else None

        self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id = map(token_id, NAMED)
        self.eod_id = self.eos_token_id
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        # What the template puts around an empty text tells which of the two it adds.
        template = self._tok.encode("", add_special_tokens=True).ids
        self.add_bos_token = bool(template) and template[0] == self.bos_token_id
        self.add_eos_token = len(template) > self.add_bos_token and template[-1] == self.eos_token_id
