"""bench/train_throughput.py --model mt5 and bench/step_profile.py --model mt5 at the smoke shape: they run and report what they say."""
import pytest

from tests.bench.test_bench import positive, run_bench


def test_train_throughput_mt5_smoke():
    res, out = run_bench("train_throughput.py", "--smoke", "--model", "mt5", timeout=300)
    assert res["model"] == "mt5" and res["hf_class"] == "MT5ForConditionalGeneration"
    # The reference has exactly our shape (untied head, same non-lookup weights).
    assert res["params_total"] == res["hf_params_total"]
    assert res["params_non_embedding"] == res["hf_params_non_embedding"]
    for key in ("ours_tokens_per_s", "hf_tokens_per_s", "ratio", "flops_per_token"):
        assert positive(res[key]), key
    # Tokens are encoder + decoder tokens, FLOPs the model's own count spread over them.
    from projects.MT5 import MT5Model

    model = MT5Model(dict(vocab_size=res["vocab"], hidden_size=res["hidden"], hidden_layers=res["layers"],
                          num_attention_heads=res["heads"], head_size=32, intermediate_size=res["ffn_hidden"]))
    enc, dec = res["seq_length"], 8
    assert res["flops_per_token"] == pytest.approx(model.flops_per_token(enc, dec) * enc / (enc + dec))
    assert "ours/HF" in out


def test_span_corruption_batches_are_laid_out_as_the_t5_dataset():
    import sys

    import torch

    from tests.launch import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    from throughput_models import MT5_SIZES, span_corruption_batch

    shape = MT5_SIZES["demo"]
    b = span_corruption_batch(shape, 4, torch.Generator().manual_seed(0))
    n_enc, n_dec = b["encoder_attn_mask"].sum(1), b["decoder_attn_mask"].sum(1)
    for i in range(4):
        labels = b["labels"][i, : n_dec[i]]
        assert labels[-1] == 1 and (b["labels"][i, n_dec[i]:] == -100).all()  # EOS, then ignored
        assert b["decoder_input_ids"][i, 0] == 0 and torch.equal(b["decoder_input_ids"][i, 1: n_dec[i]], labels[:-1])
        assert b["encoder_input_ids"][i, n_enc[i] - 1] == 1 and (b["encoder_input_ids"][i, n_enc[i]:] == 0).all()
        # Every sentinel in the encoder opens a span in the labels, in the same order.
        sentinels = lambda t: t[t >= shape["vocab"] - 100].tolist()  # noqa: E731
        assert sentinels(b["encoder_input_ids"][i]) == sentinels(labels) != []
    assert torch.equal(b["encoder_decoder_attn_mask"], b["encoder_attn_mask"])


def test_step_profile_counts_an_mt5_training_step():
    res, out = run_bench("step_profile.py", "--model", "mt5", "--size", "smoke", "--warmup", "1", "--steps", "1",
                         timeout=300)
    assert res["aten_calls"] >= res["top_level_aten_calls"] > 0
    assert res["host_reads"] == sum(res["host_reads_by_op"].values()) == 0
    assert res["top_level_most_common"]
    assert "per training step" in out
