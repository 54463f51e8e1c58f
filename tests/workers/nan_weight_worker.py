"""torchrun worker for tests/checkpoint/test_nonfinite_weights.py: trains the tiny demo GPT as
``tools/train_net.py`` does (through ``launch``) and, right after iteration ITER's optimizer step, makes one
weight of rank RANK NaN (or inf), as an optimizer step that overflows would: that step's loss was computed
before it and is finite.

Usage: ``torchrun --nproc_per_node N tests/workers/nan_weight_worker.py ITER RANK VALUE OVERRIDE...``; exits with
the CLI's one ``error:`` line and status 1 when the run is refused.
"""
from __future__ import annotations

import sys
import torch


def poison_after(trainer, iteration: int, rank: int, value: float) -> None:
    """Wrap ``trainer.run_step`` to fill this rank's first weight with ``value`` after step ``iteration``."""
    run_step = trainer.run_step

    def poisoned():
        run_step()
        if trainer.iter == iteration and torch.distributed.get_rank() == rank:
            p = next(trainer.model.parameters())
            with torch.no_grad():
                (p.to_local() if hasattr(p, "to_local") else p).fill_(value)

    trainer.run_step = poisoned


def main(iteration: str, rank: str, value: str, *overrides: str) -> int:
    from libai_lite.config import default_argument_parser
    from libai_lite.engine.default import DefaultTrainer
    from libai_lite.engine.launch import launch

    train = DefaultTrainer.train

    def poisoned_train(self):
        poison_after(self.trainer, int(iteration), int(rank), float(value))
        return train(self)

    DefaultTrainer.train = poisoned_train
    return launch(default_argument_parser().parse_args(
        ["--config-file", "projects/GPT/configs/gpt2_pretrain.py", *overrides]))


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
