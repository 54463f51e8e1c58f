#!/usr/bin/env python
"""Print the config file and command that run a Megatron-LM ``pretrain_gpt.py`` command line here.

    python tools/from_megatron.py --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \\
        --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 8 \\
        --lr 0.00015 --train-iters 500000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 \\
        --clip-grad 1.0 --lr-warmup-fraction .01 --fp16 --split 949,50,1 --data-path my_gpt2_text_document \\
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --save ckpt --load ckpt
    python tools/from_megatron.py --output my_run.py <flags>     # writes the config file instead

Or run the flags directly: ``python tools/train_net.py --megatron-args "<flags>" [overrides]``. The flags
that shape the model choose its project (``compat/megatron/models.py``: GPT by default, Llama for
``--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear``), whose demo
config they apply to with Megatron-LM's defaults for what they leave out; flags with no effect here are
named on stderr; every flag not taken is refused in one error line, each with its reason.
"""
from __future__ import annotations

import sys

from compat.checkpoints import checkpoint_format
from compat.command_line import emit_config, parse_tool_argv, temporary_config
from compat.megatron import MEGATRON_MODELS, render_config, translate_megatron_args
from libai_lite.data.tokenizer_record import read_record
from libai_lite.utils.errors import UsageError


def checkpoint_kind(path: str) -> str:
    """What a ``--load`` directory holds: ``"megatron"``, ``"ours"`` or ``""`` (``checkpoint_format``'s words)."""
    kind = checkpoint_format(path)
    return "megatron" if kind.startswith("megatron") else kind


def prepare(flags: str):
    """(config text, extra train_net arguments, no-effect notes, parallel sizes) for Megatron ``flags``."""
    run = translate_megatron_args(flags, MEGATRON_MODELS, checkpoint_kind, read_record)
    extra = ["--resume"] if run.resume else []
    return render_config(run, flags), extra, run.no_effect, run.parallel_sizes


def write_config(flags: str):
    """Write the config for ``flags`` to a temporary file; (its path, extra train_net arguments, notes)."""
    text, extra, notes, _ = prepare(flags)
    path = temporary_config(text, "megatron_")
    return path, extra, notes


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    done, output, flags = parse_tool_argv(argv, __doc__,
                                          "Megatron pretrain_gpt.py flags, e.g. --num-layers 24 --hidden-size 1024 ...")
    if done is not None:
        return done
    try:
        text, extra, notes, sizes = prepare(flags)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if notes:
        print("Megatron flags with no effect here: " + "; ".join(notes), file=sys.stderr)
    config = emit_config(text, output, "megatron_run.py")
    nproc = sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1)
    hint = f"{nproc} x your data-parallel size" if nproc > 1 else "your GPU count"
    print(f"# run it ({hint} processes):\nbash tools/train.sh tools/train_net.py {config} NPROC {' '.join(extra)}"
          .rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
