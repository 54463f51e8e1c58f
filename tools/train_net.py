#!/usr/bin/env python
"""Train (or evaluate with --eval-only) a model described by a lazy config.

    bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_pretrain.py 1 train.train_iter=100
    python tools/train_net.py --config-file projects/GPT/configs/gpt2_pretrain.py train.train_iter=100
    python tools/train_net.py --megatron-args "--num-layers 24 --hidden-size 1024 ..." [overrides]
    python tools/train_net.py --fairseq-args "data-bin --task language_modeling --arch transformer_lm ..." [overrides]
    python tools/train_net.py --config-file CONFIG --deepspeed --deepspeed_config ds_config.json [overrides]

``--megatron-args`` takes a Megatron-LM pretrain_gpt.py command line (tools/from_megatron.py prints the
config file it amounts to) in place of ``--config-file``. ``--deepspeed_config`` applies a DeepSpeed
ds_config.json on top of the config, before the ``key=value`` overrides (which win); ``--deepspeed``
is accepted and does nothing (docs/migrating.md, "DeepSpeed").
"""
import os
import sys

# First, before torch loads: a job killed while its workers start must not leave them orphaned.
from libai_lite.utils.process import die_with_launcher

die_with_launcher()

from libai_lite.engine.launch import launch  # noqa: E402
from libai_lite.config import default_argument_parser  # noqa: E402
from libai_lite.config.arguments import EPILOG  # noqa: E402

_FROM_OTHER_TOOLS = """
Coming from another tool (docs/migrating.md: what each flag or key maps to, has no effect, or is refused):
    $ python tools/train_net.py --megatron-args "--num-layers 24 --hidden-size 1024 ... --data-path PREFIX"
        Megatron-LM / Megatron-DeepSpeed / OneFlow-GPT pretrain_gpt.py flags in place of --config-file
    $ python tools/train_net.py --fairseq-args "data-bin --task language_modeling --arch transformer_lm ..."
        a fairseq-train command line (its data-bin read in place)
    $ python tools/train_net.py --config-file CONFIG --deepspeed_config ds_config.json [overrides]
        a DeepSpeed config applied before the overrides (which win)
"""


def _translating_tool(name: str):
    """tools/NAME.py (from_megatron, from_fairseq) as a module: this script's neighbour, not an installed package."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _megatron_argv(argv: list):
    """(``argv`` with ``--megatron-args FLAGS`` replaced by the config file those flags amount to, its start-up
    notes)."""
    i = argv.index("--megatron-args")
    if i + 1 >= len(argv):
        raise SystemExit("error: --megatron-args needs the Megatron flags as one quoted argument")
    tool = _translating_tool("from_megatron")
    # Every rank translates the flags itself (torchrun starts each with the same command line); rank 0 speaks.
    try:
        path, extra, notes = tool.write_config(argv[i + 1])
    except tool.UsageError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    # Logged at start-up (console and log.txt), like the other translations' notes.
    lines = ["Megatron flags with no effect here: " + "; ".join(notes)] if notes else []
    return argv[:i] + ["--config-file", path, *extra] + argv[i + 2:], lines


def _fairseq_argv(argv: list):
    """(``argv`` with ``--fairseq-args LINE`` replaced by the config file it amounts to, its start-up notes)."""
    i = argv.index("--fairseq-args")
    if i + 1 >= len(argv):
        raise SystemExit("error: --fairseq-args needs the fairseq-train command line as one quoted argument")
    tool = _translating_tool("from_fairseq")
    try:
        path, notes = tool.write_config(argv[i + 1])
    except tool.UsageError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    # fairseq-train resumes from --save-dir's last checkpoint when it holds one (--restore-file's default).
    return argv[:i] + ["--config-file", path, "--resume"] + argv[i + 2:], notes


def _deepspeed_argv(argv: list):
    """(``argv`` with ``--deepspeed_config FILE`` as overrides ahead of the user's, its no-effect notes)."""
    argv = [a for a in argv if a != "--deepspeed"]  # DeepSpeed's switch: the file says what to do
    path, rest = None, []
    it = iter(argv)
    for a in it:
        if a in ("--deepspeed_config", "--deepspeed-config"):
            path = next(it, None)
            if path is None:
                raise SystemExit("error: --deepspeed_config needs the path of a ds_config.json")
        elif a.startswith(("--deepspeed_config=", "--deepspeed-config=")):
            path = a.split("=", 1)[1]
        else:
            rest.append(a)
    if path is None:
        return rest, []
    from compat.deepspeed import read_ds_config, to_overrides
    from libai_lite.utils.errors import UsageError

    try:
        run = read_ds_config(path)
    except UsageError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    # Positional overrides keep their order when parsed: the file's first, so the command line's win.
    notes = [f"DeepSpeed config {path}: {note}" for note in run.notes]
    return to_overrides(run) + rest, notes


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config, translated = None, []
    if "--megatron-args" in argv:
        argv, translated = _megatron_argv(argv)
        config = argv[argv.index("--config-file") + 1]
    elif "--fairseq-args" in argv:
        argv, translated = _fairseq_argv(argv)
        config = argv[argv.index("--config-file") + 1]
    argv, notes = _deepspeed_argv(argv)
    notes = translated + notes
    try:
        args = default_argument_parser(epilog=EPILOG + _FROM_OTHER_TOOLS).parse_args(argv)
        return launch(args, notes=notes)
    finally:
        if config is not None:  # the config was read at start-up; config.yaml in the output keeps it
            os.remove(config)


if __name__ == "__main__":
    sys.exit(main())
