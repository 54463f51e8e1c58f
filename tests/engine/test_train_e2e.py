"""End to end through tools/train_net.py and tools/train.sh, as a user runs them."""
import json
import math
import signal
import subprocess
import time

import numpy as np
import pytest

from tests.launch import CONFIG, DATA, ROOT, env, losses, one_error_line, tiny, train_cmd, train_net, train_sh


def test_training_writes_outputs_and_loss_falls(tmp_path):
    out = tmp_path / "run"
    r = train_net(tiny(out, tmp_path / "cache", "train.train_iter=40", "optim.lr=3e-3",
                       "train.checkpointer.period=20", "train.evaluation.eval_period=20"))
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("config.yaml", "log.txt", "metrics.json", "last_checkpoint", "model_0000019", "model_final", "model_best"):
        assert (out / name).exists(), name
    assert list(out.glob("events.out.tfevents.*"))
    curve = losses(out)
    assert sorted(curve) == list(range(1, 41))
    first, last = np.mean([curve[i] for i in range(1, 4)]), np.mean([curve[i] for i in range(38, 41)])
    assert last < first - 1.0, (first, last)
    log = (out / "log.txt").read_text()
    for field in ("iteration: 40/40", "consumed_samples: 320", "lr:", "grad_norm:", "samples/s:", "tokens/s:",
                  "TFLOP/s/rank:", "max_mem:", "eta:"):
        assert field in log, field
    # The saved config holds the values this run resolved (padded vocab, global batch); the accumulation it
    # inferred is in the header, left for a rerun to derive on its own data-parallel size.
    from libai_lite.config import LazyConfig

    saved = LazyConfig.load(str(out / "config.yaml"))
    assert saved.model.cfg.vocab_size == 8064
    assert saved.train.num_accumulation_steps is None and saved.train.global_batch_size is not None
    assert "x accumulation 2." in (out / "config.yaml").read_text().splitlines()[0]
    assert saved.dataloader.train.seq_length == 32
    rows = [json.loads(line) for line in open(out / "metrics.json")]
    assert any("valid/PPL" in row for row in rows)


