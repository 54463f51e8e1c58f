"""Command-line overrides in Hydra's grammar, checked against the config they change."""
import contextlib
import difflib
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

from ..utils.errors import UsageError
from .instantiate import join_key
from .loader import IMPORT_ROOTS_KEY, one_line

__all__ = ["ConfigKeyError", "ConfigTypeError", "apply_overrides"]


class ConfigKeyError(KeyError, UsageError):
    """A config key path that does not exist (or already exists, for ``+key=``)."""

    def __str__(self) -> str:
        # KeyError's str() is the repr of its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class ConfigTypeError(UsageError):
    """An override whose value has the wrong type for the key it replaces."""


def _is_live_container(node: Any) -> bool:
    return isinstance(node, (DictConfig, ListConfig)) and not (
        node._is_none() or node._is_missing() or node._is_interpolation()
    )


def _find_node(cfg: Any, key: str) -> Tuple[bool, Any]:
    """(exists, node) for a dotted key, without resolving interpolations."""
    parts = key.split(".")
    node = cfg
    for depth, part in enumerate(parts):
        if depth and not _is_live_container(node):
            value = node._value() if hasattr(node, "_value") else node
            raise ConfigKeyError(
                f"Cannot reach config key {key!r}: {'.'.join(parts[:depth])!r} holds {type(value).__name__} "
                f"{value!r}, not a config node"
            )
        try:
            node = node._get_node(int(part) if isinstance(node, ListConfig) else part, throw_on_missing_key=False)
        except (ValueError, IndexError):  # not an index, or out of the list's range
            return False, None
        if node is None:
            return False, None
    return True, node


def _all_key_paths(node: Any, prefix: str = "") -> Iterator[str]:
    if not isinstance(node, DictConfig):
        return
    for key in node.keys():
        if not prefix and key == IMPORT_ROOTS_KEY:
            continue  # the loader's bookkeeping, never a key a user meant
        path = join_key(prefix, key)
        yield path
        child = node._get_node(key)
        if _is_live_container(child):
            yield from _all_key_paths(child, path)


def _unknown_key_error(cfg: Any, key: str, limit: int = 3) -> ConfigKeyError:
    paths = list(_all_key_paths(cfg))
    # A key typed without its prefix (``train_iter`` for ``train.train_iter``) is
    # the commonest slip; difflib on whole paths ranks those too low on deep configs.
    same_leaf = [p for p in paths if p.endswith("." + key) or p.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
    suggestions: List[str] = []
    for p in [*difflib.get_close_matches(key, paths, n=limit, cutoff=0.6), *same_leaf]:
        if p not in suggestions and p != key:
            suggestions.append(p)
    quoted = [f"'{s}'" for s in suggestions[:limit]]
    hint = "."
    if quoted:
        hint = f"; did you mean {quoted[0] if len(quoted) == 1 else ', '.join(quoted[:-1]) + ' or ' + quoted[-1]}?"
    return ConfigKeyError(f"Unknown config key '{key}'{hint} Use +{key}=... to add a new key.")


def _number(text: str) -> Any:
    for convert in (int, float):
        with contextlib.suppress(ValueError):
            return convert(text)
    return text


def _checked_value(key: str, node: Any, new: Any) -> Any:
    """``new`` as it should be stored at ``key``; ConfigTypeError if it cannot hold there."""
    if isinstance(node, (DictConfig, ListConfig)) or node._is_interpolation() or node._is_missing():
        return new
    old = node._value()
    if old is None or new is None or (isinstance(new, str) and "${" in new):
        return new

    def wrong(expected: str) -> ConfigTypeError:
        return ConfigTypeError(
            f"Cannot override config key '{key}' ({type(old).__name__}, currently {old!r}) with "
            f"{new!r} ({type(new).__name__}); expected {expected}, or null to clear it."
        )

    if isinstance(old, bool):
        if isinstance(new, str) and new.strip().lower() in ("true", "false"):
            return new.strip().lower() == "true"
        if not isinstance(new, bool):
            raise wrong("true or false")
    elif isinstance(old, (int, float)):
        new = _number(new.strip()) if isinstance(new, str) else new
        if isinstance(new, bool) or not isinstance(new, (int, float)):
            raise wrong("a number")
        # Keep a float key a float (``optim.lr=1``); an int key may become a float.
        return float(new) if isinstance(old, float) else new
    return new


def _check_shape(key: str, node: Any, new: Any) -> None:
    """A dict key is replaced by a dict naming only keys it has (lists and scalars are checked by
    type in ``_checked_value`` and by range in ``validate.check_ranges``)."""
    if not isinstance(node, DictConfig) or node._is_none() or node._is_interpolation():
        return
    if new is None or isinstance(new, str) and "${" in new:
        return
    if not isinstance(new, dict):
        raise ConfigTypeError(f"Cannot override config key '{key}' (a dict) with {new!r}; give a dict "
                              f"({key}={{name: value, ...}}) or set its keys one by one ({key}.name=value)")
    for name, value in new.items():
        path = join_key(key, str(name))
        child = node._get_node(name, throw_on_missing_key=False)
        if child is None:
            raise ConfigKeyError(f"Unknown config key '{path}' in the override of '{key}' (its keys: "
                                 f"{', '.join(map(str, node.keys()))}); use ++{path}=... to add a new key")
        _check_shape(path, child, value)


def apply_overrides(cfg: Any, overrides: Optional[Sequence[str]]) -> Any:
    """Apply command-line overrides in Hydra's grammar to ``cfg`` in place and return it.

    ``key=value`` replaces an existing key (``ConfigKeyError`` with suggestions if there is none,
    ``ConfigTypeError`` if a number/bool gets another kind), ``+key=`` adds, ``++key=`` sets either way,
    ``~key`` deletes.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for text in overrides or ():
        try:
            override = parser.parse_override(text)
        except HydraException as e:
            raise ConfigTypeError(f"Cannot parse override {text!r}: {one_line(e)}") from e
        key = override.key_or_group
        if not key:
            raise ConfigKeyError(f"Override {text!r} names no key; write KEY=VALUE, e.g. train.train_iter=100")
        if override.package is not None:
            raise ConfigTypeError(f"Override {text!r}: '@package' is not supported in lazy configs")
        if override.is_sweep_override():
            raise ConfigTypeError(f"Override {text!r} is a sweep; give a single value (quote it to pass a string)")
        value = override.value()

        exists, node = _find_node(cfg, key)
        if not exists and not (override.is_add() or override.is_force_add()):
            raise _unknown_key_error(cfg, key)
        if override.is_delete():
            del node._get_parent()[node._key()]
        elif override.is_add():
            if exists:
                raise ConfigKeyError(
                    f"Cannot add config key '{key}': it already exists. "
                    f"Use {key}=... to override it (or ++{key}=... to set it either way)."
                )
            OmegaConf.update(cfg, key, value, merge=True, force_add=True)
        else:
            if exists and not override.is_force_add():
                _check_shape(key, node, value)
            value = _checked_value(key, node, value) if exists else value
            OmegaConf.update(cfg, key, value, merge=True, force_add=override.is_force_add())
    return cfg
