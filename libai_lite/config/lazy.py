"""Lazy Python configs in the detectron2 ``config/lazy.py`` style.

A config is a Python file whose top-level names (``model``, ``train``, ``optim``,
``dataloader``, ...) are omegaconf nodes built with :class:`LazyCall`. Config files
import each other, relatively or as ``configs.*`` / ``projects.<X>.configs.*``;
every such import is executed afresh for each :meth:`LazyConfig.load`, so one
config mutating a shared ``train`` can never change what another load sees.

Where imports written in a config go:

* ``configs.*`` and ``projects.*`` resolve in the user's own tree first (the folder
  holding the config's ``configs/`` or ``projects/``, found from the config's path,
  ``__init__.py`` files or not), then in the installed packages.
* Code a config reaches (a relative import out of its ``configs/`` folder, such as
  ``from ..modeling.gpt_model import GPT``, or ``projects.MyProj.modeling``) is
  imported once as a real module under a stable name: ``MyLM.modeling.gpt_model``
  for a project folder copied to ``/elsewhere/MyLM``, ``projects.MyProj.modeling...``
  in a LiBai-style tree. The folders it came from are listed under
  ``_import_roots_`` in the loaded config, so a saved ``config.yaml`` builds the
  same classes in a fresh process started from any directory.
"""
import builtins
import contextlib
import dataclasses
import difflib
import errno
import importlib
import importlib.util
import logging
import os
import sys
import types
import uuid
from collections import abc
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

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
    "IMPORT_ROOTS_KEY",
    "add_import_root",
    "try_get_key",
]

logger = logging.getLogger(__name__)

# Config modules get a made-up package under this prefix; the import hook uses it to
# recognise "a relative import written inside a config file".
_CFG_PACKAGE_NAME = "libai_lite._cfg_loader"
# The package names a LiBai tree's absolute imports use; a user's tree serves them before
# the installed packages do.
_TREE_PACKAGES = ("configs", "projects")
# Top-level key of a loaded (and saved) config: the folders its model code imports from,
# which a later load of the saved YAML, in any process and cwd, puts back on the import path.
IMPORT_ROOTS_KEY = "_import_roots_"


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


def _is_config_target(target: Path, importer: Path) -> bool:
    """Whether a relative import in config ``importer`` reaches another config (else: model code).

    Configs live in ``configs/`` folders; what a config in one reaches outside any
    ``configs/`` folder (``from ..modeling.gpt_model import GPT``) is code.
    """
    home = next((p for p in importer.parents if p.name == "configs"), None)
    if home is None or target == home or home in target.parents:
        return True
    shared = len(Path(os.path.commonpath([target, importer])).parts)
    return "configs" in target.parts[shared:]


def _tree_root(config_file: Path) -> Optional[Path]:
    """The folder whose ``configs/`` and ``projects/`` this config's absolute imports mean.

    That is the LiBai repository root: the nearest ancestor holding a ``configs/`` or
    ``projects/`` folder that is neither a package, nor itself one of those folders,
    nor a project folder inside ``projects/``.
    """
    for directory in config_file.parents:
        if (
            (directory / "__init__.py").exists()
            or directory.name in _TREE_PACKAGES
            or directory.parent.name == "projects"
        ):
            continue
        if any((directory / top).is_dir() for top in _TREE_PACKAGES):
            return directory
    return None


_INSTALLED_DIRS: Dict[str, List[Path]] = {}
# Folders this process put on sys.path for user trees; never searched as "installed".
_ADDED_ROOTS: set = set()


def _installed_dirs(top: str) -> List[Path]:
    """Folders of the installed ``configs`` or ``projects`` package, before any user tree joined it."""
    if top not in _INSTALLED_DIRS:
        module = sys.modules.get(top)
        spec = module.__spec__ if module is not None else importlib.util.find_spec(top)
        locations = (spec.submodule_search_locations if spec is not None else None) or []
        _INSTALLED_DIRS[top] = [Path(p).resolve() for p in locations]
    return _INSTALLED_DIRS[top]


def _is_installed_root(root: Path) -> bool:
    return any(root / top in _installed_dirs(top) for top in _TREE_PACKAGES)


