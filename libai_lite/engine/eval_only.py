"""Evaluation alone, on a road of its own: no optimizer, lr schedule, step runner or hooks are built.

``--eval-only`` (``tools/train_net.py``) evaluates the config's valid and test splits and ``dataloader.test``;
``tools/evaluate.py`` and the lm-evaluation-harness adapter (``engine.launch.build_eval_trainer``) bring
their own data.
"""
from __future__ import annotations

import logging

from ..checkpoint.trainer_state import resume_position
from ..evaluation.runner import evaluate_splits
from ..run_spec import resolve_run
from ..utils.errors import UsageError
from .built_run import BuiltRun

logger = logging.getLogger("libai_lite")


class EvalOnlyTrainer(BuiltRun):
    """The config's model loaded from a checkpoint (``--resume``'s, else ``train.load_weight``) to be evaluated.

    Without ``data_loader_fn`` the config's loaders give the valid and test splits (``test()``). With it,
    ``data_loader_fn(trainer)`` builds the one loader to evaluate (``test_loader``; None for an evaluator that
    reads its own data), the config's data is never opened and the model's vocabulary is as padded as the
    checkpoint's. With ``write_output`` False nothing is written anywhere.
    """

    evaluation_only = True

    def __init__(self, cfg, layout, data_loader_fn=None, *, resume: bool = False, run_dir: str | None = None,
                 verify: bool = True, write_output: bool = True):
        self._data_loader_fn, self._write_output = data_loader_fn, write_output
        super().__init__(cfg, layout, verify)
        self.resume_path = self.check_start(resume, run_dir or self.output_dir)
        self.consumed_samples = resume_position(self.resume_path)[0]
        self.valid_loader, self.test_loader = self.build_loaders(self.cfg.dataloader.train)
        self.check_data(self.valid_loader, self.test_loader)
        self.model = self.build_model(self.cfg.model)
        self.checkpointer = self.build_checkpointer(self.model)
        self.load_checkpoint()
        self._setup_output()

    def resolve(self, cfg):
        """The config resolved for evaluation; with a ``data_loader_fn`` no data of the config is counted and the
        model's vocabulary is the checkpoint's: a checkpoint padded otherwise than this config pads loads on any
        layout."""
        if self._data_loader_fn is None:
            return super().resolve(cfg)
        rows = checkpoint_vocab_rows(cfg, cfg.train.load_weight) if self.tokenizer is not None else None
        return resolve_run(cfg, self.layout.dims, self.tokenizer, vocab_rows=rows, data=False, eval_only=True)

    def build_loaders(self, node):
        """``(valid, test)``: the config's splits (its train loader is dropped unread), or ``(None,
        data_loader_fn(self))``."""
        if self._data_loader_fn is not None:
            return None, self._data_loader_fn(self)
        _, valid, test = super().build_loaders(node)
        return valid, test

    def load_checkpoint(self) -> None:
        """The weights evaluated: the ``--resume`` checkpoint's, else ``train.load_weight``'s."""
        path = self.resume_path or self.spec.checkpoint.load_weight
        if not path:
            raise UsageError("--eval-only needs weights: set train.load_weight=CHECKPOINT_DIR or add --resume")
        self.checkpointer.load(path, weights_only=True)
        logger.info(f"{'Resumed from' if self.resume_path else 'Loaded weights from'} {path}: its weights evaluated")

    def precheck_output_dir(self, output_dir: str) -> None:
        if self._write_output:
            super().precheck_output_dir(output_dir)

    def _setup_output(self) -> None:
        # Without an output folder the log stays on the console: no log.txt, config.yaml or lock anywhere.
        if self._write_output:
            super()._setup_output()

    def test(self) -> dict:
        """`--eval-only`: the evaluator on the valid and test splits and each `dataloader.test` loader."""
        eval_iter = self.spec.eval_iter
        splits = [("valid", self.valid_loader, eval_iter), ("test", self.test_loader, eval_iter)]
        return evaluate_splits(self.cfg.train.evaluation.evaluator, self.cfg.dataloader.get("test"), self.model,
                               splits, self.eval_context())


def checkpoint_vocab_rows(cfg, path: str) -> int | None:
    """Rows of the token embedding stored in the DCP checkpoint at `path` (None when it cannot tell)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from libai_lite.config import instantiate
    from libai_lite.layers import VocabEmbedding

    try:
        meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - the checkpointer reports a missing or corrupt checkpoint in one line
        return None
    with torch.device("meta"):
        model = instantiate(cfg.model)
    for name, module in model.named_modules():
        stored = meta.get(f"model.{name}.weight") if isinstance(module, VocabEmbedding) else None
        if stored is not None:
            return int(stored.size[0])
    return None
