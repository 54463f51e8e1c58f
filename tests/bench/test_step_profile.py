"""bench/step_profile.py in its smoke mode: a GPT training step reads nothing back outside the optimizer."""
from tests.bench.test_bench import run_bench


def test_step_profile_smoke_finds_no_host_reads_in_a_gpt_step():
    res, out = run_bench("step_profile.py", "--smoke", timeout=300)
    assert res["model"] == "gpt" and res["top_level_aten_calls"] > 0
    assert res["aten_calls"] >= res["top_level_aten_calls"]
    # The profiler's view of tests/engine/test_host_reads.py: 5 reads per step before (metrics, total
    # loss, the clipper's norm, the loss backward's two boolean selections), none now.
    assert res["host_reads"] == 0 and res["host_reads_by_op"] == {}, out
