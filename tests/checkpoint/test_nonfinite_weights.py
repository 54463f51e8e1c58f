"""A checkpoint never holds NaN or inf weights: a save finds them with one reduction on each rank's device,
refuses on every rank in one line naming the last good checkpoint, and publishes nothing newer, so
``--resume`` picks up weights that can still train. Saved before, such weights trained on (or evaluated to
``PPL: nan``) and were labelled model_final."""
import math

import pytest
import torch

from tests.launch import one_error_line, tiny, torchrun, tree_hashes

LAYOUTS = {"1": (1, []), "dp2": (2, []), "tp2": (2, ["train.dist.tensor_parallel_size=2"]),
           "zero3": (2, ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=3"])}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_nonfinite_weight_is_never_checkpointed(tmp_path, layout):
    nproc, extra = LAYOUTS[layout]
    run = tmp_path / "run"
    args = tiny(run, tmp_path / "cache", "train.train_iter=12", "train.log_period=2", "train.checkpointer.period=4",
                "train.checkpointer.async_save=False", "train.evaluation.enabled=False", *extra)
    # Poisoned on the last rank by the step of iteration 7, whose loss is finite: its checkpoint is refused.
    r = torchrun(nproc, "tests/workers/nan_weight_worker.py", 7, nproc - 1, "nan", *args, check=False)
    assert r.returncode != 0, r.stderr[-2000:]
    line = one_error_line(r)
    assert "is NaN or inf" in line and "model_0000007 was not saved" in line, line
    assert f"the last good checkpoint is {run / 'model_0000003'}" in line and "--resume from it" in line, line
    if nproc > 1:
        assert f"on rank {nproc - 1}" in line, line
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("model_")) == ["model_0000003"]
    assert (run / "last_checkpoint").read_text().strip() == "model_0000003"


def test_the_final_checkpoint_of_a_run_whose_weights_went_inf_is_refused(tmp_path):
    run = tmp_path / "run"
    args = tiny(run, tmp_path / "cache", "train.train_iter=4", "train.log_period=2", "train.checkpointer.period=0",
                "train.checkpointer.async_save=False", "train.evaluation.enabled=False")
    r = torchrun(1, "tests/workers/nan_weight_worker.py", 3, 0, "inf", *args, check=False)
    line = one_error_line(r)
    assert r.returncode != 0 and "model_final was not saved and no earlier checkpoint was saved" in line, line
    assert "train again" in line, line
    assert not any(p.name.startswith("model_") for p in run.iterdir())


def test_the_check_reads_once_and_names_the_weight():
    from libai_lite.checkpoint.finite import first_nonfinite_weight

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2, dtype=torch.float64))
    model.register_parameter("empty", torch.nn.Parameter(torch.empty(0)))
    assert first_nonfinite_weight([model]) == ""
    with torch.no_grad():
        model[1].bias[1] = -math.inf
    assert first_nonfinite_weight([model]) == "1.bias"
