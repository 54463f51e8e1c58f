"""Muon for the hidden matrices, AdamW for the embedding, output layer, norms and biases (modded-nanogpt's and
nanochat's recipe): ``from configs.common.optim_muon import optim`` in place of configs/common/optim.py's, whose
AdamW settings and parameter groups it keeps."""
import copy

from configs.common.optim import optim as _adamw
from libai_lite.config import LazyCall
from libai_lite.optim import MuonAdamW

_params = copy.deepcopy(_adamw.params)
_params.muon = True
optim = LazyCall(MuonAdamW)(
    params=_params,
    # AdamW's groups.
    lr=_adamw.lr,
    weight_decay=_adamw.weight_decay,
    betas=_adamw.betas,
    eps=_adamw.eps,
    # Muon's groups: their own peak lr on the same schedule; torch.optim.Muon's shape adjustment of it.
    muon_lr=0.02,
    momentum=0.95,
    nesterov=True,
    ns_steps=5,
    adjust_lr_fn=None,
)
