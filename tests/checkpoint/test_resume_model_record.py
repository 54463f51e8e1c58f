"""A checkpoint records the model.cfg it was trained with, and --resume with another model is refused naming the
key: another head count or activation has the same tensor shapes, so the weights loaded and trained on as a
different model. ``train.resume_model_changes`` allows a deliberate change."""
import json

import pytest

from tests.launch import one_error_line, tiny, train_ranks, tree_hashes


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("record")
    out = tmp / "run"
    args = tiny(out, tmp / "cache", "train.train_iter=4", "train.checkpointer.period=2",
                "train.evaluation.enabled=False", "train.log_period=2")
    r = train_ranks(2, args)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, tmp


def test_a_checkpoint_records_its_model_config(run):
    out, _ = run
    state = json.loads((out / "model_final" / "trainer_state.json").read_text())
    assert state["model_config"]["num_attention_heads"] == 2 and state["model_config"]["activation"] == "gelu_tanh"


@pytest.mark.parametrize("change,key", [("model.cfg.num_attention_heads=4", "num_attention_heads"),
                                        ("model.cfg.activation=relu", "activation")])
def test_resume_with_another_model_of_the_same_shapes_is_refused(run, change, key):
    out, tmp = run
    before = tree_hashes(out)
    args = tiny(out, tmp / "cache", "train.train_iter=8", "train.checkpointer.period=2",
                "train.evaluation.enabled=False", "train.log_period=2", change)
    r = train_ranks(2, ["--resume", *args])
    line = one_error_line(r)
    assert r.returncode != 0 and f"--resume: model.cfg.{key}=" in line, line
    assert f"train.resume_model_changes=[{key}]" in line, line
    assert tree_hashes(out) == before


def test_a_deliberate_change_resumes(run, tmp_path):
    import shutil

    out, tmp = run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    args = tiny(copy, tmp / "cache", "train.train_iter=6", "train.checkpointer.period=2",
                "train.evaluation.enabled=False", "train.log_period=2", "model.cfg.activation=relu",
                "train.resume_model_changes=[activation]")
    r = train_ranks(1, ["--resume", *args])
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((copy / "model_final" / "trainer_state.json").read_text())["model_config"]["activation"] == "relu"
