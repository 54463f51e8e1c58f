"""Parameter groups for the optimizer: no weight decay on biases and normalisation weights."""
from __future__ import annotations

import inspect

import torch.nn as nn

from ..config.validate import FRACTION, NON_NEGATIVE, POSITIVE, Range

# Any module whose class name ends in one of these is treated as a normalisation layer,
# so project-local norms (RMSLayerNorm in MT5, ...) get the norm weight decay without registration.
_NORM_SUFFIXES = ("LayerNorm", "RMSNorm", "BatchNorm1d", "BatchNorm2d", "GroupNorm")


# The ranges of the optim keys the optimizers take (checked before anything is built).
RULES = {
    "optim.lr": POSITIVE,
    "optim.weight_decay": NON_NEGATIVE,
    "optim.eps": POSITIVE,
    "optim.momentum": FRACTION,
    "optim.muon_lr": POSITIVE,
    "optim.ns_steps": Range(low=1, high=99, integer=True),
    "optim.betas": Range(low=0, high=1, high_open=True, length=2),
    "optim.params.weight_decay_norm": Range(low=0, nullable=True),
    "optim.params.weight_decay_bias": Range(low=0, nullable=True),
    "optim.params.decoupled_lr": Range(low=0, low_open=True, nullable=True),
    "optim.params.decoupled_min_lr": Range(low=0, nullable=True),
}


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or type(module).__name__.endswith(_NORM_SUFFIXES)


def get_default_optimizer_params(model: nn.Module, weight_decay: float | None = None,
                                 weight_decay_norm: float | None = 0.0, weight_decay_bias: float | None = 0.0,
                                 clip_grad_max_norm: float | None = None, clip_grad_norm_type: float | None = None,
                                 decoupled_lr: float | None = None, decoupled_min_lr: float | None = None,
                                 muon: bool = False):
    """Split `model`'s trainable parameters into groups by weight decay; a shared parameter appears once.

    `weight_decay=None` keeps the optimizer's own value for ordinary weights; biases and normalisation
    weights get `weight_decay_bias` / `weight_decay_norm` (0 by default, as in Megatron and LiBai).
    `decoupled_lr` (Megatron's --decoupled-lr) gives the input word embedding and the output layer
    (the model's `embedding_parameters()`) groups of their own with that peak lr, decayed by the same
    schedule to `decoupled_min_lr` (None: the schedule's floor ratio of `decoupled_lr`); those groups
    come after the others and carry `decoupled=True`. `clip_grad_max_norm` / `clip_grad_norm_type` are
    accepted only so LiBai configs load; the trainer clips. `muon=True` (for `MuonAdamW`) puts the hidden 2-D
    weights (not the embedding and output layer) in groups marked `muon=True`, after the AdamW ones.
    """
    del clip_grad_max_norm, clip_grad_norm_type
    special = _decoupled_parameters(model, decoupled_lr, decoupled_min_lr)
    matrices = _muon_parameters(model) if muon else set()
    buckets: dict[tuple[str, bool], list] = {}
    seen: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            kind = "norm" if _is_norm(module) else "bias" if name == "bias" else "decay"
            kind = "muon" if kind == "decay" and id(p) in matrices else kind
            buckets.setdefault((kind, id(p) in special), []).append(p)
    decay = {} if weight_decay is None else {"weight_decay": weight_decay}
    decays = {"decay": decay, "norm": {"weight_decay": weight_decay_norm or 0.0},
              "bias": {"weight_decay": weight_decay_bias or 0.0}, "muon": {**decay, "muon": True}}
    extra = {"lr": decoupled_lr, "decoupled": True}
    if decoupled_min_lr is not None:
        extra["min_lr"] = decoupled_min_lr
    # Decoupled groups last: group 0 (the lr the trainer logs) stays the run's own lr.
    return [{"params": buckets[(kind, decoupled)], **decays[kind], **(extra if decoupled else {})}
            for decoupled in (False, True) for kind in decays if (kind, decoupled) in buckets]


