"""Execute lazy config files afresh and resolve the imports written in them.

Configs a config imports (relatively, or as ``configs.*`` / ``projects.<X>.configs.*``) run afresh for
each load, so one config mutating a shared ``train`` never changes another load; those packages resolve
in the user's own tree before the installed ones. Code a config reaches is imported once under a stable
name (``MyLM.modeling.gpt_model`` for a project at ``/elsewhere/MyLM``), and its folder is listed under
``_import_roots_`` so a saved ``config.yaml`` rebuilds the same classes anywhere. Imports of a config
written for another framework are answered by the installed ``dialects``.
"""
import builtins
import functools
import importlib
import importlib.util
import logging
import os
import sys
import traceback
import types
import uuid
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

from omegaconf import DictConfig, ListConfig

from ..utils.errors import UsageError
from .dialects import DIALECTS_GROUP, ConfigDialect, new_dialects

__all__ = ["ConfigLoadError", "IMPORT_ROOTS_KEY", "add_import_root", "exec_config", "restore_import_roots"]

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
# Folders this process put on sys.path for user trees; never searched as "installed".
_ADDED_ROOTS: set = set()


class ConfigLoadError(UsageError):
    """A config file that exists but fails to execute or parse."""


def one_line(text: Any) -> str:
    return " ".join(str(text).split())


def cast_to_config(obj: Any) -> Any:
    """``dict``/``list`` as an omegaconf node that may hold any object; anything else as is."""
    if isinstance(obj, (dict, list)):
        return (DictConfig if isinstance(obj, dict) else ListConfig)(obj, flags={"allow_objects": True})
    return obj


def _py_file(base: Path) -> Path:
    return base.with_name(base.name + ".py")


def _is_config_target(target: Path, importer: Path) -> bool:
    """Whether a relative import in config ``importer`` reaches another config, not code outside ``configs/``."""
    home = next((p for p in importer.parents if p.name == "configs"), None)
    if home is None or target == home or home in target.parents:
        return True
    shared = len(Path(os.path.commonpath([target, importer])).parts)
    return "configs" in target.parts[shared:]


def _tree_root(config_file: Path) -> Optional[Path]:
    """The LiBai tree root whose ``configs/`` and ``projects/`` this config's absolute imports mean.

    That is the nearest ancestor holding one of them that is neither a package, nor one of those
    folders, nor a project folder inside ``projects/``.
    """
    for directory in config_file.parents:
        if (directory / "__init__.py").exists() or directory.name in _TREE_PACKAGES:
            continue
        if directory.parent.name != "projects" and any((directory / top).is_dir() for top in _TREE_PACKAGES):
            return directory
    return None


@functools.lru_cache(maxsize=None)
def _installed_dirs(top: str) -> Tuple[Path, ...]:
    """Folders of the installed ``configs`` or ``projects`` package, before any user tree joined it."""
    module = sys.modules.get(top)
    spec = module.__spec__ if module is not None else importlib.util.find_spec(top)
    return tuple(Path(p).resolve() for p in (spec.submodule_search_locations if spec else None) or ())


def _is_installed_root(root: Path) -> bool:
    return any(root / top in _installed_dirs(top) for top in _TREE_PACKAGES)


def add_import_root(root: Union[str, os.PathLike]) -> None:
    """Make the packages under folder ``root`` importable, as config loads and saved configs need.

    ``root`` goes at the end of ``sys.path`` (it never shadows an installed package); its ``configs/``
    and ``projects/`` join the installed packages of those names ahead of them, so a user's
    ``projects.MyProj.modeling`` imports while ``projects.GPT`` still does.
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


def restore_import_roots(roots: Any, path: Path) -> None:
    """Put a saved config's import folders back, so its ``_target_`` strings import."""
    if roots is None:
        return
    if not isinstance(roots, ListConfig) or not all(isinstance(r, str) for r in roots):
        raise ConfigLoadError(
            f"Config file {path}: '{IMPORT_ROOTS_KEY}' must be a list of folder paths, got {one_line(roots)}; "
            "fix or delete that key"
        )
    for root in roots:
        if Path(root).is_dir():
            add_import_root(root)
        else:
            logger.warning("Config file %s imports model code from %s, which does not exist; its targets will not "
                           "import until that folder is restored (or %s is edited).", path, root, IMPORT_ROOTS_KEY)


