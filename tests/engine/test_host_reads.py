"""A training step reads nothing back from the device: every read (``float(t)``, ``.item()``, a boolean
mask) stalls a GPU's launch queue. Counted on the CPU with bench/host_reads.py's
``TorchDispatchMode`` (driven by tests/workers/host_read_worker.py) in the real trainer with its hooks,
for one process and under tp=2, pp=2 and ZeRO-3; the log period reads the interval's values in a small fixed
number of batches. The branches only a CUDA run takes (the GPU loss kernel, bf16 autocast, fused AdamW)
are taken on the CPU too, with the device-only choices stubbed."""
import json

import pytest

from tests.launch import tiny, torchrun

STEPS, LOG_PERIOD = 6, 3
LAYOUTS = {
    "one_process": (1, []),
    "tp2": (2, ["train.dist.tensor_parallel_size=2"]),
    "pp2": (2, ["train.dist.pipeline_parallel_size=2"]),
    "zero3": (2, ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=3"]),
}


def _run(tmp_path, nproc: int, extra: list[str]) -> list[dict]:
    out = tmp_path / "reads"
    args = tiny(tmp_path / "run", tmp_path / "cache", f"train.train_iter={STEPS}", f"train.log_period={LOG_PERIOD}",
                "train.evaluation.enabled=False", "train.checkpointer.period=1000", *extra)
    torchrun(nproc, "tests/workers/host_read_worker.py", out, *args)
    return [json.loads((tmp_path / f"reads.rank{r}.json").read_text()) for r in range(nproc)]


# tp=2 runs with -m slow so the default suite stays under 15 minutes on 2 cores; one process, pp=2 and
# ZeRO-3 run by default.
@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.slow) if k == "tp2" else k for k in LAYOUTS])
def test_no_host_reads_in_a_training_step(tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    for rank, record in enumerate(_run(tmp_path, nproc, extra)):
        assert sorted(map(int, record["steps"])) == list(range(STEPS))
        for it, reads in record["steps"].items():
            if layout == "pp2" and it == "0":
                # torch's pipelining infers the stages' shapes on its first step, once: a few reads,
                # all inside its schedule (the innermost frame of ours is the schedule's call).
                assert all(r.split(" at ")[1].startswith("pipeline.py:") for r in reads), reads
                continue
            assert reads == [], f"rank {rank}, iteration {it}: {len(reads)} host reads in run_step: {reads}"
        # Between log lines the hooks read nothing either; a log line reads the trainer's skip
        # decisions and then the interval's values, one batch each (the rest is the dp reduction's).
        for it, hooks in record["hooks"].items():
            logging = (int(it) + 1) % LOG_PERIOD == 0
            if not logging:
                # Over several ranks the stop-signal agreement (SignalCheckpointer) all-reduces a flag
                # every step; with gloo that is a host tensor's tolist, no device read.
                assert hooks == {"reads": [], "tolist": int(nproc > 1)}, \
                    f"rank {rank}, iteration {it} (no log line): {hooks}"
            else:
                # Two batched reads, plus over several ranks the dp reduction's, the signal agreement's and
                # the straggler watch's gather of host step times (a gloo host tensor, no device read).
                assert hooks["reads"] == [] and hooks["tolist"] <= 2 + 3 * (nproc > 1), \
                    f"rank {rank}, iteration {it}: {hooks}"
                if layout == "one_process":
                    assert hooks == {"reads": [], "tolist": 2}, f"rank {rank}, iteration {it}: {hooks}"


def test_a_nonfinite_step_is_skipped_on_the_device_and_counted_at_the_log_period():
    """fp32 with fused AdamW: a NaN/inf step leaves the parameters, the optimizer state and (once read)
    the schedule as they were, without a read in the step; the read at the log period counts it and
    raises past train.max_skipped_nonfinite."""
    import torch

    from libai_lite.engine.trainer import Trainer
    from libai_lite.model import LOSS
    from libai_lite.utils.events import EventStorage
    from bench.host_reads import HostReadCounter

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def forward(self, x):
            return {"loss": (self.w * x).sum()}

    xs = [1.0, float("nan"), 2.0, float("inf")]
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    trainer = Trainer(model, [{"x": torch.full((2,), x)} for x in xs], opt, sched, metrics={"loss": LOSS},
                      max_skipped_nonfinite=1)
    trainer.storage, counter, weights = EventStorage(), HostReadCounter(), []
    for i in range(3):
        trainer.iter = i
        trainer.storage.begin(i)
        with counter:
            trainer.run_step()
        weights.append(model.w.detach().clone())
    assert counter.reads == []
    torch.testing.assert_close(weights[1], weights[0], rtol=0, atol=0)  # the NaN step changed nothing
    assert not torch.equal(weights[2], weights[1])
    assert int(opt.state[model.w]["step"]) == 2
    # Not read yet: the schedule advanced over the skipped step, and nothing was counted.
    assert trainer.skipped_nonfinite == 0 and sched.last_epoch == 3
    trainer.check_skipped()
    # Counted, and the schedule moved back: two steps taken, the lr of iteration 2.
    assert trainer.skipped_nonfinite == 1 and sched.last_epoch == 2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 / 3)
    trainer.iter = 3
    trainer.storage.begin(3)
    trainer.run_step()  # decided on the device: nothing raised here
    with pytest.raises(FloatingPointError, match="loss is inf at iteration 3: training diverged"):
        trainer.check_skipped()
    torch.testing.assert_close(model.w.detach(), weights[2], rtol=0, atol=0)


