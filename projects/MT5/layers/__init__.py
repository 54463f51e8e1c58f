"""MT5-specific layers built on ``libai_lite.layers``: the T5 block, relative position bias and the loss."""
from .loss_layer import MT5Loss, label_is_top1
from .relative_position import RelativePositionBias, relative_position_bucket
from .transformer_layer import FEED_FORWARD, MT5TransformerLayer, fused_qkv_init_method

__all__ = [
    "FEED_FORWARD",
    "MT5Loss",
    "MT5TransformerLayer",
    "RelativePositionBias",
    "fused_qkv_init_method",
    "label_is_top1",
    "relative_position_bucket",
]
