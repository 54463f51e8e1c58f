"""Demo: a small GPT-2 on the data_test/ corpus that trains in about 5 minutes on a 2-core CPU.

    bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_pretrain.py 1
"""
from configs.common.data.gpt_dataset import dataloader, tokenization
from .model import pretrain_model as model
from configs.common.optim import optim
from configs.common.train import train

model.cfg.update(
    hidden_layers=4,
    hidden_size=256,
    ffn_hidden_size=1024,
    num_attention_heads=4,
    max_seq_length=128,
    embedding_dropout_prob=0.0,
    attention_dropout_prob=0.0,
    output_dropout_prob=0.0,
)

optim.lr = 1.5e-3

train.update(
    output_dir="output/gpt2_pretrain",
    train_micro_batch_size=8,
    global_batch_size=16,
    test_micro_batch_size=8,
    train_iter=300,
    warmup_ratio=0.05,
    log_period=10,
)
train.checkpointer.update(period=100, max_to_keep=2)
train.evaluation.update(eval_period=100, eval_iter=5)