def test_fp16_overflow_skips_are_decided_on_the_device_and_read_at_the_log_period(caplog):
    """fp16 loss scaling with fused AdamW: the overflowed steps are skipped without a read in the
    step; the read at the log period warns with the scales and moves the schedule back over them."""
    import logging

    import torch

    from libai_lite.engine.trainer import Trainer
    from libai_lite.model import LOSS
    from libai_lite.utils.events import EventStorage, read_scalars
    from bench.host_reads import HostReadCounter

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def forward(self, x):
            return {"loss": (self.w * x).sum()}

    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    # Gradients of 4 x scale: inf at 2**127 and 2**126 (fp32 ends below 2**128), finite at 2**125.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=1000)
    trainer = Trainer(model, [{"x": torch.full((2,), 4.0)}], opt, sched, metrics={"loss": LOSS}, grad_scaler=scaler)
    trainer.storage, counter, weights, rows = EventStorage(), HostReadCounter(), [], []
    for i in range(3):
        trainer.iter = i
        trainer.storage.begin(i)
        with counter:
            trainer.run_step()
        weights.append(model.w.detach().clone())
        rows.append(trainer.storage.latest())
    assert counter.reads == []
    assert torch.equal(weights[0], torch.ones(2)) and torch.equal(weights[1], torch.ones(2))
    assert not torch.equal(weights[2], weights[1])
    assert [(r["skipped"], r["loss_scale"]) for r in read_scalars(rows)] == [(1.0, 2.0**126), (1.0, 2.0**125),
                                                                            (0.0, 2.0**125)]
    assert sched.last_epoch == 3
    with caplog.at_level(logging.WARNING, logger="libai_lite"):
        trainer.check_skipped()
    assert "fp16 overflow at iteration 1: step skipped, loss scale 8.50706e+37 -> 4.25353e+37" in caplog.text
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == pytest.approx(0.1 / 2)


@pytest.mark.parametrize("kernel", ["plain", "chunked"])
def test_the_cuda_branches_of_a_step_read_nothing(monkeypatch, kernel):
    """The path a CUDA run takes, run on the CPU with its device-only choices stubbed: the LM head + loss
    as CUDA selects it (plain logits and cross entropy where they fit, else the compiled chunked kernel
    behind its fallback guard; not Liger's kernel,
    which reads ``target_mask.sum().item()`` twice a micro-batch, even where Liger is installed), bf16
    autocast, two accumulated micro-batches and fused AdamW, which skips a non-finite step on the device.
    No host read in any step, the guard's first use included."""
    import torch

    from libai_lite.engine.trainer import Trainer
    from libai_lite.layers import fused_linear_ce as flce
    from libai_lite.layers import loss as loss_mod
    from libai_lite.model import output_metrics
    from libai_lite.utils.events import EventStorage
    from bench.host_reads import HostReadCounter
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    cuda = torch.device("cuda", 0)
    monkeypatch.delenv(flce.KERNEL_ENV, raising=False)
    monkeypatch.setattr(flce, "liger_available", lambda: True)
    # The device's memory as an 80 GB GPU's, with this tiny head's share set below or above it: both CUDA rules.
    monkeypatch.setattr(flce, "_device_memory", lambda index: 80 << 30)
    monkeypatch.setattr(flce, "PLAIN_LOGITS_SHARE", 1.0 if kernel == "plain" else 1e-12)
    monkeypatch.setattr(loss_mod, "select_kernel", lambda device, vocab_parallel, **kw: flce.select_kernel(
        cuda, vocab_parallel, **kw))
    # A dispatch mode sees a compiled function's ops run one by one (dynamo does not compile under it): the
    # kernels' own ops, as these run them.
    monkeypatch.setattr(flce, "_compile", lambda fn, backend: fn)
    flce.chunk_kernel.cache_clear()
    kernels, gpu_loss = [], loss_mod.gpu_linear_cross_entropy

    def spy(kernel, *args, **kwargs):
        kernels.append(kernel)
        return gpu_loss(kernel, *args, **kwargs)

    monkeypatch.setattr(loss_mod, "gpu_linear_cross_entropy", spy)
    torch.manual_seed(0)
    model = GPTForPreTraining(dict(hidden_layers=2, vocab_size=128, hidden_size=32, ffn_hidden_size=64,
                                   num_attention_heads=4, max_seq_length=16))
    ids = torch.randint(0, 128, (8, 2, 17), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in ids]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    trainer = Trainer(model, data, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0), output_metrics(model),
                      num_accumulation_steps=2, amp_dtype=torch.bfloat16)
    trainer.storage, counter = EventStorage(), HostReadCounter()
    try:
        for i in range(3):
            trainer.iter = i
            trainer.storage.begin(i)
            counter.reset()
            with counter:
                trainer.run_step()
            assert counter.reads == [], f"iteration {i}: {counter.reads}"
        assert kernels == [kernel] * 6
        assert not any(flce.chunk_kernel(fn, "inductor").fell_back
                       for fn in (flce._forward_chunk, flce._backward_chunk))
    finally:
        flce.chunk_kernel.cache_clear()
