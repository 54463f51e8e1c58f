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
