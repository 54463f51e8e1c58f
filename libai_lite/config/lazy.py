"""Lazy Python configs in the detectron2 ``config/lazy.py`` style.

A config is a Python file whose top-level names (``model``, ``train``, ``optim``,
``dataloader``, ...) are omegaconf nodes built with :class:`LazyCall`. Config files
import each other, relatively or as ``configs.*`` / ``projects.<X>.configs.*``;
every such import is executed afresh for each :meth:`LazyConfig.load`, so one
config mutating a shared ``train`` can never change what another load sees.
"""
import builtins
import contextlib
import dataclasses
import difflib
import errno
import logging
import os
import sys
import types
import uuid
from collections import abc
from pathlib import Path
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf, SCMode

from ..utils.errors import UsageError
from .instantiate import locate, target_to_string

__all__ = [
    "LazyCall",
    "LazyConfig",
    "ConfigKeyError",
    "ConfigTypeError",
    "ConfigLoadError",
    "try_get_key",
]

logger = logging.getLogger(__name__)

# Config modules get a made-up package under this prefix; the import hook uses it to
# recognise "a relative import written inside a config file".
_CFG_PACKAGE_NAME = "libai_lite._cfg_loader"


class ConfigKeyError(KeyError, UsageError):
    """A config key path that does not exist (or already exists, for ``+key=``)."""

    def __str__(self) -> str:
        # KeyError's str() is the repr of its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class ConfigTypeError(UsageError):
    """An override whose value has the wrong type for the key it replaces."""


class ConfigLoadError(UsageError):
    """A config file that exists but fails to execute or parse."""


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


# --------------------------------------------------------------------------- LazyCall


class LazyCall:
    """Record a call for later: ``LazyCall(f)(x=1)`` is a ``DictConfig`` ``{_target_: f, x: 1}``.

    ``target`` is a callable or a dotted import path string. The callable is kept
    as is (so classes defined in scripts and tests work); :meth:`LazyConfig.save`
    writes it as its dotted import path.
    """

    def __init__(self, target: Any):
        if not (callable(target) or isinstance(target, str)):
            raise TypeError(f"LazyCall target must be a callable or a dotted import path, got {target!r}")
        self._target = target

    def __call__(self, **kwargs: Any) -> DictConfig:
        if "_target_" in kwargs:
            raise TypeError("LazyCall(...)(...) got '_target_' as a keyword; pass the target to LazyCall")
        target = self._target
        if dataclasses.is_dataclass(target):
            # omegaconf cannot store a dataclass type as a value.
            target = target_to_string(target)
        return DictConfig(content={"_target_": target, **kwargs}, flags={"allow_objects": True})


# ------------------------------------------------------------------- fresh loading


def _cast_to_config(obj: Any) -> Any:
    if isinstance(obj, dict):
        return DictConfig(obj, flags={"allow_objects": True})
    if isinstance(obj, list):
        return ListConfig(obj, flags={"allow_objects": True})
    return obj


