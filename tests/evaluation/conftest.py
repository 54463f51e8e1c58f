"""A tiny GPT checkpoint every evaluation test module shares (trained once per session)."""
import json
import sys

import pytest


@pytest.fixture(scope="package")
def trained(tmp_path_factory):
    """A tiny GPT trained 30 steps on the demo corpus, and every TASKS result of tools/evaluate.py on one process."""
    from tests.evaluation.test_evaluation import _tiny
    from tests.launch import python_tool, train_net

    tmp = tmp_path_factory.mktemp("eval_e2e")
    r = train_net(_tiny(tmp / "run", tmp / "cache") + ["train.train_iter=30", "optim.lr=3e-3",
                                                         "train.evaluation.enabled=False"])
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = tmp / "run" / "model_final"
    out = tmp / "single.json"
    r = python_tool([sys.executable, "tests/evaluation/test_evaluation.py", "worker", str(out), str(ckpt),
                     str(tmp / "ev"), str(tmp / "cache"), "single"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp, ckpt, json.loads(out.read_text())["single"]