def _muon_parameters(model: nn.Module) -> set[int]:
    """Ids of the 2-D weights Muon steps: every matrix but the input word embedding and the output layer."""
    from ..model import embedding_parameters
    from ..utils.errors import UsageError

    embeddings = embedding_parameters(model)
    if embeddings is None:
        raise UsageError(f"optim.params.muon is set but {type(model).__name__} does not name its embedding and "
                         f"output layer, which AdamW must train: give it embedding_parameters() (see "
                         f"libai_lite/model.py) or use AdamW")
    skip = {id(p) for p in embeddings}
    return {id(p) for p in model.parameters() if p.dim() == 2 and id(p) not in skip}


def _decoupled_parameters(model: nn.Module, lr: float | None, min_lr: float | None) -> set[int]:
    """Ids of the parameters `decoupled_lr` applies to (none when it is off); bad settings refused."""
    from ..model import embedding_parameters
    from ..utils.errors import UsageError

    if lr is None:
        if min_lr is not None:
            raise UsageError(f"optim.params.decoupled_min_lr={min_lr} is set without optim.params.decoupled_lr: "
                             f"set decoupled_lr too (the embedding and output layer's peak lr) or drop it")
        return set()
    if min_lr is not None and min_lr > lr:
        raise UsageError(f"optim.params.decoupled_min_lr={min_lr} is above optim.params.decoupled_lr={lr}: the "
                         f"floor must not exceed the peak; lower decoupled_min_lr")
    params = embedding_parameters(model)
    if params is None:
        raise UsageError(f"optim.params.decoupled_lr is set but {type(model).__name__} does not name its embedding "
                         f"and output layer: give it embedding_parameters() (see libai_lite/model.py) or drop "
                         f"decoupled_lr")
    return {id(p) for p in params}


# LiBai's (OneFlow's) Adam/AdamW argument: True is what torch's optimizers always do.
_BIAS_CORRECTION = "do_bias_correction"


def _unknown_arguments(target, keys) -> list:
    """The keys ``target``'s constructor does not take (none when it takes ``**kwargs``)."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return [k for k in keys if k not in params]


def build_optimizer(node, model: nn.Module):
    """``optim`` (a LazyCall node) instantiated for ``model``, with ``optim.params.model`` set to it.

    An argument the optimizer does not take is refused in one line naming it, instead of the
    constructor's TypeError. LiBai's ``do_bias_correction=True`` is accepted as what torch's Adam and
    AdamW always do (and not passed on); ``False`` has no torch counterpart and is refused.
    """
    from omegaconf import open_dict, read_write

    from ..config.instantiate import instantiate_target, instantiate_with
    from ..utils.errors import UsageError

    target = instantiate_target(node)
    name = getattr(target, "__name__", str(target))
    keys = [k for k in node.keys() if not str(k).startswith("_")]
    unknown = _unknown_arguments(target, keys)
    stashed = {}
    if _BIAS_CORRECTION in unknown:
        if node[_BIAS_CORRECTION] is not True:
            raise UsageError(f"optim.{_BIAS_CORRECTION}={node[_BIAS_CORRECTION]}: {name} always corrects the "
                             f"moment estimates' bias (LiBai's default, True); remove optim.{_BIAS_CORRECTION} "
                             f"or set it to True")
        unknown.remove(_BIAS_CORRECTION)
        stashed[_BIAS_CORRECTION] = node[_BIAS_CORRECTION]
    if unknown:
        accepted = ", ".join(k for k in inspect.signature(target).parameters if k not in ("self", "params"))
        raise UsageError(f"optim.{unknown[0]} is not an argument of {name} (it takes {accepted}); "
                         f"remove optim.{unknown[0]} or correct its name")
    with read_write(node), open_dict(node):
        for key in stashed:
            del node[key]
    try:
        return instantiate_with(node, params=instantiate_with(node.params, model=model))
    except TypeError as e:
        if "unexpected keyword argument" not in str(e):
            raise
        raise UsageError(f"optim: {e}; remove that argument from optim or correct its name") from None
    finally:
        # The saved config.yaml keeps what the user wrote.
        with read_write(node), open_dict(node):
            node.update(stashed)
