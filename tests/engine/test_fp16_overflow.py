"""fp16 from Megatron's initial loss scale (2^32) overflows its first steps: each overflowing step must change no
weight, no optimizer state and (once read back at the log period) no schedule position on any rank, whatever the
wrapping, and training goes on with finite, falling losses. The ranks' overflow flags once were summed, and fused
AdamW given a flag of 2 applies the inf gradients: every weight NaN from the first overflow on, exit 0."""
import json
import math

import pytest

from tests.launch import losses, tiny, torchrun

STEPS = 40
LAYOUTS = {
    "dp2": [],
    "tp2": ["train.dist.tensor_parallel_size=2"],
    "pp2": ["train.dist.pipeline_parallel_size=2"],
    "zero2": ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=2"],
    "zero3": ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=3"],
    "zero1": ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=1"],
    "zero1_offload": ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=1",
                      "train.zero_optimization.offload=True"],
    "zero3_offload": ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=3",
                      "train.zero_optimization.offload=True"],
    "moe_ep2": ["model.cfg.moe.enabled=True", "model.cfg.moe.num_experts=4", "model.cfg.moe.top_k=1",
                "model.cfg.moe.ep_size=2", "model.cfg.moe.every_n_layers=2"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp16_overflow_skips_change_nothing_and_training_recovers(tmp_path, layout):
    run = tmp_path / "run"
    args = tiny(run, tmp_path / "cache", f"train.train_iter={STEPS}", "train.log_period=5",
                "train.evaluation.enabled=False", "train.amp.enabled=True", "train.amp.dtype=fp16",
                "train.amp.initial_scale=4294967296", *LAYOUTS[layout])
    torchrun(2, "tests/workers/fp16_worker.py", tmp_path / "rec", *args)
    records = [json.loads((tmp_path / f"rec.rank{r}.json").read_text()) for r in range(2)]
    skips = [[s["skipped"] for s in rec["steps"]] for rec in records]
    assert skips[0] == skips[1], "the ranks disagree on which steps overflowed"
    skipped = sum(skips[0])
    # 2^32 halves to the tiny model's working scale: a dozen or more overflows, then steps are taken.
    assert 5 <= skipped < STEPS - 10, skipped
    for rec in records:
        assert len(rec["steps"]) == STEPS
        for s in rec["steps"]:
            assert s["finite"], f"non-finite weights or optimizer state after iteration {s['iteration']}"
            assert s["changed"] != s["skipped"], f"iteration {s['iteration']}: skipped={s['skipped']}, " \
                                                 f"changed={s['changed_names']}"
        # The schedule stands where the steps actually taken put it.
        assert rec["scheduler_position"] == STEPS - skipped
    logged = losses(run)
    assert all(math.isfinite(v) for v in logged.values()), logged
    first_taken = next(i for i, s in enumerate(skips[0]) if not s)
    after = [v for it, v in sorted(logged.items()) if it > first_taken + 5]
    assert after and after[-1] < after[0] - 0.3, logged


def test_fp16_overflowing_at_the_minimum_loss_scale_stops_the_run(tmp_path):
    """Weights gone NaN overflow every step at any scale: the scaler halves towards 0 (where zero gradients would
    train on) and every step counts as a skip, so the run must stop once the scale reaches its minimum."""
    from tests.launch import one_error_line

    run = tmp_path / "run"
    args = tiny(run, tmp_path / "cache", "train.train_iter=30", "train.log_period=5",
                "train.checkpointer.period=0", "train.evaluation.enabled=False", "train.amp.enabled=True",
                "train.amp.dtype=fp16", "train.amp.initial_scale=8", "train.amp.min_loss_scale=1")
    # NaN weights after iteration 3: iterations 4, 5, 6 overflow at scales 8, 4, 2, and 7 at 1.
    r = torchrun(2, "tests/workers/nan_weight_worker.py", 3, 1, "nan", *args, check=False)
    line = one_error_line(r)
    assert r.returncode != 0 and "fp16 overflow at iteration 7 with the loss scale at 1" in line, line
    assert "train.amp.min_loss_scale=1" in line and "train.amp.dtype=bf16" in line, line
    assert not any(p.name.startswith("model_") for p in run.iterdir())
