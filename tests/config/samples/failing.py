from .common.train import train

train.train_iter = undefined_name