def _is_config_module_name(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "configs" or (len(parts) >= 3 and parts[0] == "projects" and parts[2] == "configs")


def _package_repo_root() -> Optional[Path]:
    import libai_lite

    root = Path(libai_lite.__file__).resolve().parents[1]
    return root if (root / "configs").is_dir() else None


def _import_roots(config_file: Path) -> List[Path]:
    """Directories from which ``configs.*`` / ``projects.*`` imports of this file resolve."""
    roots: List[Path] = []
    nearest = None
    for directory in [config_file.parent, *config_file.parent.parents]:
        if (directory / "configs").is_dir():
            nearest = nearest or directory
            # projects/GPT also holds a configs/ folder, but it is a package
            # (projects.GPT); the import root is the first non-package ancestor.
            if not (directory / "__init__.py").exists():
                roots.append(directory)
                break
    if not roots and nearest is not None:
        roots.append(nearest)
    package_root = _package_repo_root()
    if package_root is not None and package_root not in roots:
        roots.append(package_root)
    return roots


class _FreshLoader:
    """Executes config files as throw-away modules and serves their imports."""

    def __init__(self, roots: Sequence[Path]):
        self.roots = list(roots)
        self.executed_files: set = set()

    def exec_file(self, path: Path) -> types.ModuleType:
        package = f"{_CFG_PACKAGE_NAME}{uuid.uuid4().hex[:8]}"
        module = types.ModuleType(f"{package}.{path.stem}")
        module.__file__ = str(path)
        module.__package__ = package
        source = path.read_text(encoding="utf-8")
        self.executed_files.add(str(path))
        # Compiling with the real path puts it in tracebacks and error locations.
        exec(compile(source, str(path), "exec", dont_inherit=True), module.__dict__)
        # Whichever import form reaches it (``from x import train``, ``import x``),
        # a config's dicts arrive as DictConfig, so ``train.train_iter = 5`` works.
        for name, value in list(module.__dict__.items()):
            if not name.startswith("_"):
                setattr(module, name, _cast_to_config(value))
        return module

    def _find_absolute(self, name: str) -> Optional[Path]:
        parts = name.split(".")
        search = [*self.roots, *(Path(p or os.getcwd()) for p in sys.path if isinstance(p, str))]
        for root in search:
            base = root.joinpath(*parts)
            if base.with_name(base.name + ".py").is_file() or base.is_dir():
                return base
        return None

    def import_target(self, base: Path, fromlist: Sequence[str], what: str, importer: Optional[str]):
        """Module for ``base`` (a path without ``.py``), or None to fall back to normal import."""
        py_file = base.with_name(base.name + ".py")
        if py_file.is_file():
            return self.exec_file(py_file)
        if base.is_dir():
            names = [n for n in (fromlist or ()) if n != "*"]
            if names and all(base.joinpath(n + ".py").is_file() for n in names):
                # ``from configs.common import train`` -> a fresh module per name.
                package = types.ModuleType(what)
                package.__file__ = str(base / "__init__.py")
                for n in names:
                    setattr(package, n, self.exec_file(base / (n + ".py")))
                return package
            if importer is None:
                return None
            raise ImportError(
                f"Cannot import {what!r} in {importer}: {base} is a directory; a config file can "
                "only import names from other config files (e.g. 'from .common.train import train')"
            )
        raise ImportError(f"Cannot import {what!r} in {importer}: {py_file} does not exist")

    def hook(self, original_import):
        def new_import(name, globals=None, locals=None, fromlist=(), level=0):
            package = (globals or {}).get("__package__") or ""
            if level and package.startswith(_CFG_PACKAGE_NAME):
                importer = globals["__file__"]
                base = Path(importer).parent
                for _ in range(level - 1):
                    base = base.parent
                if name:
                    base = base.joinpath(*name.split("."))
                return self.import_target(base, fromlist, "." * level + name, importer)
            if level == 0 and _is_config_module_name(name):
                base = self._find_absolute(name)
                if base is not None:
                    module = self.import_target(base, fromlist, name, None)
                    if module is not None:
                        return module if fromlist else _module_chain(name, module)
            return original_import(name, globals, locals, fromlist, level)

        return new_import


def _module_chain(name: str, leaf: types.ModuleType) -> types.ModuleType:
    # ``import configs.common.train`` binds the top package and reaches the leaf by
    # attribute; build stand-in parents so that works without touching sys.modules.
    parts = name.split(".")
    node = leaf
    for i in range(len(parts) - 1, 0, -1):
        parent = types.ModuleType(".".join(parts[:i]))
        setattr(parent, parts[i], node)
        node = parent
    return node


@contextlib.contextmanager
def _patch_import(loader: _FreshLoader) -> Iterator[None]:
    original = builtins.__import__
    builtins.__import__ = loader.hook(original)
    try:
        yield
    finally:
        builtins.__import__ = original


def _error_location(exc: BaseException, config_files: Iterable[str]) -> Optional[str]:
    files = set(config_files)
    if isinstance(exc, SyntaxError) and exc.filename in files:
        return f"{exc.filename}, line {exc.lineno}"
    location = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename in files:
            location = f"{tb.tb_frame.f_code.co_filename}, line {tb.tb_lineno}"
        tb = tb.tb_next
    return location


_CONFIG_SCALARS = (str, int, float, bool, type(None))


def _is_config_value(name: str, value: Any) -> bool:
    if name.startswith("_"):
        return False
    return isinstance(value, (DictConfig, ListConfig, dict, list, tuple)) or type(value) in _CONFIG_SCALARS


# --------------------------------------------------------------------- overrides


def _child_node(node: Any, part: str) -> Any:
    if isinstance(node, DictConfig):
        return node._get_node(part, throw_on_missing_key=False) if part in node.keys() else None
    if isinstance(node, ListConfig):
        try:
            index = int(part)
        except ValueError:
            return None
        return node._get_node(index) if -len(node) <= index < len(node) else None
    return None


def _is_live_container(node: Any) -> bool:
    return (
        isinstance(node, (DictConfig, ListConfig))
        and not node._is_none()
        and not node._is_missing()
        and not node._is_interpolation()
    )


def _find_node(cfg: Any, key: str) -> Tuple[bool, Any]:
    """(exists, node) for a dotted key, without resolving interpolations."""
    parts = key.split(".")
    node = cfg
    for depth, part in enumerate(parts):
        if depth and not _is_live_container(node):
            prefix = ".".join(parts[:depth])
            value = node._value() if hasattr(node, "_value") else node
            raise ConfigKeyError(
                f"Cannot reach config key {key!r}: {prefix!r} holds {type(value).__name__} {value!r}, not a config node"
            )
        node = _child_node(node, part)
        if node is None:
            return False, None
    return True, node


def _all_key_paths(node: Any, prefix: str = "") -> Iterator[str]:
    if not isinstance(node, DictConfig):
        return
    for key in node.keys():
        path = f"{prefix}.{key}" if prefix else str(key)
        yield path
        child = node._get_node(key)
        if _is_live_container(child):
            yield from _all_key_paths(child, path)


def _suggest(cfg: Any, key: str, limit: int = 3) -> List[str]:
    paths = list(_all_key_paths(cfg))
    # A key typed without its prefix (``train_iter`` for ``train.train_iter``) is
    # the commonest slip; difflib on whole paths ranks those too low on deep configs.
    same_leaf = [p for p in paths if p.endswith("." + key) or p.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
    close = difflib.get_close_matches(key, paths, n=limit, cutoff=0.6)
    suggestions: List[str] = []
    for p in [*close, *same_leaf]:
        if p not in suggestions and p != key:
            suggestions.append(p)
    return suggestions[:limit]


def _unknown_key_error(cfg: Any, key: str) -> ConfigKeyError:
    suggestions = _suggest(cfg, key)
    if suggestions:
        quoted = [f"'{s}'" for s in suggestions]
        options = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
        hint = f"; did you mean {options}?"
    else:
        hint = "."
    return ConfigKeyError(f"Unknown config key '{key}'{hint} Use +{key}=... to add a new key.")


def _parse_number(text: str) -> Optional[Union[int, float]]:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return None


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _checked_value(key: str, node: Any, new: Any) -> Any:
    """``new`` as it should be stored at ``key``; ConfigTypeError if it cannot hold there."""
    if _is_live_container(node) or new is None or _is_interpolation(new):
        return new
    if isinstance(node, (DictConfig, ListConfig)) or node._is_interpolation() or node._is_missing():
        return new
    old = node._value()
    if old is None:
        return new

    def wrong(expected: str) -> ConfigTypeError:
        return ConfigTypeError(
            f"Cannot override config key '{key}' ({type(old).__name__}, currently {old!r}) with "
            f"{new!r} ({type(new).__name__}); expected {expected}, or null to clear it."
        )

    if isinstance(old, bool):
        if isinstance(new, bool):
            return new
        if isinstance(new, str) and new.strip().lower() in ("true", "false"):
            return new.strip().lower() == "true"
        raise wrong("true or false")
    if isinstance(old, (int, float)):
        if isinstance(new, str):
            number = _parse_number(new.strip())
            if number is None:
                raise wrong("a number")
            new = number
        if isinstance(new, bool) or not isinstance(new, (int, float)):
            raise wrong("a number")
        # Keep a float key a float (``optim.lr=1``); an int key may become a float.
        return float(new) if isinstance(old, float) else new
    return new


def _set(cfg: Any, key: str, value: Any, force_add: bool) -> None:
    OmegaConf.update(cfg, key, value, merge=True, force_add=force_add)


def _delete(cfg: Any, key: str) -> None:
    parent_key, _, last = key.rpartition(".")
    parent = _find_node(cfg, parent_key)[1] if parent_key else cfg
    if isinstance(parent, ListConfig):
        del parent[int(last)]
    else:
        del parent[last]


# ------------------------------------------------------------------------- YAML


def _yaml_ready(obj: Any, path: str, problems: List[str]) -> Any:
    """A plain-YAML copy of ``obj``; unserialisable leaves become placeholders listed in ``problems``."""
    if type(obj) in _CONFIG_SCALARS:
        return obj
    if isinstance(obj, abc.Mapping):
        out = {}
        for key, value in obj.items():
            child = f"{path}.{key}" if path else str(key)
            if type(key) not in _CONFIG_SCALARS:
                problems.append(child)
                key = str(key)
            if key == "_target_" and callable(value):
                out[key] = _target_string(value, child, problems)
            else:
                out[key] = _yaml_ready(value, child, problems)
        return out
    if isinstance(obj, (list, tuple)):
        return [_yaml_ready(v, f"{path}.{i}" if path else str(i), problems) for i, v in enumerate(obj)]
    problems.append(path)
    return f"<unserializable {type(obj).__name__}: {_one_line(repr(obj))[:200]}>"


def _target_string(target: Any, path: str, problems: List[str]) -> str:
    try:
        name = target_to_string(target)
    except AttributeError:
        problems.append(path)
        return f"<unserializable {type(target).__name__}: {_one_line(repr(target))[:200]}>"
    try:
        importable = locate(name) is target
    except Exception:
        importable = False
    if not importable:
        # Classes defined in __main__ or inside functions: readable in YAML, but only
        # the pickle can bring them back.
        problems.append(path)
    return name


# ---------------------------------------------------------------------- LazyConfig


class LazyConfig:
    """Load, save and override lazy configs (``.py`` files or saved ``.yaml``)."""

    @staticmethod
    def load(filename: Union[str, os.PathLike], keys: Union[None, str, Sequence[str]] = None):
        """Execute a ``.py`` config (or read a ``.yaml``) and return its top-level configs.

        Without ``keys``, returns a ``DictConfig`` of the public top-level names whose
        values are configs, containers or plain scalars (modules, functions, classes
        and other objects are left out). With ``keys`` (a name or a sequence of
        names), returns that value or a tuple of them.
        """
        path = Path(os.fspath(filename)).expanduser()
        if not path.is_file():
            raise FileNotFoundError(errno.ENOENT, f"Config file not found (cwd: {os.getcwd()})", os.fspath(filename))
        path = path.resolve()

        if path.suffix == ".py":
            namespace = LazyConfig._exec_config(path)
            if keys is None:
                return DictConfig(
                    {k: _cast_to_config(v) for k, v in namespace.items() if _is_config_value(k, v)},
                    flags={"allow_objects": True},
                )
        elif path.suffix in (".yaml", ".yml"):
            try:
                data = yaml.safe_load(path.read_text(encoding="utf-8"))
                namespace = OmegaConf.create(data if data is not None else {}, flags={"allow_objects": True})
            except Exception as e:
                raise ConfigLoadError(
                    f"Failed to load config file {path}: {type(e).__name__}: {_one_line(e)}"
                ) from e
            if keys is None:
                return namespace
        else:
            raise ConfigLoadError(f"Unsupported config file {path}: expected a .py or .yaml file")

        def pick(name: str) -> Any:
            if name not in namespace:
                raise ConfigKeyError(f"Config file {path} defines no top-level name '{name}'")
            return _cast_to_config(namespace[name])

        if isinstance(keys, str):
            return pick(keys)
        return tuple(pick(k) for k in keys)

    @staticmethod
    def _exec_config(path: Path) -> dict:
        roots = _import_roots(path)
        for root in roots:
            # Code the configs reference (``projects.GPT.modeling``) must import from
            # any cwd. Appended, not prepended, so installed packages are not shadowed.
            if str(root) not in sys.path:
                sys.path.append(str(root))
        loader = _FreshLoader(roots)
        try:
            with _patch_import(loader):
                module = loader.exec_file(path)
        except Exception as e:
            where = _error_location(e, loader.executed_files)
            at = f" (at {where})" if where else ""
            message = e.msg if isinstance(e, SyntaxError) else e
            raise ConfigLoadError(
                f"Failed to load config file {path}: {type(e).__name__}: {_one_line(message)}{at}"
            ) from e
        return dict(module.__dict__)

    @staticmethod
    def save(cfg: Any, filename: Union[str, os.PathLike]) -> None:
        """Write ``cfg`` as YAML that :meth:`load` reads back to an equal config.

        Callable ``_target_`` values are written as dotted import paths and
        interpolations stay unresolved. Values YAML cannot hold are written as
        placeholders with a warning, and the whole config is also pickled to
        ``<filename>.pkl`` when cloudpickle is installed.
        """
        filename = os.fspath(filename)
        if OmegaConf.is_config(cfg):
            data = OmegaConf.to_container(cfg, resolve=False, structured_config_mode=SCMode.DICT)
        else:
            data = cfg
        problems: List[str] = []
        data = _yaml_ready(data, "", problems)
        text = yaml.safe_dump(data, default_flow_style=None, allow_unicode=True, sort_keys=False, width=9999)

        directory = os.path.dirname(os.path.abspath(filename))
        os.makedirs(directory, exist_ok=True)
        # Write-then-rename: a crash mid-save never leaves a truncated config.yaml.
        tmp = f"{filename}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, filename)

        if not problems:
            return
        logger.warning(
            "Config keys %s cannot be written as YAML; %s holds placeholders for them.",
            ", ".join(problems),
            filename,
        )
        try:
            import cloudpickle
        except ImportError:
            logger.warning("Install cloudpickle to also save the full config as %s.pkl.", filename)
            return
        try:
            with open(filename + ".pkl", "wb") as f:
                cloudpickle.dump(cfg, f)
            logger.warning("Full config saved with cloudpickle at %s.pkl.", filename)
        except Exception as e:
            logger.warning("Could not pickle the config to %s.pkl: %s", filename, _one_line(e))

    @staticmethod
    def apply_overrides(cfg: Any, overrides: Optional[Sequence[str]]) -> Any:
        """Apply command-line overrides in Hydra's grammar to ``cfg`` in place and return it.

        ``key=value`` replaces an existing key (``ConfigKeyError`` with suggestions
        if it does not exist; ``ConfigTypeError`` if a number/bool key gets a value
        of another kind), ``+key=value`` adds a new key, ``++key=value`` sets it
        either way, ``~key`` deletes it.
        """
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.errors import HydraException

        parser = OverridesParser.create()
        for text in overrides or ():
            try:
                override = parser.parse_override(text)
            except HydraException as e:
                raise ConfigTypeError(f"Cannot parse override {text!r}: {_one_line(e)}") from e
            key = override.key_or_group
            if override.package is not None:
                raise ConfigTypeError(f"Override {text!r}: '@package' is not supported in lazy configs")
            if override.is_sweep_override():
                raise ConfigTypeError(f"Override {text!r} is a sweep; give a single value (quote it to pass a string)")
            value = override.value()

            exists, node = _find_node(cfg, key)
            if override.is_delete():
                if not exists:
                    raise _unknown_key_error(cfg, key)
                _delete(cfg, key)
            elif override.is_add():
                if exists:
                    raise ConfigKeyError(
                        f"Cannot add config key '{key}': it already exists. "
                        f"Use {key}=... to override it (or ++{key}=... to set it either way)."
                    )
                _set(cfg, key, value, force_add=True)
            elif override.is_force_add():
                _set(cfg, key, _checked_value(key, node, value) if exists else value, force_add=True)
            else:
                if not exists:
                    raise _unknown_key_error(cfg, key)
                _set(cfg, key, _checked_value(key, node, value), force_add=False)
        return cfg


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
