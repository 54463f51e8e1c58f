"""Turn lazy configs (``_target_`` + keyword arguments) into live objects.

A small ``hydra.utils.instantiate`` in the detectron2 style: nested ``_target_`` nodes are built
bottom-up, plain mappings and sequences in a call's arguments arrive as ``dict``/``list`` because
omegaconf nodes cannot hold arbitrary objects, and a failure names the target and its key path.
"""
import builtins
import contextlib
import dataclasses
import difflib
import functools
import importlib
from collections import abc
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write

from ..utils.errors import UsageError

__all__ = ["instantiate", "instantiate_target", "instantiate_with", "locate", "InstantiationError",
           "TargetNotFoundError"]

# Keys with a meaning to ``instantiate`` itself; they are never passed to the target.
_RESERVED_KEYS = ("_target_", "_recursive_", "_partial_")


class InstantiationError(RuntimeError):
    """Building one ``_target_`` failed; the message names the target and the key path."""


class TargetNotFoundError(ImportError, UsageError):
    """A dotted path names no module or attribute (a typo in a ``_target_``): the user's to correct."""


def _did_you_mean(obj: Any, attr: str, prefix: str) -> str:
    names = [n for n in dir(obj) if not n.startswith("_")]
    close = difflib.get_close_matches(attr, names, n=3, cutoff=0.6)
    if not close:
        return ""
    quoted = [f"'{prefix}.{n}'" for n in close]
    return f" (did you mean {quoted[0] if len(quoted) == 1 else ', '.join(quoted[:-1]) + ' or ' + quoted[-1]}?)"


def locate(path: str) -> Any:
    """Import and return the object named by a dotted path such as ``torch.optim.AdamW``."""
    if not isinstance(path, str) or not path:
        raise TargetNotFoundError(f"Cannot locate {path!r}: expected a non-empty dotted path string")
    parts = path.split(".")
    missing = None
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # Only "this prefix is not a module" means try a shorter prefix; a module
            # that exists but misses one of its own dependencies is a real error.
            if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
                missing = e.name
                continue
            raise
        for depth, attr in enumerate(parts[i:], start=i):
            if not hasattr(obj, attr):
                where = ".".join(parts[:depth])
                raise TargetNotFoundError(f"Cannot locate {path!r}: {where!r} has no attribute {attr!r}"
                                          f"{_did_you_mean(obj, attr, where)}")
            obj = getattr(obj, attr)
        return obj
    if len(parts) == 1 and hasattr(builtins, path):
        return getattr(builtins, path)
    raise TargetNotFoundError(
        f"Cannot locate {path!r}: no module named {missing or parts[0]!r}; install the package that provides it "
        "or add the folder holding it to PYTHONPATH (a config.yaml saved by LazyConfig lists such folders "
        "under _import_roots_)"
    )


def target_to_string(target: Any) -> str:
    """Inverse of :func:`locate`: the shortest dotted path that locates back to ``target``."""
    module, qualname = target.__module__, target.__qualname__
    # Prefer a public re-export (``torch.optim.AdamW`` over ``torch.optim.adamw.AdamW``):
    # shorter in saved YAML and robust to the implementation file moving.
    module_parts = module.split(".")
    for k in range(1, len(module_parts)):
        candidate = ".".join(module_parts[:k]) + "." + qualname
        with contextlib.suppress(Exception):
            if locate(candidate) is target:
                return candidate
    return f"{module}.{qualname}"


def join_key(path: str, key: Any) -> str:
    """The dotted path of ``key`` under ``path`` (``""`` is the root)."""
    return f"{path}.{key}" if path else str(key)


def instantiate(cfg: Any) -> Any:
    """Recursively build every ``_target_`` in ``cfg``.

    ``_target_`` may be a callable or a dotted import path. ``_recursive_=False`` passes the
    call's arguments through unbuilt (as omegaconf nodes, for the callee to instantiate);
    ``_partial_=True`` returns a ``functools.partial``. Plain ``DictConfig``/``ListConfig``
    nodes become ``dict``/``list``; anything else is returned unchanged.
    """
    path = ""
    if isinstance(cfg, (DictConfig, ListConfig)):
        # A sub-node of a loaded config knows where it lives (``model.cfg``); use that
        # so ``instantiate(cfg.model)`` reports paths the user can override.
        with contextlib.suppress(Exception):
            path = cfg._get_full_key(None) or ""
    return _instantiate(cfg, path)


def _instantiate(cfg: Any, path: str) -> Any:
    if isinstance(cfg, (ListConfig, list, tuple)):
        items = [_instantiate(v, join_key(path, i)) for i, v in enumerate(cfg)]
        return tuple(items) if isinstance(cfg, tuple) else items
    if isinstance(cfg, DictConfig) and dataclasses.is_dataclass(cfg._metadata.object_type):
        return OmegaConf.to_object(cfg)
    if not isinstance(cfg, abc.Mapping):
        return cfg
    if "_target_" not in cfg:
        return {k: _instantiate(v, join_key(path, k)) for k, v in cfg.items()}

    target, recursive = cfg["_target_"], cfg.get("_recursive_", True)
    kwargs = {
        k: _instantiate(v, join_key(path, k)) if recursive else v for k, v in cfg.items() if k not in _RESERVED_KEYS
    }
    where = path or "<root>"
    try:
        name = target if isinstance(target, str) else f"{target.__module__}.{target.__qualname__}"
    except AttributeError:
        name = repr(target)
    if isinstance(target, str):
        try:
            target = locate(target)
        except Exception as e:
            raise InstantiationError(f"Cannot import _target_ {name!r} at {where!r}: {type(e).__name__}: {e}") from e
    if not callable(target):
        raise InstantiationError(f"_target_ {name!r} at {where!r} is not callable")
    if cfg.get("_partial_", False):
        return functools.partial(target, **kwargs)
    try:
        return target(**kwargs)
    except InstantiationError:
        # A nested instantiate() inside the target already named the deeper failure.
        raise
    except Exception as e:
        message = " ".join(str(e).split())
        raise InstantiationError(f"Error instantiating {name!r} at {where!r}: {type(e).__name__}: {message}") from e


def instantiate_with(node, **kwargs):
    """Instantiate a LazyCall node with some arguments supplied at run time (objects a config can't hold).

    The node stays attached to its config, so `${...}` interpolations still resolve.
    """
    # Run-time arguments may replace nested LazyCalls (optim.params), which must not be built
    # here; they are taken out for the call and put back so the saved config is unchanged.
    stashed = {k: node[k] for k in kwargs if k in node}
    # A resolved config is read-only (libai_lite.run_spec); this edit is undone before returning.
    with read_write(node), open_dict(node):
        for key in stashed:
            del node[key]
        node._partial_ = True
    try:
        fn = instantiate(node)
    finally:
        with read_write(node), open_dict(node):
            del node["_partial_"]
            for key, value in stashed.items():
                node[key] = value
    return fn(**kwargs)


def instantiate_target(node):
    """The class or function a LazyCall node would call, without calling it."""
    target = node._target_
    return locate(target) if isinstance(target, str) else target
