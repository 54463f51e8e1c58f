"""AdamW without weight decay on biases and norms, with gradient clipping (LiBai's layout)."""
import torch

from libai_lite.config import LazyCall
from libai_lite.optim import get_default_optimizer_params

optim = LazyCall(torch.optim.AdamW)(
    params=LazyCall(get_default_optimizer_params)(
        # params.model is set to the model by the trainer before instantiating.
        clip_grad_max_norm=1.0,
        clip_grad_norm_type=2.0,
        weight_decay_norm=0.0,
        weight_decay_bias=0.0,
        # Megatron's --decoupled-lr / --decoupled-min-lr: the input word embedding and output layer's own
        # peak and floor lr on the run's schedule (None: the optimizer's lr and the schedule's floor).
        decoupled_lr=None,
        decoupled_min_lr=None,
    ),
    lr=1e-4,
    weight_decay=0.01,
    betas=(0.9, 0.95),
    eps=1e-8,
    # One fused kernel per parameter group instead of a Python loop of per-tensor ops; CUDA and CPU both have it.
    fused=True,
)
