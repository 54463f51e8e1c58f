"""Demo: the gpt2_pretrain GPT with Switch-style mixture-of-experts feed-forward layers.

Every other layer's MLP becomes 4 experts with top-1 routing (the same active parameters per
token as the dense demo), capacity factor 1.25 and a load-balancing loss of weight 0.01. It trains
on the data_test/ corpus on a 2-core CPU in a few minutes:

    bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_moe.py 1
    # 2 processes, experts spread over both (each rank keeps 2 of the 4 experts per layer), ZeRO-2
    bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_moe.py 2 \
        model.cfg.moe.ep_size=2 train.zero_optimization.enabled=True train.zero_optimization.stage=2

The log line and metrics.json carry moe_aux_loss (weighted), moe_dropped_frac (assignments over
capacity) and moe_load_max (tokens of the busiest expert / mean tokens per expert in the worst MoE
layer: 1.0 is perfect balance, 4.0 one expert taking everything).

Load bound: after warm-up (iteration 100 on) moe_load_max averages at most 2.0 and no logged step
exceeds 2.5. Measured on this config: 2.93 on average over iterations 1-50, 1.48 (max 2.19) over
100-300 and 1.26 (max 1.43) over the last 100, with dropped assignments going from 37% to 0.8%.
tests/layers/test_moe.py checks the bound on a tiny version, and that without the loss
(aux_loss_weight=0) the load is worse.
"""
from .gpt2_pretrain import dataloader, model, optim, tokenization, train  # noqa: F401

model.cfg.moe.update(
    enabled=True,
    num_experts=4,
    top_k=1,
    ep_size=1,
    capacity_factor=1.25,
    aux_loss_weight=0.01,
    every_n_layers=2,
    jitter_noise=0.0,
)

train.update(output_dir="output/gpt2_moe")
