"""Turn lazy configs (``_target_`` + keyword arguments) into live objects.

A much smaller cousin of ``hydra.utils.instantiate`` in the detectron2 style:
every nested ``_target_`` is built bottom-up, plain mappings and sequences in a
call's arguments arrive as ``dict``/``list`` (never as omegaconf nodes, which
cannot hold arbitrary objects reliably), and a failure names the target and the
key path that was being built.
"""
import builtins
import dataclasses
import functools
import importlib
from collections import abc
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = ["instantiate", "locate", "InstantiationError"]

# Keys with a meaning to ``instantiate`` itself; they are never passed to the target.
_RESERVED_KEYS = ("_target_", "_recursive_", "_partial_")


class InstantiationError(RuntimeError):
    """Building one ``_target_`` failed; the message names the target and the key path."""


def locate(path: str) -> Any:
    """Import and return the object named by a dotted path such as ``torch.optim.AdamW``."""
    if not isinstance(path, str) or not path:
        raise ImportError(f"Cannot locate {path!r}: expected a non-empty dotted path string")
    parts = path.split(".")
    missing = None
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # Only "this prefix is not a module" means try a shorter prefix; a module
            # that exists but misses one of its own dependencies is a real error.
            if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
                missing = e.name
                continue
            raise
        obj = module
        for depth, attr in enumerate(parts[i:], start=i):
            try:
                obj = getattr(obj, attr)
            except AttributeError as e:
                owner = ".".join(parts[:depth])
                raise ImportError(f"Cannot locate {path!r}: {owner!r} has no attribute {attr!r}") from e
        return obj
    if len(parts) == 1 and hasattr(builtins, path):
        return getattr(builtins, path)
    raise ImportError(
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
        try:
            if locate(candidate) is target:
                return candidate
        except Exception:
            pass
    return f"{module}.{qualname}"


def _describe_target(target: Any) -> str:
    if isinstance(target, str):
        return target
    try:
        return f"{target.__module__}.{target.__qualname__}"
    except AttributeError:
        return repr(target)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _root_path(cfg: Any) -> str:
    # A sub-node of a loaded config knows where it lives (``model.cfg``); use that
    # so ``instantiate(cfg.model)`` reports paths the user can override.
    if isinstance(cfg, (DictConfig, ListConfig)):
        try:
            return cfg._get_full_key(None) or ""
        except Exception:
            return ""
    return ""


def instantiate(cfg: Any) -> Any:
    """Recursively build every ``_target_`` in ``cfg``.

    ``_target_`` may be a callable or a dotted import path. ``_recursive_=False``
    passes the call's arguments through unbuilt (as omegaconf nodes, so the callee
    can instantiate them later); ``_partial_=True`` returns a ``functools.partial``.
    Plain ``DictConfig``/``ListConfig`` nodes become ``dict``/``list``; anything
    else is returned unchanged.
    """
    return _instantiate(cfg, _root_path(cfg))


def _instantiate(cfg: Any, path: str) -> Any:
    if isinstance(cfg, (ListConfig, list, tuple)):
        items = [_instantiate(v, _join(path, i)) for i, v in enumerate(cfg)]
        return tuple(items) if isinstance(cfg, tuple) else items

    if isinstance(cfg, DictConfig) and dataclasses.is_dataclass(cfg._metadata.object_type):
        return OmegaConf.to_object(cfg)

    if not isinstance(cfg, abc.Mapping):
        return cfg

    if "_target_" not in cfg:
        return {k: _instantiate(v, _join(path, k)) for k, v in cfg.items()}

    target = cfg["_target_"]
    recursive = cfg.get("_recursive_", True)
    partial = cfg.get("_partial_", False)
    kwargs = {}
    for key, value in cfg.items():
        if key in _RESERVED_KEYS:
            continue
        kwargs[key] = _instantiate(value, _join(path, key)) if recursive else value

    where = path or "<root>"
    name = _describe_target(target)
    if isinstance(target, str):
        try:
            target = locate(target)
        except Exception as e:
            raise InstantiationError(
                f"Cannot import _target_ {name!r} at {where!r}: {type(e).__name__}: {e}"
            ) from e
    if not callable(target):
        raise InstantiationError(f"_target_ {name!r} at {where!r} is not callable")
    if partial:
        return functools.partial(target, **kwargs)
    try:
        return target(**kwargs)
    except InstantiationError:
        # A nested instantiate() inside the target already named the deeper failure.
        raise
    except Exception as e:
        message = " ".join(str(e).split())
        raise InstantiationError(
            f"Error instantiating {name!r} at {where!r}: {type(e).__name__}: {message}"
        ) from e
