"""The demo GPT-2 trained with Muon on its hidden matrices and AdamW on the rest (configs/common/optim_muon.py).

    bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_muon.py 1
"""
from configs.common.optim_muon import optim

from .gpt2_pretrain import dataloader, model, tokenization, train

optim.lr = 1.5e-3
train.output_dir = "output/gpt2_muon"
