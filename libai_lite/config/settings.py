"""Settings declared once: a frozen dataclass field names its config key, default, range and meaning.

``setting(default, key=..., rule=..., doc=...)`` declares a field; ``read_settings`` fills a record from a
config (a key the config lacks takes the default; a value out of its rule is refused in ``check_ranges``'s one
line); ``setting_rules`` gives the records' rules to ``check_ranges``, which checks every key before anything
is built. This module names no key: the records that use it do.
"""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Iterable

from omegaconf import DictConfig, ListConfig, OmegaConf

from ..utils.errors import UsageError
from .validate import OneOf, Range, range_error

_ABSENT = object()


def setting(default: Any = dataclasses.MISSING, *, key: str | None = None, rule: Range | OneOf | None = None,
            doc: str = "", null_is_default: bool = False, needed_when: str | None = None):
    """A record field read from config ``key`` (None: not from the config; given by whoever builds the record).

    ``rule`` is its range or choices; ``null_is_default``: an explicit null (or, without a rule, "") reads as
    ``default``;
    ``needed_when``: the name of a ``read_settings`` flag under which the key must be in the config.
    """
    meta = {"key": key, "rule": rule, "doc": doc, "null_is_default": null_is_default, "needed_when": needed_when}
    return dataclasses.field(default=default, metadata=meta)


def setting_rules(records: Iterable[type]) -> dict:
    """``{key path: rule}`` of every field of ``records`` that has both (``check_ranges``'s table)."""
    return {f.metadata["key"]: f.metadata["rule"] for cls in records for f in dataclasses.fields(cls)
            if f.metadata.get("key") and f.metadata.get("rule") is not None}


def setting_defaults(record: type) -> dict:
    """``{key path: default}`` of ``record``'s config fields, what a key the config leaves out reads as."""
    return {f.metadata["key"]: f.default for f in dataclasses.fields(record)
            if f.metadata.get("key") and f.default is not dataclasses.MISSING}


def _convert(rule, value):
    if isinstance(rule, Range) and rule.length is None and value is not None and not isinstance(value, bool):
        return int(value) if rule.integer else float(value)
    return value


def check_section_keys(record: type, node, section: str) -> None:
    """Refuse, in one line, a key of ``node`` (the config's ``section``) that no field of ``record`` reads."""
    if not isinstance(node, (DictConfig, dict)):
        return
    known = {f.metadata["key"].rpartition(".")[2] for f in dataclasses.fields(record)
             if (f.metadata.get("key") or "").rpartition(".")[0] == section}
    unknown = sorted(set(node.keys()) - known)
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(f"{section} has no key {unknown[0]!r}; {hint}its keys are {', '.join(sorted(known))}")


def read_settings(record: type, cfg, given: dict | None = None, *, section: str | None = None, **flags: bool):
    """``record`` filled from ``cfg``: each field's key, its default when absent; ``given`` fields as passed.

    A field whose ``needed_when`` flag is true must be in ``cfg`` (null is a value there); a value outside
    its rule is refused in one line. With ``section``, ``cfg`` is the config's node at that key path (a dict
    or None), and a key there that no field reads is refused too."""
    if section is not None:
        check_section_keys(record, cfg, section)
        cfg = OmegaConf.create({}) if cfg is None else cfg
        for part in reversed(section.split(".")):
            cfg = {part: cfg}
        cfg = OmegaConf.create(cfg, flags={"allow_objects": True})
    given = dict(given or {})
    values = {}
    for f in dataclasses.fields(record):
        if f.name in given:
            values[f.name] = given.pop(f.name)
            continue
        meta = f.metadata
        key = meta.get("key")
        if key is None:
            continue
        value = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=False)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        if value is _ABSENT:
            if meta["needed_when"] and flags.get(meta["needed_when"]):
                raise UsageError(f"{key} is missing from the config: set it (configs/common/train.py has every "
                                 f"train key with its default)")
            continue
        rule = meta["rule"]
        if meta["null_is_default"] and (value is None or (value == "" and rule is None)):
            continue
        if rule is not None and not rule.accepts(value):
            raise range_error(key, rule, value)
        values[f.name] = _convert(rule, value)
    if given:
        raise TypeError(f"{record.__name__} has no fields {sorted(given)}")
    return record(**values)
