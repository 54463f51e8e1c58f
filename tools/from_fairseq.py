#!/usr/bin/env python
"""Print the config file and command that run a fairseq-train command line here.

    python tools/from_fairseq.py data-bin --task language_modeling --arch transformer_lm_gpt \\
        --share-decoder-input-output-embed --optimizer adam --adam-betas "(0.9,0.98)" --lr 0.0005 \\
        --lr-scheduler inverse_sqrt --warmup-updates 4000 --tokens-per-sample 512 --batch-size 8 --max-update 50000
    python tools/from_fairseq.py --output my_run.py <the same>     # writes the config file instead

Or run it directly: ``python tools/train_net.py --fairseq-args "<the same>" [overrides]``. The model is
projects/GPT; the data-bin is trained on in place with its dict.txt ids unchanged (nothing is written into
it); as fairseq-train, a run resumes from --save-dir's last
checkpoint when it holds one (train_net's --resume). Flags with no effect here, and what differs from fairseq,
are named on stderr; every flag not taken is refused in one error line, each with its reason.
"""
from __future__ import annotations

import os
import sys

from compat.command_line import emit_config, parse_tool_argv, temporary_config
from compat.fairseq import prepare_split, render_config, translate_fairseq_args
from libai_lite.utils.errors import UsageError


def prepare(flags: str, world_size: int = 1):
    """(config text, no-effect notes, differences from fairseq) for the fairseq-train command line ``flags``."""
    run = translate_fairseq_args(flags, world_size)
    prefix = prepare_split(run.data, "train")
    differs = list(run.differs)
    if os.path.isfile(os.path.join(run.data, "valid.idx")):
        differs.append(f"{run.data}/valid is not evaluated during training here (fairseq validates on it every "
                       f"epoch): tools/evaluate.py evaluates a checkpoint")
    return render_config(run, flags, prefix), run.no_effect, differs


def notes_lines(notes, differs) -> list:
    """The start-up lines naming the flags with no effect and what differs from fairseq."""
    lines = []
    if notes:
        lines.append("fairseq flags with no effect here: " + "; ".join(notes))
    if differs:
        lines.append("differs from fairseq: " + "; ".join(differs))
    return lines


def write_config(flags: str):
    """Write the config for ``flags`` to a temporary file; (its path, start-up lines)."""
    text, notes, differs = prepare(flags, int(os.environ.get("WORLD_SIZE", "1")))
    path = temporary_config(text, "fairseq_")
    return path, notes_lines(notes, differs)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    done, output, flags = parse_tool_argv(
        argv, __doc__, "a fairseq-train command line, e.g. data-bin --task language_modeling --arch ...")
    if done is not None:
        return done
    try:
        text, notes, differs = prepare(flags)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for line in notes_lines(notes, differs):
        print(line, file=sys.stderr)
    config = emit_config(text, output, "fairseq_run.py")
    print(f"# run it (your GPU count processes):\nbash tools/train.sh tools/train_net.py {config} NPROC --resume")
    return 0


if __name__ == "__main__":
    sys.exit(main())
