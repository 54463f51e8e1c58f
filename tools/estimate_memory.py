#!/usr/bin/env python
"""Will it fit? Memory per rank of a config before the job is queued.

    python tools/estimate_memory.py projects/GPT/configs/gpt2_1.3B.py --nproc 8 --device-memory 80GiB
    python tools/estimate_memory.py projects/GPT/configs/gpt2_1.3B.py --nproc 2 --device-memory 16GiB \\
        train.dist.tensor_parallel_size=2 train.train_micro_batch_size=2

Prints parameters, gradients, optimizer state, activations and the expected peak of the fullest rank.
With --device-memory it answers "fits", or "does not fit" with the cheapest single change that fits.
Overrides are the training command's (key=value).
Exit status: 0 fits (or no --device-memory), 2 does not fit, 1 bad input (one `error:` line).
What it models and how: docs/tools.md#estimate_memory.
"""
import argparse
import sys

from libai_lite.config import LazyConfig
from libai_lite.run_sections import check_settings
from libai_lite.engine.launch import report_cli_error
from libai_lite.planning import format_estimate, gib, parse_bytes, planner_from_config, suggest

DOES_NOT_FIT = 2


class _Parser(argparse.ArgumentParser):
    """argparse's usage errors as one ``error:`` line and exit 1: its exit 2 is this tool's "does not fit"."""

    def error(self, message):
        self.exit(1, f"error: {message}; see {self.prog} --help\n")


def _value_after(argv, option):
    """``option -5GiB`` as ``option=-5GiB``: argparse takes a value that starts with '-' for an option."""
    out = list(argv)
    for i in range(len(out) - 2, -1, -1):
        if out[i] == option and out[i + 1].startswith("-") and out[i + 1][1:2].isdigit():
            out[i:i + 2] = [f"{option}={out[i + 1]}"]
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options; see ``--help``."""
    argv = _value_after(sys.argv[1:] if argv is None else list(argv), "--device-memory")
    p = _Parser(prog="tools/estimate_memory.py", description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", metavar="CONFIG", help="lazy config file (.py) or a run's config.yaml")
    p.add_argument("opts", nargs="*", metavar="key=value", help="config overrides, as for tools/train_net.py")
    p.add_argument("--nproc", type=int, default=1, help="processes in the job (the world size; default 1)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="memory of one device, e.g. 80GiB, 16GB: answer fits / does not fit")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="what the job trains on: an accelerator (offload moves state to the host; default) or "
                        "the CPU (offload moves nothing)")
    return p.parse_intermixed_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        budget = parse_bytes(args.device_memory) if args.device_memory is not None else None
        cfg = LazyConfig.apply_overrides(LazyConfig.load(args.config), args.opts)
        check_settings(cfg)  # as the training command checks them: a micro-batch of 0 divided by zero
        asked = {k: int(cfg.train.dist.get(f"{k}_parallel_size") or 1) for k in ("tensor", "pipeline", "context")}
        planner, settings = planner_from_config(cfg, args.nproc, args.device)
        got = {k: getattr(settings, f"{k}_parallel_size") for k in asked}
        if got != asked:
            # The launch caps sizes larger than the world (LiBai's rule); name the --nproc the config means.
            need = asked["tensor"] * asked["pipeline"] * asked["context"]
            sizes = " x ".join(f"{k}_parallel_size={v}" for k, v in asked.items())
            print(f"warning: train.dist asks for {sizes} = {need} processes, more than --nproc {args.nproc}: "
                  f"estimated as {args.nproc} process{'es' if args.nproc > 1 else ''} would run it (sizes capped); "
                  f"pass --nproc {need} to estimate that layout", file=sys.stderr)
        est = planner.estimate(settings)
        print(format_estimate(est))
        if budget is None:
            return 0
        if est.peak <= budget:
            print(f"fits in {gib(budget)} per device (peak {gib(est.peak)})")
            return 0
        found = suggest(planner, settings, budget)
        if found is None:
            print(f"does not fit in {gib(budget)} per device (peak {gib(est.peak)}), and no single change tried "
                  f"fits (ZeRO-3, activation checkpointing, micro-batch 1, more tensor or pipeline parallelism "
                  f"with {args.nproc} process{'es' if args.nproc > 1 else ''}); launch more processes (--nproc)")
        else:
            change, better = found
            print(f"does not fit in {gib(budget)} per device (peak {gib(est.peak)}): try {change} "
                  f"(estimated {gib(better.peak)})")
        return DOES_NOT_FIT
    except Exception as e:  # noqa: BLE001 - user errors arrive wrapped by instantiate; report_cli_error finds them
        return report_cli_error(e)


if __name__ == "__main__":
    sys.exit(main())