def _code_module_name(target: Path, importer: Path) -> Tuple[Path, str]:
    """(folder to import from, dotted module name) of code a config reaches by a relative import.

    Inside packages the name is the one Python gives it; without ``__init__.py`` files it is named
    from the parent of the config's project folder, or from the tree root when that project sits in
    ``projects/`` (``projects.MyProj.modeling.model``).
    """
    start = root = target if target.is_dir() else target.parent
    while (root / "__init__.py").exists():
        root = root.parent
    if root == start:
        project = next(p for p in importer.parents if p.name == "configs").parent
        root = project.parent.parent if project.parent.name == "projects" else project.parent
    parts = Path(os.path.relpath(target, root)).parts
    if not all(part.isidentifier() for part in parts):  # outside root (``..``) or a name Python cannot import
        raise ImportError(
            f"Cannot import {target} from {importer} as module {'.'.join(parts)!r} of {root}: keep it under {root} "
            "in folders named as Python identifiers (letters, digits, underscores)"
        )
    return root, ".".join(parts)


def _module_chain(name: str, leaf: types.ModuleType) -> Any:
    # ``import configs.common.train`` binds the top package and reaches the leaf by
    # attribute; stand-in parents make that work without touching sys.modules.
    for part in reversed(name.split(".")[1:]):
        leaf = types.SimpleNamespace(**{part: leaf})
    return leaf


