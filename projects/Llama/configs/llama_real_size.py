"""What the real-size Llama-family configs share: seq 4096, bf16, cosine to 10%, lr 3e-4 (Llama 2's recipe).

Point `dataloader.train.data_prefix` and `tokenization.tokenizer` at your corpus and its tokenizer;
the defaults train on data_test/ so each config runs as shipped.
"""
from configs.common.data.gpt_dataset import dataloader, tokenization
from .model import pretrain_model as model
from configs.common.optim import optim
from configs.common.train import train

model.cfg.update(max_seq_length=4096, layernorm_epsilon=1e-5)
optim.update(lr=3e-4, weight_decay=0.1)
train.update(
    train_micro_batch_size=1,
    global_batch_size=1024,
    train_iter=500000,
    warmup_ratio=0.004,
    log_period=100,
)
train.amp.update(enabled=True, dtype="bf16")
train.checkpointer.update(period=2000, max_to_keep=3)
train.evaluation.update(eval_period=2000, eval_iter=50)
