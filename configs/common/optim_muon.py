"""Muon for the hidden matrices, AdamW for the embedding, output layer, norms and biases (modded-nanogpt's and
nanochat's recipe): ``from configs.common.optim_muon import optim`` in place of configs/common/optim.py's."""
from libai_lite.config import LazyCall
from libai_lite.optim import MuonAdamW, get_default_optimizer_params

optim = LazyCall(MuonAdamW)(
    params=LazyCall(get_default_optimizer_params)(
        # params.model is set to the model by the trainer before instantiating.
        clip_grad_max_norm=1.0,
        clip_grad_norm_type=2.0,
        weight_decay_norm=0.0,
        weight_decay_bias=0.0,
        decoupled_lr=None,
        decoupled_min_lr=None,
        muon=True,
    ),
    # AdamW's groups.
    lr=1e-4,
    weight_decay=0.01,
    betas=(0.9, 0.95),
    eps=1e-8,
    # Muon's groups: their own peak lr on the same schedule; torch.optim.Muon's shape adjustment of it.
    muon_lr=0.02,
    momentum=0.95,
    nesterov=True,
    ns_steps=5,
    adjust_lr_fn=None,
)
