"""Demo: the gpt2_pretrain GPT with Switch-style mixture-of-experts feed-forward layers.

Every other layer's MLP becomes 4 experts with top-1 routing (the dense demo's active parameters per
token), capacity factor 1.25 and a load-balancing loss of weight 0.01:

    bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_moe.py 1
    # 2 processes, each keeping 2 of the 4 experts per layer, ZeRO-2
    bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_moe.py 2 \\
        model.cfg.moe.ep_size=2 train.zero_optimization.enabled=True train.zero_optimization.stage=2

The log carries moe_aux_loss, moe_dropped_frac and moe_load_max (busiest expert over the mean in the worst
layer: 1.0 is perfect balance). From iteration 100 on, moe_load_max averages at most 2.0 and no logged step
exceeds 2.5 (bench/results/ has the run's figures).
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
