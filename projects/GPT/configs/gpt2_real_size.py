"""What the real-size GPT-2 configs share: Megatron-LM's GPT-2 recipe (seq 1024, bf16, cosine to 10%)."""
from configs.common.data.gpt_dataset import dataloader, tokenization
from .model import pretrain_model as model
from configs.common.optim import optim
from configs.common.train import train

model.cfg.max_seq_length = 1024
optim.update(lr=1.5e-4, weight_decay=0.01)
train.update(
    train_micro_batch_size=4,
    global_batch_size=512,
    train_iter=500000,
    warmup_ratio=0.01,
    log_period=100,
)
train.amp.update(enabled=True, dtype="bf16")
train.checkpointer.update(period=2000, max_to_keep=3)
train.evaluation.update(eval_period=2000, eval_iter=50)