def add_import_root(root: Union[str, os.PathLike]) -> None:
    """Make the packages under folder ``root`` importable, as config loads and saved configs need.

    ``root`` goes at the end of ``sys.path`` (it never shadows an installed package); its
    ``configs/`` and ``projects/`` folders join the installed ``configs`` and ``projects``
    packages, ahead of them, so ``projects.MyProj.modeling`` in a user's LiBai-style tree
    imports while ``projects.GPT`` still does.
    """
    root = Path(root).resolve()
    if _is_installed_root(root):
        return
    for top in _TREE_PACKAGES:
        folder = str(root / top)
        if not (root / top).is_dir() or not _installed_dirs(top):
            continue
        # Imported before root joins sys.path, so the installed package is the one pinned.
        search = importlib.import_module(top).__path__
        if folder in search:
            continue
        if isinstance(search, list):
            search.insert(0, folder)
        else:  # a namespace package's path only appends
            search.append(folder)
    if str(root) not in sys.path:
        sys.path.append(str(root))
        _ADDED_ROOTS.add(str(root))


def _code_module_name(target: Path, importer: Path) -> Tuple[Path, str]:
    """(folder to import from, dotted module name) of code a config reaches by a relative import.

    Inside packages (``__init__.py`` files) the name is the one Python gives it from the
    top package's parent. In a folder without ``__init__.py`` it is named from the parent
    of the project folder that holds the config's ``configs/``, or from the tree root when
    that project sits in ``projects/`` (``projects.MyProj.modeling.model``).
    """
    top = None
    directory = target if target.is_dir() else target.parent
    while (directory / "__init__.py").exists():
        top, directory = directory, directory.parent
    if top is not None:
        root = top.parent
    else:
        project = next(p for p in importer.parents if p.name == "configs").parent
        root = project.parent.parent if project.parent.name == "projects" else project.parent
    try:
        parts = target.relative_to(root).parts
    except ValueError:
        raise ImportError(f"Cannot import {target} from {importer}: it is outside {root}, the folder it would import from")
    if not all(part.isidentifier() for part in parts):
        raise ImportError(
            f"Cannot import {target} from {importer} as module {'.'.join(parts)!r}: rename its folders "
            "to Python identifiers (letters, digits, underscores)"
        )
    return root, ".".join(parts)


def _check_origin(name: str, base: Path, importer: Path) -> None:
    """ImportError unless module ``name`` was imported from ``base`` (a path without ``.py``)."""
    module = sys.modules.get(name)
    origin = getattr(module, "__file__", None)
    if origin is not None:
        found = Path(origin).resolve()
        if found in (base.with_name(base.name + ".py"), base / "__init__.py"):
            return
    elif any(Path(p).resolve() == base for p in getattr(module, "__path__", ())):
        return
    else:
        found = list(getattr(module, "__path__", ()))
    raise ImportError(
        f"{importer} imports {base} as module {name!r}, but {name!r} is already imported from {found}; "
        "give the folder a name no other package uses"
    )


