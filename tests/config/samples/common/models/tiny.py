import torch

from libai_lite.config import LazyCall

model = LazyCall(torch.nn.Linear)(in_features=4, out_features=2, bias=True)
