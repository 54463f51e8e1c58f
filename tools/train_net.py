#!/usr/bin/env python
"""Train (or evaluate with --eval-only) a model described by a lazy config.

    bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_pretrain.py 1 train.train_iter=100
    python tools/train_net.py --config-file projects/GPT/configs/gpt2_pretrain.py train.train_iter=100
"""
import sys

# First, before torch loads: a job killed while its workers start must not leave them orphaned.
from libai_lite.utils.process import die_with_launcher

die_with_launcher()

from libai_lite.engine.launch import launch  # noqa: E402
from libai_lite.config import default_argument_parser  # noqa: E402


def main(argv=None) -> int:
    args = default_argument_parser().parse_args(argv)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
