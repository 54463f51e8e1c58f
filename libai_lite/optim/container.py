"""Several optimizers stepped as one: a rank holding more than one pipeline stage (interleaved
schedules) has one model part per stage and one optimizer per part, so checkpoints can map
optimizer state to each part's parameter names."""
from __future__ import annotations

from collections import OrderedDict

import torch


class OptimizersContainer(torch.optim.Optimizer):
    """Behaves as one optimizer whose `param_groups` are the parts' own group dicts.

    `Optimizer.__init__` is deliberately not called: it would copy the groups, and an lr set
    by the scheduler on the copies would never reach the optimizers that step.
    """

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)
        if not self.optimizers:
            raise ValueError("OptimizersContainer needs at least one optimizer")
        self.defaults = self.optimizers[0].defaults
        self.state = {}
        for hooks in ("step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
                      "load_state_dict_post"):
            setattr(self, f"_optimizer_{hooks}_hooks", OrderedDict())

    @property
    def param_groups(self):
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        raise RuntimeError("save an OptimizersContainer through libai_lite.checkpoint, one part at a time")

    def load_state_dict(self, state_dict):
        raise RuntimeError("load an OptimizersContainer through libai_lite.checkpoint, one part at a time")


def optimizer_parts(optimizer) -> list:
    """The per-part optimizers behind `optimizer` (itself when it is a plain optimizer)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, OptimizersContainer):
        return optimizer.optimizers
    return [optimizer]
