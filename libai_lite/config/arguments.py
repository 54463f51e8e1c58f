"""The command line shared by every tool: a config file plus ``key=value`` overrides."""
import argparse
from typing import Optional

__all__ = ["default_argument_parser"]

# The examples default_argument_parser shows; a tool adds its own after them.
EPILOG = """\
Examples:

Run on one process (CPU, or one GPU when present):
    $ bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_pretrain.py 1

Change some config options (any key of the config, Hydra override syntax):
    $ bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_pretrain.py 1 train.train_iter=100
    $ bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_pretrain.py 8 \\
        train.dist.tensor_parallel_size=2 optim.lr=1e-4 train.output_dir=output/gpt2

Evaluate a trained model only (log, config and results.json go to <train.output_dir>/eval_only/):
    $ bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_pretrain.py 1 \\
        --eval-only train.load_weight=/path/to/checkpoint

Check that everything works with a few iterations (written to <train.output_dir>/fast_dev_run/):
    $ python tools/train_net.py --config-file projects/GPT/configs/gpt2_pretrain.py --fast-dev-run
"""


class _FlagsAnywhereParser(argparse.ArgumentParser):
    """Accepts the flags before or after the ``key=value`` overrides (``... train.train_iter=100 --resume``)."""

    def parse_args(self, args=None, namespace=None):
        return self.parse_intermixed_args(args, namespace)


def default_argument_parser(epilog: Optional[str] = None) -> argparse.ArgumentParser:
    """Parser with ``--config-file``, ``--resume``, ``--eval-only``, ``--no-verify``, ``--fast-dev-run``, ``opts``."""
    parser = _FlagsAnywhereParser(
        epilog=epilog if epilog is not None else EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config-file", required=True, metavar="FILE", help="path to config file (.py lazy config or saved .yaml)"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="Whether to attempt to resume from the last checkpoint in train.output_dir "
        "(model, optimizer, scheduler, iteration and consumed samples). "
        "Without it, train.load_weight (if set) only initialises the model weights.",
    )
    parser.add_argument(
        "--eval-only",
        action="store_true",
        help="Evaluate the weights in train.load_weight (or, with --resume, the last checkpoint in "
        "train.output_dir) on the valid and test splits, and train nothing. Writes its log.txt, config.yaml "
        "and results.json to <train.output_dir>/eval_only/ and nothing else in train.output_dir.",
    )
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="Load checkpoints without checking their files against the CRC-32 checksums saved in their "
        "manifest.json (accept the risk of training on from corrupt bytes)",
    )
    parser.add_argument(
        "--fast-dev-run",
        action="store_true",
        help="Train 20 iterations with an evaluation and a checkpoint every 10, to check a setup. Writes to "
        "<train.output_dir>/fast_dev_run/ (train.output_dir=DIR on the command line moves it to DIR/fast_dev_run/) "
        "and nothing else in train.output_dir, so a trained run there is left as it is.",
    )
    parser.add_argument(
        "opts",
        nargs="*",
        help='Modify config options at the end of the command using "path.key=value" '
        '(Hydra syntax: "a.b=[1,2]", "a.s=\'hello world\'", "a.x=null", "+a.new=1" to add a key).',
    )
    return parser
