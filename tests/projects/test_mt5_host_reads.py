"""An MT5 (and a T5 mixture-of-experts) training step reads nothing back from the device, as a GPT step
(tests/engine/test_host_reads.py): the span-corruption batch, relative position buckets, the T5 loss
with its token accuracy, the router's dispatch, clipping and the trainer's metrics all stay on the
device until the log period. Counted in one process, in this process, with the same dispatch-mode
counter (tests/workers/host_read_worker.py) on the real ``DefaultTrainer`` of the shipped recipes, the
optimizer's own step left out (torch's CPU fused AdamW reads each parameter's step counter inside its
kernel; its CUDA kernel does not)."""
import logging
from types import SimpleNamespace

import pytest

STEPS = LOG_PERIOD = 2
TINY = [
    "model.cfg.hidden_layers=2", "model.cfg.hidden_size=64", "model.cfg.num_attention_heads=4",
    "model.cfg.head_size=16", "model.cfg.intermediate_size=128", "dataloader.train.max_seq_length=64",
    "dataloader.train.num_workers=0", "train.train_micro_batch_size=2", "train.global_batch_size=null",
    "train.train_epoch=0", f"train.train_iter={STEPS}", f"train.log_period={LOG_PERIOD}",
    "train.evaluation.enabled=False", "train.checkpointer.period=1000", "train.log_memory_estimate=False",
    "tokenization.make_vocab_size_divisible_by=256",
]
CONFIGS = {
    # The recipe as shipped otherwise: bf16 autocast, ZeRO-2 (the plain model at dp 1), tp 2 capped to 1,
    # and accumulation (two micro-batches per step here).
    "mt5_pretrain": ("projects/MT5/configs/mt5_pretrain.py", ["train.num_accumulation_steps=2"]),
    # Every other feed-forward layer 4 experts, top-2 at capacity factor 1.25: the router's counts and
    # dispatch on the device.
    "t5_moe": ("projects/MT5/configs/t5_moe.py", ["train.num_accumulation_steps=1"]),
}


def _train_counting(config: str, overrides: list[str]) -> dict:
    from libai_lite.config import LazyConfig
    from libai_lite.engine.default import DefaultTrainer
    from libai_lite.engine.launch import default_setup
    from libai_lite.utils.distributed import destroy
    from tests.workers.host_read_worker import HostReadCounter, count_log_reads, count_run_step

    # default_setup takes over the "libai_lite" logger (no propagation): give it back to later tests.
    log = logging.getLogger("libai_lite")
    saved = (list(log.handlers), log.level, log.propagate)
    cfg = LazyConfig.apply_overrides(LazyConfig.load(config), overrides)
    try:
        job = DefaultTrainer(cfg, default_setup(cfg, SimpleNamespace()))
        counter, record = HostReadCounter(), {}
        count_run_step(job.trainer, counter, record)
        count_log_reads(job.trainer, counter, record)
        job.train()
        return record
    finally:
        destroy()
        for h in list(log.handlers):
            log.removeHandler(h)
        log.handlers[:], log.level, log.propagate = saved


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_host_reads_in_an_mt5_training_step(tmp_path, name):
    config, extra = CONFIGS[name]
    record = _train_counting(config, [f"train.output_dir={tmp_path / 'out'}",
                                      f"dataloader.train.cache_dir={tmp_path / 'cache'}", *TINY, *extra])
    assert sorted(record["steps"]) == list(range(STEPS))
    for it, reads in record["steps"].items():
        assert reads == [], f"iteration {it}: {len(reads)} host reads in run_step: {reads}"
    # The hooks read nothing between log lines; a log line makes the trainer's two batched reads.
    for it, hooks in record["hooks"].items():
        logging_step = (it + 1) % LOG_PERIOD == 0
        assert hooks == {"reads": [], "tolist": 2 if logging_step else 0}, f"iteration {it}: {hooks}"