class _FreshLoader:
    """Executes config files as throw-away modules and serves the imports they write."""

    def __init__(self, config_file: Path):
        self.tree_root = _tree_root(config_file)
        self.roots: List[Path] = []
        self.executed_files: set = set()
        if self.tree_root is not None:
            self.add_root(self.tree_root)

    def add_root(self, root: Path) -> None:
        add_import_root(root)
        if not _is_installed_root(root) and root not in self.roots:
            self.roots.append(root)

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
        # The user's tree first, then the installed package, then sys.path as Python would.
        parts = name.split(".")
        search = [self.tree_root.joinpath(*parts)] if self.tree_root is not None else []
        search += [d.joinpath(*parts[1:]) for d in _installed_dirs(parts[0])]
        search += [
            Path(p or os.getcwd()).joinpath(*parts)
            for p in sys.path
            if isinstance(p, str) and p not in _ADDED_ROOTS
        ]
        for base in search:
            if base.with_name(base.name + ".py").is_file() or base.is_dir():
                return base
        return None

    def import_target(self, base: Path, fromlist: Sequence[str], what: str, importer: Optional[str]):
        """Config module for ``base`` (a path without ``.py``), or None to fall back to normal import."""
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

    def import_code(self, root: Path, name: str, base: Path, importer: Path, fromlist, original_import):
        """Import ``name`` (the code at ``base``) as a real module, once per process, from ``root``."""
        self.add_root(root)
        module = original_import(name, None, None, fromlist, 0)
        _check_origin(name, base, importer)
        return module

    def hook(self, original_import):
        def new_import(name, globals=None, locals=None, fromlist=(), level=0):
            package = (globals or {}).get("__package__") or ""
            if not package.startswith(_CFG_PACKAGE_NAME):
                # Model code imported by a config imports as Python always does.
                return original_import(name, globals, locals, fromlist, level)
            importer = Path(globals["__file__"])
            if level:
                base = importer.parent
                for _ in range(level - 1):
                    base = base.parent
                if name:
                    base = base.joinpath(*name.split("."))
                what = "." * level + name
                exists = base.with_name(base.name + ".py").is_file() or base.is_dir()
                if exists and not _is_config_target(base, importer):
                    root, module_name = _code_module_name(base, importer)
                    return self.import_code(root, module_name, base, importer, fromlist, original_import)
                return self.import_target(base, fromlist, what, str(importer))
            if name.partition(".")[0] in _TREE_PACKAGES:
                base = self._find_absolute(name)
                if base is not None and _is_config_module_name(name):
                    module = self.import_target(base, fromlist, name, None)
                    if module is not None:
                        return module if fromlist else _module_chain(name, module)
                elif base is not None and self.tree_root is not None and self.tree_root in base.parents:
                    return self.import_code(self.tree_root, name, base, importer, fromlist, original_import)
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
        if not prefix and key == IMPORT_ROOTS_KEY:
            continue  # the loader's bookkeeping, never a key a user meant
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


def _restore_import_roots(roots: Any, path: Path) -> None:
    """Put a saved config's import folders back, so its ``_target_`` strings import."""
    if roots is None:
        return
    if not isinstance(roots, ListConfig) or not all(isinstance(r, str) for r in roots):
        raise ConfigLoadError(
            f"Config file {path}: '{IMPORT_ROOTS_KEY}' must be a list of folder paths, got {_one_line(roots)}; "
            "fix or delete that key"
        )
    for root in roots:
        if Path(root).is_dir():
            add_import_root(root)
        else:
            logger.warning(
                "Config file %s imports model code from %s, which does not exist; its targets will not import "
                "until that folder is restored (or %s is edited).", path, root, IMPORT_ROOTS_KEY,
            )


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
        and other objects are left out), plus ``_import_roots_`` when the config's
        code came from folders outside the installed packages. With ``keys`` (a name
        or a sequence of names), returns that value or a tuple of them. Loading a
        ``.yaml`` puts its ``_import_roots_`` folders back on the import path.
        """
        path = Path(os.fspath(filename)).expanduser()
        if not path.is_file():
            raise FileNotFoundError(errno.ENOENT, f"Config file not found (cwd: {os.getcwd()})", os.fspath(filename))
        path = path.resolve()

        if path.suffix == ".py":
            namespace, roots = LazyConfig._exec_config(path)
            if keys is None:
                cfg = {k: _cast_to_config(v) for k, v in namespace.items() if _is_config_value(k, v)}
                if roots:
                    cfg[IMPORT_ROOTS_KEY] = [str(r) for r in roots]
                return DictConfig(cfg, flags={"allow_objects": True})
        elif path.suffix in (".yaml", ".yml"):
            try:
                data = yaml.safe_load(path.read_text(encoding="utf-8"))
                namespace = OmegaConf.create(data if data is not None else {}, flags={"allow_objects": True})
            except Exception as e:
                raise ConfigLoadError(
                    f"Failed to load config file {path}: {type(e).__name__}: {_one_line(e)}"
                ) from e
            _restore_import_roots(namespace.get(IMPORT_ROOTS_KEY), path)
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
    def _exec_config(path: Path) -> Tuple[dict, List[Path]]:
        """The config's namespace and the folders its code was imported from."""
        loader = _FreshLoader(path)
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
        return dict(module.__dict__), loader.roots

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
