"""Lazy Python configs in the detectron2 ``config/lazy.py`` style.

A config is a Python file whose top-level names (``model``, ``train``, ``optim``, ...) are omegaconf
nodes built with :class:`LazyCall`; :class:`LazyConfig` loads, saves and overrides them.
"""
import contextlib
import dataclasses
import errno
import logging
import os
from collections import abc
from pathlib import Path
from typing import Any, List, Sequence, Union

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf, SCMode

from .instantiate import join_key, locate, target_to_string
from .loader import IMPORT_ROOTS_KEY, ConfigLoadError, add_import_root, cast_to_config, exec_config, one_line
from .loader import restore_import_roots
from .overrides import ConfigKeyError, ConfigTypeError, apply_overrides
from ..utils.errors import UsageError
from ..utils.files import atomic_write

__all__ = ["LazyCall", "LazyConfig", "ConfigKeyError", "ConfigTypeError", "ConfigLoadError", "IMPORT_ROOTS_KEY",
           "add_import_root", "try_get_key"]

logger = logging.getLogger(__name__)

_SCALARS = (str, int, float, bool, type(None))


class LazyCall:
    """Record a call for later: ``LazyCall(f)(x=1)`` is a ``DictConfig`` ``{_target_: f, x: 1}``.

    ``target`` is a callable or a dotted import path string. The callable is kept as is (so
    classes defined in scripts and tests work); :meth:`LazyConfig.save` writes its dotted path.
    """

    def __init__(self, target: Any):
        if not (callable(target) or isinstance(target, str)):
            raise TypeError(f"LazyCall target must be a callable or a dotted import path, got {target!r}")
        self._target = target

    def __call__(self, **kwargs: Any) -> DictConfig:
        if "_target_" in kwargs:
            raise TypeError("LazyCall(...)(...) got '_target_' as a keyword; pass the target to LazyCall")
        # omegaconf cannot store a dataclass type as a value.
        target = target_to_string(self._target) if dataclasses.is_dataclass(self._target) else self._target
        return DictConfig(content={"_target_": target, **kwargs}, flags={"allow_objects": True})


def _placeholder(obj: Any, path: str, problems: List[str]) -> str:
    problems.append(path)
    return f"<unserializable {type(obj).__name__}: {one_line(repr(obj))[:200]}>"


def _target_string(target: Any, path: str, problems: List[str]) -> str:
    try:
        name = target_to_string(target)
    except AttributeError:
        return _placeholder(target, path, problems)
    with contextlib.suppress(Exception):
        if locate(name) is target:
            return name
    # Classes defined in __main__ or inside functions: readable in YAML, but only the pickle brings them back.
    problems.append(path)
    return name


def _yaml_ready(obj: Any, path: str, problems: List[str]) -> Any:
    """A plain-YAML copy of ``obj``; unserialisable leaves become placeholders listed in ``problems``."""
    if type(obj) in _SCALARS:
        return obj
    if isinstance(obj, (list, tuple)):
        return [_yaml_ready(v, join_key(path, i), problems) for i, v in enumerate(obj)]
    if not isinstance(obj, abc.Mapping):
        return _placeholder(obj, path, problems)
    out = {}
    for key, value in obj.items():
        child = join_key(path, key)
        if type(key) not in _SCALARS:
            problems.append(child)
            key = str(key)
        ready = _target_string if key == "_target_" and callable(value) else _yaml_ready
        out[key] = ready(value, child, problems)
    return out


