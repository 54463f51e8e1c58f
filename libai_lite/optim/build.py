"""Parameter groups for the optimizer: no weight decay on biases and normalisation weights."""
from __future__ import annotations

import torch.nn as nn

# Any module whose class name ends in one of these is treated as a normalisation layer,
# so project-local norms (RMSLayerNorm in MT5, ...) get the norm weight decay without registration.
_NORM_SUFFIXES = ("LayerNorm", "RMSNorm", "BatchNorm1d", "BatchNorm2d", "GroupNorm")


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or type(module).__name__.endswith(_NORM_SUFFIXES)


def get_default_optimizer_params(model: nn.Module, weight_decay: float | None = None,
                                 weight_decay_norm: float | None = 0.0, weight_decay_bias: float | None = 0.0,
                                 clip_grad_max_norm: float | None = None, clip_grad_norm_type: float | None = None):
    """Split `model`'s trainable parameters into groups by weight decay.

    `weight_decay=None` keeps the optimizer's own `weight_decay` for ordinary weights. Biases and
    normalisation weights get `weight_decay_bias` / `weight_decay_norm` (0 by default, as in
    Megatron and LiBai). `clip_grad_max_norm` / `clip_grad_norm_type` live here for LiBai
    compatibility of the config keys; the trainer reads them from the config and clips.
    A parameter shared by several modules (a tied embedding) appears once.
    """
    del clip_grad_max_norm, clip_grad_norm_type
    decay, no_decay_norm, no_decay_bias = [], [], []
    seen: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if _is_norm(module):
                no_decay_norm.append(p)
            elif name == "bias":
                no_decay_bias.append(p)
            else:
                decay.append(p)
    groups = []
    if decay:
        groups.append({"params": decay} if weight_decay is None else {"params": decay, "weight_decay": weight_decay})
    if no_decay_norm:
        groups.append({"params": no_decay_norm, "weight_decay": weight_decay_norm or 0.0})
    if no_decay_bias:
        groups.append({"params": no_decay_bias, "weight_decay": weight_decay_bias or 0.0})
    return groups
