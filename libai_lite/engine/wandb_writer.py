"""Weights & Biases beside TensorBoard: the scalars of every ``metrics.json`` row and the resolved config.

Turned on by ``train.wandb.enabled=True``. ``mode="offline"`` needs no network: the run is written under
``OUTPUT_DIR/wandb/`` for ``wandb sync`` later. The W&B step is the training iteration, and ``--resume``
continues the W&B run whose id is kept in ``OUTPUT_DIR/wandb/run_id``.
"""
from __future__ import annotations

import logging
import os
import uuid

from ..run_sections import WandbSettings
from ..utils.errors import UsageError
from ..utils.files import atomic_write
from .writers import EventWriter

logger = logging.getLogger("libai_lite")

MODES = ("online", "offline", "disabled")
INSTALL = "pip install -e .[wandb] (or pip install wandb)"


def import_wandb():
    """The ``wandb`` module, or a one-line UsageError naming the install command."""
    try:
        import wandb
    except ImportError:
        raise UsageError(f"train.wandb.enabled=True needs the wandb package: {INSTALL}") from None
    return wandb


def check_wandb_options(mode: str):
    """The ``wandb`` module for a valid ``mode``, or a one-line UsageError."""
    if mode not in MODES:
        raise UsageError(f"train.wandb.mode must be one of {', '.join(map(repr, MODES))}, not {mode!r}")
    return import_wandb()


class WandbWriter(EventWriter):
    """A W&B run as one of the trainer's writers, also usable like TensorBoard's ``SummaryWriter``.
    Scalars given for one step are merged into one W&B history row.
    """

    def __init__(self, output_dir: str, config: dict | None = None, *, project: str = "libai_lite",
                 name: str | None = None, mode: str = "offline", resume: bool = False):
        wandb = check_wandb_options(mode)
        os.makedirs(output_dir, exist_ok=True)
        # A disabled run writes nothing, not even the id.
        run_id, resumed = self._run_id(output_dir, resume) if mode != "disabled" else (None, False)
        # W&B's console capture would wrap the streams the launcher filters for the one-line error.
        settings = wandb.Settings(console="off", save_code=False)
        try:
            self._run = wandb.init(project=project, name=name, mode=mode, dir=output_dir, config=config or {},
                                   settings=settings, id=run_id, resume="allow" if resumed else None)
        except Exception as e:  # wandb raises its own types for a missing login, no network, a bad project
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"W&B could not start a run ({first}); train.wandb.mode=offline writes it under "
                             f"the output directory with no network, for `wandb sync` later") from None
        if mode == "offline":
            logger.info(f"W&B run {run_id}{' (resumed)' if resumed else ''} written offline to "
                        f"{self._run.dir.rsplit(os.sep, 1)[0]} (upload with wandb sync)")

    @staticmethod
    def _run_id(output_dir: str, resume: bool) -> tuple[str, bool]:
        """``(id, resumed)``: the run id a resumed training kept, or a new one, recorded for the next resume."""
        os.makedirs(os.path.join(output_dir, "wandb"), exist_ok=True)
        path = os.path.join(output_dir, "wandb", "run_id")
        if resume and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                run_id = f.read().strip()
            if run_id:
                return run_id, True
        run_id = uuid.uuid4().hex[:8]  # W&B's own ids are 8 characters of [a-z0-9]
        atomic_write(path, lambda f: f.write(run_id + "\n"), mode="w")
        return run_id, False

    def write(self, iteration: int, scalars: dict) -> None:
        """One log row: every scalar of it at step ``iteration``, as ``metrics.json`` holds them."""
        for k, v in scalars.items():
            self.add_scalar(k, v, iteration)
        self.flush()

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        """Record ``tag`` at step ``global_step`` (the training iteration)."""
        # A step equal to the last one is merged into its row; W&B commits a row when a later step arrives.
        self._run.log({tag: float(value)}, step=int(global_step))

    def flush(self) -> None:
        """Nothing to do: W&B's service writes (or sends) the rows in the background."""

    def close(self) -> None:
        """Finish the run: the last row is committed and the run's files are complete."""
        if self._run is not None:
            self._run.finish()
            self._run = None
            # finish() can return before W&B's service has written the last records; teardown waits.
            import wandb

            wandb.teardown()


def build_wandb_writer(settings: WandbSettings | None, output_dir: str, resume: bool = False) -> WandbWriter | None:
    """The writer ``settings`` asks for on the main process, else None; ``resume`` continues the output
    directory's W&B run. Its config is the resolved ``output_dir/config.yaml``.
    """
    from ..utils.distributed import is_main_process

    if settings is None:
        return None
    # Every rank checks, so all of them stop on a bad setting, not rank 0 alone.
    check_wandb_options(settings.mode)
    if not is_main_process():
        return None
    import yaml

    path = os.path.join(output_dir, "config.yaml")
    config = None
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    return WandbWriter(output_dir, config, project=settings.project, name=settings.name, mode=settings.mode,
                       resume=resume)
