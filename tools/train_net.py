#!/usr/bin/env python
"""Train (or evaluate with --eval-only) a model described by a lazy config.

    bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_pretrain.py 1 train.train_iter=100
    python tools/train_net.py --config-file projects/GPT/configs/gpt2_pretrain.py train.train_iter=100
"""
import sys

from libai_lite.engine.launch import launch
from libai_lite.config import default_argument_parser


def main(argv=None) -> int:
    args = default_argument_parser().parse_args(argv)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
