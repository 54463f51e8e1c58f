"""LiBai's MT5 pretraining recipe: mT5-base dimensions, 2-way tensor parallel with the data-parallel size
left to the launch, ZeRO-2, mixed precision, 8 accumulation steps of micro-batch 4, span corruption on the
demo corpus in data_test/.

The same file runs on any number of processes, as LiBai's guide runs it (tensor, then pipeline parallel
sizes capped at what the world holds, data parallel = world / (tp x pp)):

    bash tools/train.sh tools/train_net.py projects/MT5/configs/mt5_pretrain.py 1   # tp 2 -> 1, global 32
    bash tools/train.sh tools/train_net.py projects/MT5/configs/mt5_pretrain.py 8   # dp 4 x tp 2, global 128
    # the guide's edits: train.dist.tensor_parallel_size=4 (dp 2 x tp 4), pipeline_parallel_size=4 (pp 4 x tp 2)

projects/MT5/README.md has more launches, scaled down for a CPU.
"""
from configs.common.optim import optim
from configs.common.train import train
from libai_lite.config import LazyCall
from libai_lite.scheduler import WarmupExponentialLR

from .model import pretrain_model as model
from .t5_dataset import dataloader, tokenization

model.cfg.update(
    hidden_size=768,
    hidden_layers=12,
    num_attention_heads=12,
    head_size=64,
    intermediate_size=2048,
    model_type="mt5",
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    embedding_dropout_prob=0.0,
    tie_word_embeddings=False,
)

dataloader.train.update(max_seq_length=512, masked_lm_prob=0.15)

optim.lr = 1e-4

train.update(
    output_dir="output/mt5_pretrain",
    train_micro_batch_size=4,
    num_accumulation_steps=8,
    global_batch_size=None,
    test_micro_batch_size=4,
    train_epoch=1,
    train_iter=24000,
    log_period=10,
    warmup_ratio=1 / 24,
    scheduler=LazyCall(WarmupExponentialLR)(warmup_factor=0.001, gamma=1.0, warmup_method="linear"),
)
train.amp.update(enabled=True, dtype="bf16")
train.dist.update(
    # The launch decides: world / (tp x pp). LiBai's file says 2 (its 4-GPU layout) and ignores it.
    data_parallel_size=None,
    tensor_parallel_size=2,
    pipeline_parallel_size=1,
    # pipeline_num_layers stays None: it is derived as 2 x model.cfg.hidden_layers (both stacks),
    # so overriding hidden_layers on the command line keeps the pipeline split right.
)
train.zero_optimization.update(enabled=True, stage=2)
train.activation_checkpoint.enabled = False
train.evaluation.update(enabled=True, eval_period=5000, eval_iter=20)
