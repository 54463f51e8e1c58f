"""Demo: a small T5 (v1.0: ReLU feed-forward, tied head) with GShard-style mixture-of-experts layers.

DeepSpeed's T5-MoE setup by config: every other feed-forward layer of each stack becomes 4 experts with
top-2 routing, capacity factor 1.25, load-balancing loss weight 0.01; span corruption on data_test/:

    bash tools/train.sh tools/train_net.py projects/MT5/configs/t5_moe.py 1
    # DeepSpeed's --moe --moe-ep-size 2 --zero-stage 2 --fp16: experts over 2 data-parallel ranks
    bash tools/train.sh tools/train_net.py projects/MT5/configs/t5_moe.py 2 model.cfg.moe.ep_size=2 \\
        train.zero_optimization.enabled=True train.zero_optimization.stage=2 train.amp.enabled=True train.amp.dtype=fp16

moe_load_max runs from 1.0 (balanced) to 2.0 (every token on the same two experts); averaged over
iterations 100-300 it stays at most 1.8 (bench/results/ has the run's figures).
"""
from .mt5_pretrain import dataloader, model, optim, tokenization, train  # noqa: F401

model.cfg.update(
    hidden_size=256,
    hidden_layers=4,
    num_attention_heads=4,
    head_size=64,
    intermediate_size=1024,
    model_type="t5",
    tie_word_embeddings=None,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    embedding_dropout_prob=0.0,
)
model.cfg.moe.update(
    enabled=True,
    num_experts=4,
    top_k=2,
    ep_size=1,
    capacity_factor=1.25,
    aux_loss_weight=0.01,
    every_n_layers=2,
    jitter_noise=0.0,
)

dataloader.train.update(max_seq_length=128, num_workers=0)

optim.lr = 1e-3

train.update(
    output_dir="output/t5_moe",
    train_micro_batch_size=8,
    num_accumulation_steps=1,
    global_batch_size=None,
    test_micro_batch_size=8,
    train_epoch=0,
    train_iter=300,
    log_period=10,
    warmup_ratio=0.05,
)
train.amp.update(enabled=False)
train.dist.update(data_parallel_size=None, tensor_parallel_size=1, pipeline_parallel_size=1)
train.zero_optimization.update(enabled=False, stage=2)
train.checkpointer.update(period=100, max_to_keep=2)
train.evaluation.update(enabled=True, eval_period=100, eval_iter=5)
