"""bench/kernel_count.py in its smoke mode: its JSON has the README table's numbers, and they hang together."""
import sys

from tests.bench.test_bench import run_bench
from tests.launch import ROOT, python_tool


def test_kernel_count_smoke():
    res, out = run_bench("kernel_count.py", "--smoke", "--components", timeout=300)
    assert set(res) == {"llama", "mt5", "moe_layer", "components"}
    for name in ("llama", "mt5", "moe_layer"):
        assert res[name]["kernels"] > 0 and res[name]["host_reads"] == sum(res[name]["host_read_ops"].values())
    assert res["moe_layer"]["host_reads"] == 0  # the fixed-capacity dispatch at ep=1
    comp = res["components"]
    # One GEMM fewer forward and two fewer backward for the gated MLP; rotary angles computed once.
    assert comp["gated_mlp"]["new"]["forward"] < comp["gated_mlp"]["old"]["forward"]
    assert comp["rotary"]["new"]["forward"] < comp["rotary"]["old"]["forward"]
    assert "rms_norm" in out


def test_kernel_count_refuses_an_unknown_model_in_one_line():
    proc = python_tool([sys.executable, str(ROOT / "bench" / "kernel_count.py"), "--models", "gpt9"], timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: unknown model 'gpt9'")


def test_kernel_count_counts_the_grouped_moe_experts_against_the_loop():
    res, out = run_bench("kernel_count.py", "--models", "moe_layer", "--smoke", "--moe-experts", timeout=300)
    r = res["moe_experts"]
    assert (r["experts"], r["top_k"]) == (8, 2) and "GPU kernels predicted" in out
    # The loop runs each expert's two GEMMs and activation: at least 4 ops per expert forward; the grouped
    # path's count does not grow with the experts.
    assert r["loop"]["forward"] >= 4 * 8 and r["grouped"]["forward"] < 8
    assert r["grouped"]["backward"] < r["loop"]["backward"]
    assert r["grouped"]["top_ops"]["_grouped_mm"] == 6  # two forward, four backward (input and weight)