@pytest.mark.slow  # tests/engine/test_crash_resume.py kills and resumes the job by default
def test_kill_9_then_resume_reproduces_losses(tmp_path):
    """SIGKILL mid-run, --resume, and every step after the checkpoint matches an uninterrupted run."""
    args = ["train.train_iter=30", "train.checkpointer.period=4", "train.evaluation.enabled=False"]
    ref = tmp_path / "ref"
    r = train_net(tiny(ref, tmp_path / "cache", *args))
    assert r.returncode == 0, r.stderr[-3000:]
    expected = losses(ref)

    out = tmp_path / "killed"
    cmd = train_cmd(tiny(out, tmp_path / "cache", *args))
    p = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if (out / "metrics.json").exists() and len(losses(out)) >= 10:
            break
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (out / "model_final").exists(), "the run finished before it could be killed"
    resumed_from = (out / "last_checkpoint").read_text().strip()
    start = int(resumed_from.split("_")[1]) + 1

    r = subprocess.run([*cmd, "--resume"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"Resumed from {out / resumed_from} at iteration {start}" in (out / "log.txt").read_text()
    got = losses(out)
    assert sorted(got) == sorted(expected)
    for it in range(start + 1, 31):
        assert got[it] == expected[it], (it, got[it], expected[it])


def test_load_weight_loads_and_refuses_other_shapes(tmp_path):
    src = tmp_path / "src"
    base = ["train.train_iter=2", "train.evaluation.enabled=False"]
    assert train_net(tiny(src, tmp_path / "cache", *base)).returncode == 0
    ok = train_net(tiny(tmp_path / "b", tmp_path / "cache", *base, f"train.load_weight={src / 'model_final'}"))
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "Loaded weights from" in ok.stdout
    bad_out = tmp_path / "c"
    bad = train_net(tiny(bad_out, tmp_path / "cache", *base, "model.cfg.hidden_size=32",
                         f"train.load_weight={src / 'model_final'}"))
    assert bad.returncode == 1
    assert "another model shape" in bad.stderr
    assert not bad_out.exists()


@pytest.mark.slow
def test_train_sh_two_processes_data_parallel_matches_one(tmp_path):
    """dp=2 through tools/train.sh and torchrun gives the one-process loss curve."""
    args = ["train.train_iter=4", "train.evaluation.enabled=False", "train.checkpointer.period=100",
            "model.cfg.attention_dropout_prob=0.0", "model.cfg.output_dropout_prob=0.0"]
    one = tmp_path / "one"
    r = train_net(tiny(one, tmp_path / "cache", *args))
    assert r.returncode == 0, r.stderr[-3000:]
    two = tmp_path / "two"
    r = train_sh(2, tiny(two, tmp_path / "cache", *args))
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for it in a:
        assert b[it] == pytest.approx(a[it], rel=1e-4, abs=1e-4)
    assert (two / "log.txt.rank1").exists()


# --eval-only's valid and test perplexities and --fast-dev-run's 20 iterations: tests/engine/test_no_overwrite.py,
# on a trained run they must leave untouched.
def test_eval_only_without_weights_is_refused(tmp_path):
    no_weights = train_net(tiny(tmp_path / "none", tmp_path / "cache") + ["--eval-only"])
    assert no_weights.returncode == 1
    assert "train.load_weight" in one_error_line(no_weights)


@pytest.mark.slow
def test_train_epoch(tmp_path):
    # A fifth of an epoch of the train split at 128 tokens per sample and 512 samples per step.
    out = tmp_path / "epoch"
    r = train_net(tiny(out, tmp_path / "cache", "train.train_iter=1", "train.train_epoch=0.2", "train.log_period=1000",
                       "train.evaluation.enabled=False", "model.cfg.max_seq_length=128", "train.global_batch_size=512",
                       "train.train_micro_batch_size=64"))
    assert r.returncode == 0, r.stderr[-3000:]
    from libai_lite.data.build import train_samples_per_epoch

    per_epoch = train_samples_per_epoch(str(ROOT / DATA), "949,50,1", 128)
    assert f"train.train_iter set to {math.ceil(0.2 * per_epoch / 512)}" in r.stdout


@pytest.mark.slow
def test_mt5_demo_validation_perplexity_falls(tmp_path):
    out = tmp_path / "mt5"
    r = train_net([f"train.output_dir={out}", f"dataloader.train.cache_dir={tmp_path / 'cache'}",
                   "train.dist.data_parallel_size=1", "train.dist.tensor_parallel_size=1",
                   "train.zero_optimization.enabled=False", "model.cfg.hidden_layers=2", "model.cfg.hidden_size=128",
                   "model.cfg.num_attention_heads=4", "model.cfg.head_size=32", "model.cfg.intermediate_size=256",
                   "dataloader.train.max_seq_length=128", "dataloader.train.num_workers=0",
                   "train.num_accumulation_steps=1", "train.train_micro_batch_size=8", "train.train_iter=40",
                   "train.train_epoch=0", "train.log_period=10", "train.evaluation.eval_period=10",
                   "train.evaluation.eval_iter=4", "optim.lr=1e-3"], config="projects/MT5/configs/mt5_pretrain.py")
    assert r.returncode == 0, r.stderr[-3000:]
    ppl = [json.loads(line)["valid/PPL"] for line in open(out / "metrics.json") if "valid/PPL" in line]
    assert len(ppl) == 4
    assert ppl[-1] < ppl[0] * 0.5, ppl
    lines = [line for line in (out / "log.txt").read_text().splitlines() if "iteration: " in line]
    # Each metric once per log line (token_acc was once printed twice).
    assert lines and all(line.count("token_acc: ") == 1 for line in lines), lines[:2]


# With -m slow: tests/tools/test_slurm.py launches two "nodes" through train.sh by default.
@pytest.mark.slow
def test_two_node_launch_forms_one_job(tmp_path):
    """Two tools/train.sh launches with NODE=2 and NODE_RANK=0|1 on one machine train as dp=2."""
    from tests.launch import free_port

    out = tmp_path / "two_nodes"
    args = tiny(out, tmp_path / "cache", "train.train_iter=4", "train.evaluation.enabled=False")
    port = str(free_port())
    procs = [subprocess.Popen(["bash", "tools/train.sh", "tools/train_net.py", CONFIG, "1", *args], cwd=ROOT,
                              env=env(NODE="2", NODE_RANK=str(rank), ADDR="127.0.0.1", PORT=port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    assert "Rank 0 of 2; layout pp=1 dp=2 tp=1" in (out / "log.txt").read_text()
    assert sorted(losses(out)) == [1, 2, 3, 4]


def test_valid_and_test_splits_are_sized_as_megatron_sizes_them(tmp_path):
    # Megatron-LM: valid = (train_iters // eval_interval + 1) x eval_iters x global batch, test =
    # eval_iters x global batch; the sizes decide the epochs and so the order of every sample.
    cache = tmp_path / "cache"
    r = train_net(tiny(tmp_path / "out", cache, "train.train_iter=4", "train.evaluation.enabled=True",
                       "train.evaluation.eval_period=2", "train.evaluation.eval_iter=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    names = {p.name.split("_indexmap_")[0].rsplit("_", 1)[-1]: p.name.split("_indexmap_")[1].split("_")[0]
             for p in cache.glob("*_indexmap_*_desc.json")}
    assert names == {"train": f"{4 * 8}ns", "valid": f"{(4 // 2 + 1) * 2 * 8}ns", "test": f"{2 * 8}ns"}
