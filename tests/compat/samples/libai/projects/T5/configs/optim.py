# LiBai's T5 project keeps its own optimizer section, the common one's form.
import oneflow as flow

from libai.config import LazyCall
from libai.optim import get_default_optimizer_params

optim = LazyCall(flow.optim.AdamW)(
    params=LazyCall(get_default_optimizer_params)(
        clip_grad_max_norm=1.0, clip_grad_norm_type=2.0, weight_decay_norm=0.0, weight_decay_bias=0.0
    ),
    lr=1e-4,
    weight_decay=0.01,
    betas=(0.9, 0.999),
    eps=1e-8,
    do_bias_correction=True,
)
