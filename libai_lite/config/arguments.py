"""The command line shared by every tool: a config file plus ``key=value`` overrides."""
import argparse
from typing import Optional

__all__ = ["default_argument_parser"]

_EPILOG = """\
Examples:

Run on one process (CPU, or one GPU when present):
    $ bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_pretrain.py 1

Change some config options (any key of the config, Hydra override syntax):
    $ bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_pretrain.py 1 train.train_iter=100
    $ bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_pretrain.py 8 \\
        train.dist.tensor_parallel_size=2 optim.lr=1e-4 train.output_dir=output/gpt2

Evaluate a trained model only:
    $ bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_pretrain.py 1 \\
        --eval-only train.load_weight=/path/to/checkpoint

Check that everything works with a few iterations:
    $ python tools/train_net.py --config-file projects/GPT/configs/gpt2_pretrain.py --fast-dev-run
"""


class _FlagsAnywhereParser(argparse.ArgumentParser):
    """Accepts the flags before or after the ``key=value`` overrides.

    ``opts`` is ``argparse.REMAINDER``, which would swallow a ``--resume`` typed after an
    override (``... train.train_iter=100 --resume``); flags are moved to the front first.
    """

    _FLAGS = ("--resume", "--eval-only", "--fast-dev-run")

    def parse_args(self, args=None, namespace=None):
        import sys

        argv = list(sys.argv[1:] if args is None else args)
        flags, rest, i = [], [], 0
        while i < len(argv):
            a = argv[i]
            if a in self._FLAGS or a in ("-h", "--help"):
                flags.append(a)
            elif a == "--config-file" and i + 1 < len(argv):
                flags += [a, argv[i + 1]]
                i += 1
            elif a.startswith("--config-file="):
                flags.append(a)
            else:
                rest.append(a)
            i += 1
        return super().parse_args(flags + rest, namespace)


def default_argument_parser(epilog: Optional[str] = None) -> argparse.ArgumentParser:
    """Parser with ``--config-file``, ``--resume``, ``--eval-only``, ``--fast-dev-run`` and ``opts``.

    The flags may come before or after the ``key=value`` overrides.
    """
    parser = _FlagsAnywhereParser(
        epilog=epilog if epilog is not None else _EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    parser.add_argument("--eval-only", action="store_true", help="Perform evaluation only")
    parser.add_argument(
        "--fast-dev-run",
        action="store_true",
        help="Run several batches of train, eval and test to find any bugs (ie: a sort of unit test)",
    )
    parser.add_argument(
        "opts",
        help='Modify config options at the end of the command using "path.key=value" '
        '(Hydra syntax: "a.b=[1,2]", "a.s=\'hello world\'", "a.x=null", "+a.new=1" to add a key).',
        default=None,
        nargs=argparse.REMAINDER,
    )
    return parser
