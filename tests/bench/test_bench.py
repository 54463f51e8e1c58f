"""The benchmarks in bench/ run in their smoke mode and end with a JSON line that holds their numbers.

Speed is never asserted here (the machine is shared); what is checked is that each script runs,
that its JSON has the keys the README's tables are filled from, and that the numbers hang
together (same model shape on both sides, same tokens from both preprocessing paths, ...).
"""
import json
import math
import sys

import pytest

from tests.launch import ROOT as REPO_ROOT, python_tool


def run_bench(script: str, *args: str, timeout: int = 120) -> tuple:
    proc = python_tool([sys.executable, str(REPO_ROOT / "bench" / script), *args], timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return json.loads(lines[-1]), proc.stdout


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("script", ["train_throughput.py", "preprocess.py", "data_loader.py"])
def test_help(script):
    proc = python_tool([sys.executable, str(REPO_ROOT / "bench" / script), "--help"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--smoke" in proc.stdout


# Llama with -m slow: the script takes the same path for both models.
@pytest.mark.parametrize("model", ["gpt", pytest.param("llama", marks=pytest.mark.slow)])
def test_train_throughput_smoke(model):
    res, out = run_bench("train_throughput.py", "--smoke", "--profile", "1", "--model", model)
    assert res["benchmark"] == "train_throughput"
    assert res["model"] == model
    assert res["hf_class"] == {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[model]
    if model == "llama":
        # The smoke shape keeps grouped-query attention, so the GQA path of both models is what runs.
        assert res["kv_heads"] < res["heads"]
        assert res["params_total"] > res["params_non_embedding"]
    assert res["ours_fused_cross_entropy"] is True
    for key in ("ours_tokens_per_s", "hf_tokens_per_s", "ratio", "mfu_ours", "mfu_hf", "peak_flops",
                "flops_per_token"):
        assert positive(res[key]), key
    # The reference has exactly our shape, or the ratio compares different models.
    assert res["params_non_embedding"] == res["hf_params_non_embedding"]
    assert res["params_total"] == res["hf_params_total"]
    assert res["hf_attn_implementation"] in ("sdpa", "eager", "flash_attention_2", "flex_attention")
    assert len(res["ours_block_tokens_per_s"]) == len(res["hf_block_tokens_per_s"]) == res["blocks"]
    block_ratios = [o / h for o, h in zip(res["ours_block_tokens_per_s"], res["hf_block_tokens_per_s"])]
    assert min(block_ratios) - 1e-9 <= res["ratio"] <= max(block_ratios) + 1e-9
    assert res["mfu_ours"] == pytest.approx(res["flops_per_token"] * res["ours_tokens_per_s"] / res["peak_flops"])
    L, H, T = res["layers"], res["hidden"], res["seq_length"]
    assert res["flops_per_token"] == 6 * res["params_non_embedding"] + 12 * L * H * T
    assert "ours/HF" in out
    # The time breakdown covers every ATen call once: its kinds add up to the total.
    for side in ("ours", "hf"):
        kinds = res["profile_ms_per_step"][side]
        assert positive(kinds["GEMMs"]) and positive(kinds["total"])
        assert sum(v for k, v in kinds.items() if k != "total") == pytest.approx(kinds["total"])


def test_train_throughput_llama_demo_is_the_demo_config(monkeypatch):
    """The Llama demo row measures the shape projects/Llama/configs/llama_demo.py trains."""
    import importlib.util

    from libai_lite.config import LazyConfig

    spec = importlib.util.spec_from_file_location("throughput_models", REPO_ROOT / "bench" / "throughput_models.py")
    models = importlib.util.module_from_spec(spec)
    # Its dataclass looks its module up in sys.modules while the module runs; undone after the test.
    monkeypatch.setitem(sys.modules, spec.name, models)
    spec.loader.exec_module(models)
    shape = models.LLAMA_SIZES["demo"]
    cfg = LazyConfig.load(str(REPO_ROOT / "projects/Llama/configs/llama_demo.py"))
    m = cfg.model.cfg
    assert (shape["layers"], shape["hidden"], shape["heads"], shape["kv_heads"], shape["ffn"], shape["seq"]) == (
        m.hidden_layers, m.hidden_size, m.num_attention_heads, m.num_key_value_heads, m.ffn_hidden_size,
        m.max_seq_length)
    assert shape["micro_batch"] == cfg.train.train_micro_batch_size
    # The run replaces vocab_size by data_test's GPT-2 tokenizer padded as the config says.
    vocab = len(json.loads((REPO_ROOT / "data_test/gpt2/vocab.json").read_text()))
    step = cfg.tokenization.make_vocab_size_divisible_by
    assert shape["vocab"] == -(-vocab // step) * step


def test_preprocess_smoke():
    res, out = run_bench("preprocess.py", "--smoke")
    assert res["benchmark"] == "preprocess"
    assert 0.9 < res["corpus_mb"] < 1.5
    rows = res["rows"]
    # Per tokenizer: the naive loop and tokenizers' own batch encoding as same-job references, the tool
    # with 1 and 2 workers.
    assert sorted((r["tokenizer"], r["workers"], r["impl"]) for r in rows) == sorted(
        (t, w, impl) for t in ("gpt2", "bert", "spm")
        for w, impl in ((1, "naive loop (same job)"), (2, "encode_batch (same job)"),
                        (1, "tools/preprocess_data.py"), (2, "tools/preprocess_data.py")))
    for r in rows:
        for key in ("docs_per_s", "mb_per_s", "tokens_per_s"):
            assert positive(r[key]), (r, key)
        # Every path tokenises the same corpus into the same number of tokens and documents; the
        # encode_batch reference measures the tokenizer alone, without the end-of-document ids the
        # tool appends (--append-eod for GPT-2 and SentencePiece here).
        tool = {s["tokens"] for s in rows if s["tokenizer"] == r["tokenizer"] and not s["impl"].startswith("encode")}
        assert len(tool) == 1
        if r["impl"].startswith("encode_batch"):
            assert r["tokens"] in (min(tool), min(tool) - r["documents"]), (r, tool)
        assert r["documents"] == res["corpus_documents"]
    assert res["megatron_recorded_mb_per_s"] == 1.8
    assert positive(res["ratio_vs_megatron_recorded"])
    assert "RECORDED" in out


def test_data_loader_smoke():
    res, _ = run_bench("data_loader.py", "--smoke")
    assert res["benchmark"] == "data_loader"
    for key in ("token_scan_s", "index_build_s", "index_open_s", "raw_samples_per_s"):
        assert positive(res[key]), key
    assert [r["workers"] for r in res["loaders"]] == [0, 1]
    for r in res["loaders"]:
        assert r["samples"] > 0 and r["samples"] % res["micro_batch"] == 0
        assert positive(r["samples_per_s"]) and positive(r["first_batch_s"])
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * res["seq_length"])
        assert r["ratio_vs_raw"] == pytest.approx(r["samples_per_s"] / r["raw_samples_per_s"])


def test_data_loader_span_corruption_smoke():
    """The MT5 recipe's loader against raw reads of the windows it corrupts (raw_length tokens each)."""
    res, out = run_bench("data_loader.py", "--smoke", "--span-corruption")
    assert res["span_corruption"] and res["seq_length"] == 128 and res["window"] == 141  # T5's random_spans_helper
    assert "span corruption, encoder 128 from windows of 141" in out
    for row in res["loaders"]:
        assert row["samples"] > 0 and positive(row["samples_per_s"]) and positive(row["raw_samples_per_s"])


def test_checkpoint_stall_smoke():
    res, out = run_bench("checkpoint_stall.py", "--smoke")
    assert res["benchmark"] == "checkpoint_stall" and res["smoke"] is True
    assert res["parameters"] > 0 and res["checkpoint_bytes"] > 0
    for mode in ("sync", "async"):
        assert positive(res[mode]["stall_s"]), mode
        assert math.isfinite(res[mode]["extra_cpu_s"]) and math.isfinite(res[mode]["extra_wall_s"]), mode
    assert res["stall_ratio"] == pytest.approx(res["async"]["stall_s"] / res["sync"]["stall_s"])
    assert res["meets_target"] == (res["stall_ratio"] <= 0.2)
    assert "async/sync: stall" in out


def test_optimizers_smoke_compares_muon_with_adamw_side_by_side():
    res, out = run_bench("optimizers.py", "--smoke")
    assert res["benchmark"] == "optimizers" and res["steps"] == 6
    for name in ("adamw", "muon"):
        assert positive(res[name]["loss"]) and positive(res[name]["seconds_per_step"])
    assert res["loss_ratio_muon_over_adamw"] == res["muon"]["loss"] / res["adamw"]["loss"]
    assert "muon/adamw: loss x" in out
