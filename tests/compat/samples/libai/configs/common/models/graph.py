# LiBai's static-graph switches (OneFlow's nn.Graph).
from omegaconf import DictConfig

from libai.config import LazyCall
from libai.models.utils import GraphBase

graph = DictConfig(
    dict(
        enabled=True,
        debug=-1,
        train_graph=LazyCall(GraphBase)(is_train=True),
        eval_graph=LazyCall(GraphBase)(is_train=False),
    )
)