class LazyConfig:
    """Load, save and override lazy configs (``.py`` files or saved ``.yaml``)."""

    apply_overrides = staticmethod(apply_overrides)

    @staticmethod
    def load(filename: Union[str, os.PathLike], keys: Union[None, str, Sequence[str]] = None):
        """Execute a ``.py`` config (or read a saved ``.yaml``) and return its top-level configs.

        Without ``keys``: a ``DictConfig`` of the public top-level configs, containers and scalars, plus
        ``_import_roots_`` when the config's code came from folders outside the installed packages
        (loading a ``.yaml`` puts those back on the import path). With ``keys``: that value, or a tuple.
        """
        path = Path(os.fspath(filename)).expanduser()
        if path.is_dir():
            raise UsageError(f"config file {os.fspath(filename)} is a directory; pass one of its .py or .yaml "
                             f"config files")
        if not path.is_file():
            raise FileNotFoundError(errno.ENOENT, f"Config file not found (cwd: {os.getcwd()})", os.fspath(filename))
        path = path.resolve()

        if path.suffix == ".py":
            namespace, roots, dialect = exec_config(path)
            if dialect is not None:
                namespace = {k: v if k.startswith("_") else cast_to_config(v) for k, v in namespace.items()}
                dialect.translate(namespace)
            if keys is None:
                cfg = {
                    k: cast_to_config(v)
                    for k, v in namespace.items()
                    if not k.startswith("_")
                    and (isinstance(v, (DictConfig, ListConfig, dict, list, tuple)) or type(v) in _SCALARS)
                }
                if roots:
                    cfg[IMPORT_ROOTS_KEY] = [str(r) for r in roots]
                return DictConfig(cfg, flags={"allow_objects": True})
        elif path.suffix in (".yaml", ".yml"):
            try:
                namespace = OmegaConf.create(path.read_text(encoding="utf-8"), flags={"allow_objects": True})
            except Exception as e:
                raise ConfigLoadError(f"Failed to load config file {path}: {type(e).__name__}: {one_line(e)}") from e
            if not isinstance(namespace, DictConfig):
                kind = "list" if isinstance(namespace, ListConfig) else type(namespace).__name__
                raise ConfigLoadError(f"Config file {path} holds a {kind} at its top level, not a mapping of names to "
                                      f"sections (model:, train:, ...) as the config.yaml a run writes does; give a "
                                      f".py config or a run's config.yaml")
            restore_import_roots(namespace.get(IMPORT_ROOTS_KEY), path)
            if keys is None:
                return namespace
        else:
            raise ConfigLoadError(f"Unsupported config file {path}: expected a .py or .yaml file")

        def pick(name: str) -> Any:
            if name not in namespace:
                raise ConfigKeyError(f"Config file {path} defines no top-level name '{name}'")
            return cast_to_config(namespace[name])

        return pick(keys) if isinstance(keys, str) else tuple(pick(k) for k in keys)

    @staticmethod
    def save(cfg: Any, filename: Union[str, os.PathLike], header: str = "") -> None:
        """Write ``cfg`` as YAML that :meth:`load` reads back to an equal config, ``header``'s lines first as
        YAML comments.

        Callable ``_target_`` values become dotted import paths; interpolations stay unresolved. Values
        YAML cannot hold become placeholders, with a warning and a cloudpickle copy in ``<filename>.pkl``.
        """
        filename = os.fspath(filename)
        data = cfg
        if OmegaConf.is_config(cfg):
            data = OmegaConf.to_container(cfg, resolve=False, structured_config_mode=SCMode.DICT)
        problems: List[str] = []
        data = _yaml_ready(data, "", problems)
        text = yaml.safe_dump(data, default_flow_style=None, allow_unicode=True, sort_keys=False, width=9999)
        text = "".join(f"# {line}\n" for line in header.splitlines()) + text

        os.makedirs(os.path.dirname(os.path.abspath(filename)), exist_ok=True)
        # A crash or a full disk mid-save never leaves a truncated config.yaml or a temporary.
        atomic_write(filename, lambda f: f.write(text), mode="w", fsync=False)
        if not problems:
            return
        logger.warning("Config keys %s cannot be written as YAML; %s holds placeholders for them.",
                       ", ".join(problems), filename)
        try:
            import cloudpickle

            with open(filename + ".pkl", "wb") as f:
                cloudpickle.dump(cfg, f)
            logger.warning("Full config saved with cloudpickle at %s.pkl.", filename)
        except ImportError:
            logger.warning("Install cloudpickle to also save the full config as %s.pkl.", filename)
        except Exception as e:
            logger.warning("Could not pickle the config to %s.pkl: %s", filename, one_line(e))


def try_get_key(cfg: Any, *keys: str, default: Any = None) -> Any:
    """Value of the first dotted key path in ``keys`` that exists in ``cfg``, else ``default``."""
    if not OmegaConf.is_config(cfg):
        cfg = OmegaConf.create(cfg, flags={"allow_objects": True})
    missing = object()
    for key in keys:
        value = OmegaConf.select(cfg, key, default=missing)
        if value is not missing:
            return value
    return default
