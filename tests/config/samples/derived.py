# Relative imports one level down, and a mutation that must not leak into other loads.
from libai_lite.config import LazyCall

from .common.models.tiny import model
from .common.train import train

train.train_iter = 20
model.in_features = 8
optim = LazyCall("torch.optim.SGD")(params=None, lr="${train.lr}")
hidden_sizes = [8, 16]
name = "derived"


def helper():  # functions are not configs
    return 1