class _FreshLoader:
    """Executes config files as throw-away modules and serves the imports they write."""

    def __init__(self, config_file: Path):
        self.tree_root = _tree_root(config_file)
        self.roots: List[Path] = []
        self.executed_files: set = set()
        # Imports of other frameworks' configs, answered by the installed dialects without those frameworks.
        self.dialects = new_dialects()
        if self.tree_root is not None:
            self.add_root(self.tree_root)

    def add_root(self, root: Path) -> None:
        add_import_root(root)
        if not _is_installed_root(root) and root not in self.roots:
            self.roots.append(root)

    def exec_file(self, path: Path) -> types.ModuleType:
        package = f"{_CFG_PACKAGE_NAME}{uuid.uuid4().hex[:8]}"
        module = types.ModuleType(f"{package}.{path.stem}")
        module.__file__, module.__package__ = str(path), package
        self.executed_files.add(str(path))
        # Compiling with the real path puts it in tracebacks and error locations.
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec", dont_inherit=True), module.__dict__)
        # Whichever import form reaches it (``from x import train``, ``import x``),
        # a config's dicts arrive as DictConfig, so ``train.train_iter = 5`` works.
        module.__dict__.update({k: cast_to_config(v) for k, v in module.__dict__.items() if not k.startswith("_")})
        return module

    def _find_absolute(self, name: str) -> Optional[Path]:
        # The user's tree first, then the installed package, then sys.path as Python would.
        parts = name.split(".")
        search = [self.tree_root.joinpath(*parts)] if self.tree_root is not None else []
        search += [d.joinpath(*parts[1:]) for d in _installed_dirs(parts[0])]
        search += [Path(p or os.getcwd()).joinpath(*parts) for p in sys.path if p not in _ADDED_ROOTS]
        return next((base for base in search if _py_file(base).is_file() or base.is_dir()), None)

    def import_config(self, base: Path, fromlist: Sequence[str], what: str, importer: Optional[Path]):
        """Config module for ``base`` (a path without ``.py``), or None to fall back to normal import."""
        if _py_file(base).is_file():
            return self.exec_file(_py_file(base))
        if base.is_dir():
            names = [n for n in (fromlist or ()) if n != "*"]
            if names and all(base.joinpath(n + ".py").is_file() for n in names):
                # ``from configs.common import train`` -> a fresh module per name.
                return types.SimpleNamespace(**{n: self.exec_file(base / (n + ".py")) for n in names})
            if importer is None:
                return None
            raise ImportError(
                f"Cannot import {what!r} in {importer}: {base} is a directory; a config file can "
                "only import names from other config files (e.g. 'from .common.train import train')"
            )
        raise ImportError(f"Cannot import {what!r} in {importer}: {_py_file(base)} does not exist")

    def import_code(self, root: Path, name: str, base: Path, importer: Path, fromlist, original_import):
        """Import ``name`` (the code at ``base``) as a real module, once per process, from ``root``."""
        self.add_root(root)
        module = original_import(name, None, None, fromlist, 0)
        origin = getattr(sys.modules.get(name), "__file__", None)
        found = [origin] if origin else list(getattr(sys.modules.get(name), "__path__", ()))
        # A stable name is only safe if no other package already owns it.
        if not {_py_file(base), base / "__init__.py", base} & {Path(p).resolve() for p in found}:
            raise ImportError(
                f"{importer} imports {base} as module {name!r}, but {name!r} is already imported from {found}; "
                "give the folder a name no other package uses"
            )
        return module

    def hook(self, original_import):
        def new_import(name, globals=None, locals=None, fromlist=(), level=0):
            package = (globals or {}).get("__package__") or ""
            if not package.startswith(_CFG_PACKAGE_NAME):
                # Model code imported by a config imports as Python always does.
                return original_import(name, globals, locals, fromlist, level)
            importer = Path(globals["__file__"])
            if level:
                base = importer.parents[level - 1].joinpath(*name.split(".") if name else ())
                exists = _py_file(base).is_file() or base.is_dir()
                if exists and not _is_config_target(base, importer):
                    root, module_name = _code_module_name(base, importer)
                    return self.import_code(root, module_name, base, importer, fromlist, original_import)
                return self.import_config(base, fromlist, "." * level + name, importer)
            dialect = next((d for d in self.dialects if d.handles(name)), None)
            if dialect is not None:
                return dialect.load(name, fromlist)
            parts = name.split(".")
            base = self._find_absolute(name) if parts[0] in _TREE_PACKAGES else None
            # configs.* and projects.<X>.configs.* are configs; the rest of a user's tree is code.
            if base is not None and (parts[0] == "configs" or parts[2:3] == ["configs"]):
                module = self.import_config(base, fromlist, name, None)
                if module is not None:
                    return module if fromlist else _module_chain(name, module)
            elif base is not None and self.tree_root is not None and self.tree_root in base.parents:
                try:
                    return self.import_code(self.tree_root, name, base, importer, fromlist, original_import)
                except ModuleNotFoundError as e:
                    # Another framework's own code, which only that framework runs: its dialect names it.
                    for dialect in self.dialects:
                        error = dialect.code_error(name, fromlist, importer, e.name or "")
                        if error is not None:
                            raise error from e
                    raise
            try:
                return original_import(name, globals, locals, fromlist, level)
            except ModuleNotFoundError as e:
                if e.name != parts[0] or self.dialects:
                    raise
                # An editable install older than the entry points, or a checkout used from PYTHONPATH.
                raise ModuleNotFoundError(f"No module named {parts[0]!r}, and no config dialect is installed to "
                                          f"answer it (entry-point group {DIALECTS_GROUP}): install the project "
                                          f"again with pip install -e .", name=e.name) from e

        return new_import


def exec_config(path: Path) -> Tuple[dict, List[Path], Optional[ConfigDialect]]:
    """The namespace of config file ``path``, executed afresh, the folders its code was imported from, and
    the dialect it is written in (None for this project's own configs)."""
    loader = _FreshLoader(path)
    original = builtins.__import__
    builtins.__import__ = loader.hook(original)
    try:
        namespace = dict(loader.exec_file(path).__dict__)
        return namespace, loader.roots, next((d for d in loader.dialects if d.seen), None)
    except Exception as e:
        files = loader.executed_files
        where = [f"{f.filename}, line {f.lineno}" for f in traceback.extract_tb(e.__traceback__) if f.filename in files]
        if isinstance(e, SyntaxError) and e.filename in files:
            where.append(f"{e.filename}, line {e.lineno}")
        at = f" (at {where[-1]})" if where else ""
        message = e.msg if isinstance(e, SyntaxError) else e
        raise ConfigLoadError(f"Failed to load config file {path}: {type(e).__name__}: {one_line(message)}{at}") from e
    finally:
        builtins.__import__ = original
