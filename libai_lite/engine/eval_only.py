"""A run set up to evaluate a checkpoint and nothing else: `tools/evaluate.py`, the lm-evaluation-harness adapter."""
from __future__ import annotations

import argparse
import os

from ..run_spec import resolve_run
from .default import DefaultTrainer


class EvalOnlyTrainer(DefaultTrainer):
    """`DefaultTrainer` set up for evaluation alone: the model from a checkpoint, no optimizer (and, as every
    evaluation-only trainer, no hooks).

    `data_loader_fn(trainer)` builds the one loader to evaluate (or returns None for an
    evaluator that reads its own data); the training data of the config is never opened.
    """

    def __init__(self, cfg, layout, data_loader_fn, verify: bool = True, write_output: bool = True):
        self._data_loader_fn, self._write_output = data_loader_fn, write_output
        super().__init__(cfg, layout, eval_only=True, verify=verify)

    def precheck_output_dir(self, output_dir: str) -> None:
        if self._write_output:
            super().precheck_output_dir(output_dir)

    def _setup_output(self) -> None:
        # Without an output folder the log stays on the console: no log.txt, config.yaml or lock anywhere.
        if self._write_output:
            super()._setup_output()

    def resolve(self, cfg):
        """The config resolved for evaluation alone (no training data counted), the model's vocabulary as padded as
        the checkpoint's embedding.

        A checkpoint may be padded otherwise than this config pads; its size wins, so any layout can
        evaluate it.
        """
        rows = checkpoint_vocab_rows(cfg, cfg.train.load_weight) if self.tokenizer is not None else None
        return resolve_run(cfg, self.layout.dims, self.tokenizer, vocab_rows=rows, data=False, eval_only=True)

    def build_loaders(self, cfg):
        # The config's training data is never opened; the empty train loader only feeds the step runner.
        return [], None, self._data_loader_fn(self)

    def build_optimizer(self, cfg, model):
        return None

    def build_lr_scheduler(self, cfg, optimizer):
        return None


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


def build_eval_trainer(config_file: str, checkpoint: str, opts=(), *, subdir: str | None = "evaluate",
                       data_loader_fn=lambda trainer: None, verify: bool = True) -> EvalOnlyTrainer:
    """The config's model loaded from `checkpoint` on the layout the config and `opts` give.

    The log and config.yaml go to `<train.output_dir>/<subdir>`, beside the training run's; with `subdir`
    None nothing is written anywhere (the log goes to the console only). Training's
    global batch need not fit this layout: evaluation batches are `train.test_micro_batch_size` per
    data-parallel rank.
    """
    from ..config import LazyConfig
    from .launch import default_setup

    cfg = LazyConfig.load(config_file)
    cfg = LazyConfig.apply_overrides(cfg, list(opts or []))
    cfg.train.load_weight = checkpoint
    if subdir is not None:
        cfg.train.output_dir = os.path.join(cfg.train.output_dir, subdir)
    cfg.train.evaluation.enabled = False
    cfg.train.global_batch_size = None
    layout = default_setup(cfg, argparse.Namespace(fast_dev_run=False))
    return EvalOnlyTrainer(cfg, layout, data_loader_fn, verify=verify, write_output=subdir is not None)
