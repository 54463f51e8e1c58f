"""From the command line to a running job: ``default_setup``, ``launch`` and the one-line errors every tool shares."""
from __future__ import annotations

import logging
import os
import random
import sys
from types import SimpleNamespace

import numpy as np
import torch

from ..config import InstantiationError, LazyConfig
from ..config.validate import check_sections, check_targets
from ..run_sections import check_settings
from ..utils.distributed import (Layout, describe_collective_timeout, describe_out_of_memory, describe_worker_death,
                                 destroy, is_collective_timeout, setup_dist)
from ..utils.parallel_dims import describe_capping
from ..utils.errors import UsageError
from ..utils.logger import setup_logger
from ..utils.process import die_with_launcher, install_stop_signals, release_locks

logger = logging.getLogger("libai_lite")


def default_setup(cfg, args) -> Layout:
    """Process group, mesh, seeds and logger for a run; returns its ``Layout``. ``cfg`` is only read.
    Nothing is written to disk, so a run refused later for bad input leaves no trace.
    """
    if getattr(args, "fast_dev_run", False):
        cfg = LazyConfig.apply_overrides(cfg, ["train.train_epoch=0", "train.train_iter=20", "train.log_period=1",
                                               "train.evaluation.eval_period=10", "train.evaluation.eval_iter=2",
                                               "train.checkpointer.period=10"])
    # Every numeric setting against its range before any of them is used (or quietly replaced), and every
    # _target_ against what is installed.
    check_settings(cfg)
    check_targets(cfg)
    # The evaluator runs after the first eval_period of training, or at its end: checked before either.
    if getattr(args, "eval_only", False) or (cfg.train.get("evaluation") or {}).get("enabled", False):
        from ..evaluation.evaluator import check_evaluator

        check_evaluator(cfg.train.evaluation.get("evaluator"))
    layout = setup_dist(cfg.train.dist, cfg.train.get("zero_optimization"), cfg.train.get("output_dir"))
    capped = describe_capping(layout.world_size, cfg.train.dist)
    setup_logger(layout.rank)
    if capped:
        logger.warning(capped)
    # Every rank seeds alike so model init is identical; data order comes from the sampler.
    seed = int(cfg.train.seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    logger.info(f"Command line: {' '.join(sys.argv)}")
    logger.info(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    return layout


FAST_DEV_RUN_DIR, EVAL_ONLY_DIR = "fast_dev_run", "eval_only"


def own_output_dir(cfg, args) -> str | None:
    """Point ``train.output_dir`` of a ``--fast-dev-run`` or ``--eval-only`` at a folder of its own inside it;
    return the run folder whose ``last_checkpoint`` ``--resume`` reads (None: ``train.output_dir`` as it now is).

    Neither writes over the run it is pointed at: a fast dev run trains in ``<output_dir>/fast_dev_run`` and
    an evaluation logs to ``<output_dir>/eval_only``, where ``--resume`` evaluates the run's last checkpoint.
    """
    run_dir = cfg.train.get("output_dir")
    eval_only, fast = getattr(args, "eval_only", False), getattr(args, "fast_dev_run", False)
    if not (eval_only or fast) or not run_dir or not str(run_dir).strip():
        return None  # an empty output_dir is refused by the trainer's precheck, naming the key
    own, flag = (EVAL_ONLY_DIR, "--eval-only") if eval_only else (FAST_DEV_RUN_DIR, "--fast-dev-run")
    cfg.train.output_dir = os.path.join(str(run_dir), own)
    logger.info(f"{flag} writes to {cfg.train.output_dir}, a folder of its own: nothing else in {run_dir} is written")
    return str(run_dir) if eval_only else None


def write_eval_results(output_dir: str, results: dict, checkpoint) -> str:
    """``--eval-only``'s ``results.json`` in its own folder (rank 0); returns its path."""
    import json

    from ..utils.files import atomic_write

    path = os.path.join(output_dir, "results.json")
    record = {"checkpoint": checkpoint, "results": {k: float(v) for k, v in results.items()}}
    try:
        atomic_write(path, lambda f: f.write(json.dumps(record, indent=2) + "\n"), mode="w", fsync=False)
    except OSError as e:
        # The results are in log.txt already; nothing to resume, only the file to write again.
        raise UsageError(f"cannot write {path}: {e.strerror or e}; free space there or choose another "
                         f"train.output_dir, then evaluate again") from e
    return path


def _find_user_error(exc: BaseException | None):
    """The most specific user error in `exc`'s cause chain (an InstantiationError only if nothing better)."""
    # An InstantiationError is a config-built object refusing its arguments: a config problem.
    found = []
    while exc is not None and len(found) < 10:
        if isinstance(exc, (UsageError, FileNotFoundError, FloatingPointError, InstantiationError)):
            found.append(exc)
        exc = exc.__cause__
    specific = [e for e in found if not isinstance(e, InstantiationError)]
    return (specific or found or [None])[0]


def report_cli_error(exc: Exception) -> int:
    """For a command-line tool's ``except`` block: print the one ``error:`` line and return 1, or re-raise.

    A user error is printed by global rank 0 only. A collective timeout is rank-local, so every rank that
    gave up prints it and exits at once rather than wait in teardown. Anything else, or
    ``LIBAI_LITE_TRACEBACK=1``, re-raises.
    """
    if os.environ.get("LIBAI_LITE_TRACEBACK"):
        raise exc
    e = _find_user_error(exc)
    # Both rank-local: the rank it happened on says it. A dead worker's error can carry a timeout in its chain.
    try:
        death = (describe_worker_death(exc) or describe_out_of_memory(exc)) if e is None else None
    except RuntimeError as late:
        # torch's SIGCHLD handler raises wherever the process is: a second worker's death lands in this report.
        if describe_worker_death(late) is None:
            raise
        death = describe_worker_death(late)
    if death is not None:
        print(f"error: {death}", file=sys.stderr, flush=True)
        return 1
    if e is None and is_collective_timeout(exc):
        print(f"error: {describe_collective_timeout(exc)}", file=sys.stderr, flush=True)
        os._exit(1)
    if e is None:
        raise exc
    msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    if isinstance(e, FileNotFoundError) and e.filename and str(e.filename) not in msg:
        msg = f"{msg}: {e.filename}"
    if isinstance(e, InstantiationError):
        msg += " (LIBAI_LITE_TRACEBACK=1 shows the traceback)"
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {msg}", file=sys.stderr, flush=True)
    return 1


def build_eval_trainer(config_file: str, checkpoint: str, opts=(), *, subdir: str | None = "evaluate",
                       data_loader_fn=lambda trainer: None, verify: bool = True):
    """The config's model loaded from `checkpoint` on the layout the config and `opts` give.

    The log and config.yaml go to `<train.output_dir>/<subdir>`, beside the training run's; with `subdir`
    None nothing is written anywhere (the log goes to the console only). Training's
    global batch need not fit this layout: evaluation batches are `train.test_micro_batch_size` per
    data-parallel rank.
    """
    from .eval_only import EvalOnlyTrainer

    cfg = LazyConfig.load(config_file)
    cfg = LazyConfig.apply_overrides(cfg, list(opts or []))
    cfg.train.load_weight = checkpoint
    if subdir is not None:
        cfg.train.output_dir = os.path.join(cfg.train.output_dir, subdir)
    cfg.train.evaluation.enabled = False
    cfg.train.global_batch_size = None
    layout = default_setup(cfg, SimpleNamespace(fast_dev_run=False))
    return EvalOnlyTrainer(cfg, layout, data_loader_fn, verify=verify, write_output=subdir is not None)


def launch(args, notes=()) -> int:
    """What `tools/train_net.py` runs: load, override, set up, then train or evaluate; `notes` are logged
    once the logger is set up (what a tool translating another framework's settings has to say).

    Bad input ends the process with one `error:` line on stderr and exit status 1; a run stopped by a signal
    returns 128 + that signal once its checkpoint is saved; a job restarted by torchrun (MAX_RESTARTS) resumes
    from its last checkpoint on its own.
    """
    from ..checkpoint.trainer_state import RunAlreadyFinished
    from .default import DefaultTrainer
    from .eval_only import EvalOnlyTrainer

    # Before training a stop signal ends the process through `finally`, releasing the lock.
    install_stop_signals()
    die_with_launcher()
    try:
        cfg = LazyConfig.load(args.config_file)
        check_sections(cfg, args.config_file)
        cfg = LazyConfig.apply_overrides(cfg, args.opts)
        check_sections(cfg, args.config_file)
        resume = args.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        layout = default_setup(cfg, args)
        for note in notes:
            logger.warning(note)
        run_dir = own_output_dir(cfg, args)
        verify = not getattr(args, "no_verify", False)
        if args.eval_only:
            trainer = EvalOnlyTrainer(cfg, layout, resume=resume, run_dir=run_dir, verify=verify)
            results = trainer.test()
            if layout.rank == 0:
                path = write_eval_results(trainer.output_dir, results,
                                          trainer.resume_path or trainer.spec.checkpoint.load_weight)
                logger.info(f"Evaluation results saved to {path}")
        else:
            trainer = DefaultTrainer(cfg, layout, resume=resume, verify=verify, run_dir=run_dir,
                                     replace_run=getattr(args, "fast_dev_run", False))
            signum = trainer.train()
            if signum:
                # Saved and stopped on request: the status of a process that signal ended, however it was
                # started, so a scheduler (a Kubernetes Job, Slurm's requeue) does not take the run for finished.
                return 128 + signum
        return 0
    except RunAlreadyFinished as e:
        if args.resume:
            return report_cli_error(e)
        # torchrun restarted a worker that failed after the run's last save (in its teardown): nothing is left to do.
        logger.info(f"Restarted after the run had finished: {e}")
        return 0
    except Exception as e:  # noqa: BLE001 - user errors arrive wrapped by instantiate; find them
        return report_cli_error(e)
    finally:
        release_locks()
        destroy()
