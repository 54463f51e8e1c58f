"""The engine: from a resolved config to a running job (``launch``, ``DefaultTrainer``, the trainer and its hooks)."""
from __future__ import annotations

from omegaconf import open_dict

from ..config import instantiate, locate


def instantiate_with(node, **kwargs):
    """Instantiate a LazyCall node with some arguments supplied at run time (objects a config can't hold).

    The node stays attached to its config, so `${...}` interpolations still resolve.
    """
    # Run-time arguments may replace nested LazyCalls (optim.params), which must not be built
    # here; they are taken out for the call and put back so the saved config is unchanged.
    stashed = {k: node[k] for k in kwargs if k in node}
    with open_dict(node):
        for key in stashed:
            del node[key]
        node._partial_ = True
    try:
        fn = instantiate(node)
    finally:
        with open_dict(node):
            del node["_partial_"]
            for key, value in stashed.items():
                node[key] = value
    return fn(**kwargs)


def instantiate_target(node):
    """The class or function a LazyCall node would call, without calling it."""
    target = node._target_
    return locate(target) if isinstance(target, str) else target
