"""Muon for the hidden 2-D weights, AdamW for the rest (embeddings, the output layer, norms, biases): one optimizer.

The groups ``get_default_optimizer_params(muon=True)`` marks ``muon=True`` take Muon's step: momentum, then the
update orthogonalized by Newton-Schulz (``torch.optim.Muon``'s own iteration and learning-rate adjustment), with
decoupled weight decay; the other groups take torch's AdamW step (its functional ``adam`` with decoupled weight
decay). The orthogonalization needs each weight whole: a sharded weight (FSDP2 ZeRO-2/3, tensor parallelism: a
DTensor) has its momentum-updated gradient gathered, orthogonalized on every rank alike, and this rank's shard of
the result taken locally, so every layout steps the weights a single process would. The state is a plain
optimizer's (``momentum_buffer``; ``step``/``exp_avg``/``exp_avg_sq``), which DCP saves and reshards.
"""
from __future__ import annotations

import torch
from torch.optim import Optimizer
from torch.optim import _muon
from torch.optim.adam import adam

__all__ = ["MuonAdamW"]


def _orthogonalized(update: torch.Tensor, ns_steps: int, ns_coefficients, eps: float) -> torch.Tensor:
    """Newton-Schulz of the whole matrix; a DTensor's full value is gathered and this rank's part kept."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(update, DTensor):
        whole = _muon._zeropower_via_newtonschulz(update.full_tensor(), ns_coefficients, ns_steps, eps)
        # Every rank computed the same matrix: each keeps its own shard, no communication.
        return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
    return _muon._zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)


class MuonAdamW(Optimizer):
    """Muon (``muon=True`` groups, lr ``muon_lr`` unless the group sets its own) beside AdamW (the other groups).

    ``muon_lr`` 0.02, momentum 0.95 with Nesterov, 5 Newton-Schulz steps are modded-nanogpt's and nanochat's;
    ``adjust_lr_fn`` is ``torch.optim.Muon``'s (None: its original ``sqrt(max(1, rows/cols))`` scaling;
    ``"match_rms_adamw"``: Moonshot's, which lets Muon share AdamW's lr and weight decay).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.01,
                 muon_lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 adjust_lr_fn: str | None = None):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum} must be in [0, 1)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, muon=False, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        params = list(params)
        groups = [dict(g) for g in params] if params and isinstance(params[0], dict) else [{"params": params}]
        for g in groups:
            if g.get("muon"):
                g.setdefault("lr", muon_lr)
                bad = [tuple(p.shape) for p in g["params"] if p.dim() != 2]
                if bad:
                    raise ValueError(f"Muon orthogonalizes matrices; a muon group holds parameters of shape {bad[0]}")
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every group: Muon's or AdamW's."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            (self._muon_step if group["muon"] else self._adamw_step)(group, params)
        return loss

    def _muon_step(self, group: dict, params: list) -> None:
        coefficients = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - group["momentum"])
            update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            update = _orthogonalized(update, group["ns_steps"], coefficients, _muon.EPS)
            lr = _muon._adjust_lr(group["lr"], group["adjust_lr_fn"], p.shape)
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update, alpha=-lr)

    def _adamw_step(self, group: dict, params: list) -> None:
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adam(params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps, foreach=False,
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
