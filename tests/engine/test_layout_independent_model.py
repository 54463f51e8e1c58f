"""One config builds one model whatever the layout: the shipped demo's padded vocabulary does not depend
on tensor_parallel_size, so a one-process run resumes at tp=2 and at pp=2 on its uninterrupted curve, a
fresh tp=2 run starts at the one-process loss, and a checkpoint padded the old way (8192 rows at tp=2)
still loads. No tokenization.make_vocab_size_divisible_by override anywhere here: the demo as shipped."""
import json
import shutil

import pytest

from tests.launch import losses, tiny, train_net, train_ranks

STEPS = 4
# Overrides that shrink the run but not the vocabulary (tiny() changes no tokenization key).
ARGS = [f"train.train_iter={STEPS}", "train.evaluation.enabled=False", "train.checkpointer.period=2",
        "model.cfg.attention_dropout_prob=0.0", "model.cfg.output_dropout_prob=0.0"]
# float32 losses of ~9 summed over 8064 logits in another order (sharded softmax, stages): a few
# ulps per reduction level, amplified by 2 Adam steps at lr 1.5e-3; the layout tests allow the same.
REL = 2e-4


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    r = train_net(tiny(tmp / "run", tmp / "cache", *ARGS))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "vocab padded to 8064" in r.stdout + r.stderr + (tmp / "run" / "log.txt").read_text()
    curve = losses(tmp / "run")
    assert sorted(curve) == list(range(1, STEPS + 1))
    return tmp / "run", tmp / "cache", curve


def _resume_at(tmp_path, one_process, nproc, layout):
    """The one-process run's copy resumed from its iteration-2 checkpoint under ``layout``."""
    src, cache, _ = one_process
    out = tmp_path / "run"
    shutil.copytree(src, out)
    (out / "last_checkpoint").write_text("model_0000001")
    with open(out / "metrics.json") as f:
        rows = [line for line in f if json.loads(line)["iteration"] <= 2]
    (out / "metrics.json").write_text("".join(rows))
    r = train_ranks(nproc, tiny(out, cache, *ARGS, *layout) + ["--resume"])
    assert r.returncode == 0, r.stderr[-4000:]
    log = (out / "log.txt").read_text()
    assert "vocabulary rows" not in log  # the same model: nothing cut or added
    return losses(out)


def test_fresh_tp2_starts_at_and_resume_at_tp2_continues_the_one_process_curve(tmp_path, one_process):
    _, cache, reference = one_process
    fresh = tmp_path / "fresh"
    r = train_ranks(2, tiny(fresh, cache, *ARGS, "train.train_iter=1", "train.dist.tensor_parallel_size=2"))
    assert r.returncode == 0, r.stderr[-4000:]
    assert "vocab padded to 8064" in (fresh / "log.txt").read_text()
    assert losses(fresh)[1] == pytest.approx(reference[1], rel=REL)

    curve = _resume_at(tmp_path, one_process, 2, ["train.dist.tensor_parallel_size=2"])
    for it in range(3, STEPS + 1):
        assert curve[it] == pytest.approx(reference[it], rel=REL), it


@pytest.mark.slow
def test_resume_at_pp2_continues_the_one_process_curve(tmp_path, one_process):
    curve = _resume_at(tmp_path, one_process, 2, ["train.dist.pipeline_parallel_size=2"])
    for it in range(3, STEPS + 1):
        assert curve[it] == pytest.approx(one_process[2][it], rel=REL), it


# With -m slow: tests/checkpoint/test_vocab_rows.py loads such checkpoints in one process, in seconds.
@pytest.mark.slow
def test_checkpoint_padded_the_old_way_resumes_with_padding_rows_cut(tmp_path, one_process):
    """A run that padded to 8192 rows (what tp=2 built before) resumes where 8064 are built now: the
    padding rows are cut at load with one log line, the real ids' rows kept."""
    _, cache, _ = one_process
    out = tmp_path / "old"
    r = train_net(tiny(out, cache, *ARGS, "train.train_iter=2", "tokenization.make_vocab_size_divisible_by=256"))
    assert r.returncode == 0, r.stderr[-3000:]
    r = train_net(tiny(out, cache, *ARGS, "train.train_iter=3") + ["--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    log = (out / "log.txt").read_text()
    assert "has 8192 vocabulary rows where this config builds 8064" in log
    assert "padding rows cut at load" in log
    curve = losses(out)
    assert sorted(curve) == [1, 2, 3] and curve[3] < curve[1]
