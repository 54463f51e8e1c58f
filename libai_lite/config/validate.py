"""The rules a run's settings are checked by before anything is built (ranges, choices, paths), and the one
reader that refuses a value in one line; which key takes which rule is declared where the key is read.

A value out of range is refused in one line naming the key, the value and the range. Keys a config
lacks are skipped; ``*`` in a key path matches any run of characters (``model.cfg.*dropout*``).
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf

from ..utils.errors import UsageError
from .instantiate import TargetNotFoundError, join_key, locate

__all__ = ["Range", "OneOf", "PathValue", "check_ranges", "check_paths", "check_targets",
           "SECTIONS", "check_sections", "range_error", "COUNT", "COUNT_OR_NULL", "NON_NEGATIVE_INT", "POSITIVE",
           "NON_NEGATIVE", "FRACTION", "SWITCH"]


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True)
class Range:
    """A number (``integer`` or not) in [low, high], with open ends where ``*_open``; ``null`` only if ``nullable``.

    ``length`` makes the value a list of that many such numbers (``optim.betas``). Infinity only where
    ``infinite`` (a norm type): an infinite learning rate passed the range and diverged at the first step.
    """

    low: float | None = None
    high: float | None = None
    integer: bool = False
    nullable: bool = False
    low_open: bool = False
    high_open: bool = False
    length: int | None = None
    infinite: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else ("a number" if self.infinite else "a finite number")
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.low_open else '>='} {_number(self.low)}")
        if self.high is not None:
            bounds.append(f"{'<' if self.high_open else '<='} {_number(self.high)}")
        text = f"{kind} {' and '.join(bounds)}".strip()
        if self.length is not None:
            text = f"a list of {self.length} numbers, each {' and '.join(bounds)}"
        return text + (", or null" if self.nullable else "")

    def _number_ok(self, v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            return False
        if math.isinf(v) and not self.infinite:
            return False
        if self.integer and (not float(v).is_integer() or math.isinf(v)):
            return False
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return False
        if self.high is not None and (v >= self.high if self.high_open else v > self.high):
            return False
        return True

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if self.length is not None:
            return isinstance(value, (list, tuple)) and len(value) == self.length and all(
                self._number_ok(v) for v in value)
        return self._number_ok(value)


@dataclass(frozen=True)
class OneOf:
    """One of a few named values (a schedule, a precision, a mode)."""

    values: tuple

    def describe(self) -> str:
        return "one of " + ", ".join(repr(v) for v in self.values)

    def accepts(self, value: Any) -> bool:
        return value in self.values


def _is_number(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class PathValue:
    """A file or directory path, a string; ``nullable``: null is allowed (none); ``blend``: Megatron's blend list
    ``[weight1, prefix1, weight2, prefix2, ...]`` (or a one-prefix list) as well."""

    nullable: bool = False
    blend: bool = False

    def describe(self) -> str:
        text = "a path (a string)"
        if self.blend:
            text += " or Megatron's blend list [weight1, prefix1, weight2, prefix2, ...]"
        return text + (", or null" if self.nullable else "")

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if isinstance(value, str):
            return True
        if not self.blend or not isinstance(value, (list, tuple)):
            return False
        if len(value) == 1:
            return isinstance(value[0], str)
        return (len(value) >= 2 and len(value) % 2 == 0 and all(_is_number(w) for w in value[0::2])
                and all(isinstance(p, str) for p in value[1::2]))


COUNT = Range(low=1, integer=True)
COUNT_OR_NULL = Range(low=1, integer=True, nullable=True)
NON_NEGATIVE_INT = Range(low=0, integer=True)
POSITIVE = Range(low=0, low_open=True)
NON_NEGATIVE = Range(low=0)
FRACTION = Range(low=0, high=1)
SWITCH = OneOf((False, True))

def _leaf_paths(node: Any, prefix: str = "", with_dicts: bool = False) -> Iterator[str]:
    if isinstance(node, DictConfig):
        for key in node.keys():
            path = f"{prefix}.{key}" if prefix else str(key)
            child = node._get_node(key)
            if child._is_interpolation():
                continue  # checked at the key it refers to, the one a user sets
            if isinstance(child, DictConfig) and not child._is_none():
                if with_dicts:
                    yield path
                yield from _leaf_paths(child, path, with_dicts)
            else:
                yield path


def _value(cfg, path: str) -> Any:
    value = OmegaConf.select(cfg, path, throw_on_missing=False)
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    return value


def check_paths(cfg, paths: dict) -> None:
    """Raise ``UsageError`` for the first path of ``cfg`` that ``paths`` (key path or pattern -> ``PathValue``)
    names and that is not a path, before any is used."""
    for path, kind, value in _ruled_values(cfg, paths, with_dicts=True):
        if not kind.accepts(value):
            shown = "null" if value is None else repr(value)
            # A bare number on the command line is parsed as one.
            quote = f" (a name that looks like a number is quoted: {path}=\"'{value}'\")" if _is_number(value) else ""
            weights = value[0::2] if isinstance(value, (list, tuple)) and len(value) >= 2 else []
            if any(isinstance(w, (int, float)) and not isinstance(w, bool) and not math.isfinite(w) for w in weights):
                raise UsageError(f"{path}={shown}: a blend weight is not a finite number; give each prefix a finite "
                                 f"weight > 0, as [weight1, prefix1, weight2, prefix2, ...]")
            raise UsageError(f"{path}={shown} is not a path: it must be {kind.describe()}{quote}; set {path} to "
                             f"such a value")


def _ruled_values(cfg, rules: dict, with_dicts: bool = False):
    """``(path, rule, value)`` for each leaf of ``cfg`` (and dict, ``with_dicts``) that ``rules`` names, exactly
    or by a ``*`` pattern; a value whose interpolation does not resolve is skipped (reported where it is used)."""
    exact = {k: r for k, r in rules.items() if "*" not in k}
    patterns = {k: r for k, r in rules.items() if "*" in k}
    for path in _leaf_paths(cfg, with_dicts=with_dicts):
        rule = exact.get(path) or next((r for p, r in patterns.items() if fnmatch.fnmatchcase(path, p)), None)
        if rule is None:
            continue
        try:
            value = _value(cfg, path)
        except Exception:  # noqa: BLE001 - an interpolation that does not resolve is reported where it is used
            continue
        yield path, rule, value


def range_error(path: str, rule: "Range | OneOf", value: Any) -> UsageError:
    """The one line that refuses ``value`` at ``path`` for ``rule``."""
    shown = "null" if value is None else repr(value)
    problem = "is out of range" if isinstance(rule, Range) else "is not allowed"
    return UsageError(f"{path}={shown} {problem}: it must be {rule.describe()}; set {path} to such a value")


def check_ranges(cfg, ranges: dict | None = None) -> None:
    """Raise ``UsageError`` for the first key of ``cfg`` whose value is outside its range in ``ranges`` (``RANGES``;
    the settings records' own rules are added by their readers, ``run_sections.check_settings``)."""
    for path, rng, value in _ruled_values(cfg, RANGES if ranges is None else ranges):
        if not rng.accepts(value):
            raise range_error(path, rng, value)


def _targets(node: Any, prefix: str = "") -> Iterator[tuple]:
    """``(key path, dotted target)`` of every ``_target_`` string in ``node`` (interpolations skipped)."""
    if isinstance(node, DictConfig) and not node._is_none():
        for key in node.keys():
            child = node._get_node(key)
            path = join_key(prefix, key)
            if child._is_interpolation() or child._is_missing():
                continue
            if key == "_target_":
                if isinstance(child._value(), str):
                    yield path, child._value()
            else:
                yield from _targets(child, path)
    elif isinstance(node, ListConfig) and not node._is_none():
        for i in range(len(node)):
            yield from _targets(node._get_node(i), join_key(prefix, i))


def check_targets(cfg) -> None:
    """Raise ``UsageError`` for the first ``_target_`` of ``cfg`` that names no class or function, before anything
    is built: a typo found when its section is built (the optimizer after the data's index cache) wrote files
    first. A module that is there but fails to import is left to the section that builds it."""
    for path, target in _targets(cfg):
        try:
            locate(target)
        except TargetNotFoundError as e:
            reason = str(e).split(": ", 1)[-1]
            # A missing module's message already says how to install it; a typo is corrected in the config.
            fix = f"or correct {path}" if "no module named" in reason else f"correct {path}"
            raise UsageError(f"{path}={target!r} cannot be imported: {reason}; {fix}") from e
        except ImportError:
            continue


# The sections a training reads, each a dict of settings (or a LazyCall): what the run takes from it.
SECTIONS: dict[str, str] = {
    "model": "the model to build, a LazyCall with _target_",
    "optim": "the optimizer, a LazyCall with _target_",
    "dataloader": "the data loaders",
    "dataloader.train": "the training data, a LazyCall with _target_",
    "train": "the run's settings (configs/common/train.py has every key with its default)",
    "train.dist": "the parallel layout: data_parallel_size, tensor_parallel_size, pipeline_parallel_size, ...",
}


def check_sections(cfg, config_file) -> None:
    """Raise ``UsageError`` when ``cfg`` (loaded from ``config_file``) lacks a section a training reads, or holds
    something else than a dict there (``model=null``); before the overrides, so that a file without ``model`` is
    not blamed on the first override that names it, and after them."""
    top = [key for key in SECTIONS if "." not in key]
    missing = [key for key in top if key not in cfg]
    if missing:
        names = ", ".join(missing)
        raise UsageError(f"config file {config_file} defines no {names}: a training config defines "
                         f"{', '.join(top[:-1])} and {top[-1]} at its top level (as projects/GPT/configs/gpt2_pretrain.py does, importing most from "
                         f"configs/common/); define or import {names} there")
    for key, what in SECTIONS.items():
        parent, _, name = key.rpartition(".")
        holder = cfg if not parent else OmegaConf.select(cfg, parent)
        node = holder._get_node(name, throw_on_missing_key=False) if isinstance(holder, DictConfig) else None
        if node is None:
            raise UsageError(f"{key} is missing from the config: it holds {what}; set it in {config_file}, or drop "
                             f"the override that removed it")
        if node._is_interpolation():
            continue
        if not isinstance(node, DictConfig) or node._is_none():
            value = None if node._is_none() else node._value()
            shown = "null" if value is None else repr(value)
            raise UsageError(f"{key}={shown} is not a config section: it must hold {what}; remove the override that "
                             f"set it, or set it in {config_file}")
