"""The shipped recipes at their real shapes on one GPU (pytest -m gpu; skipped without CUDA).

Each test launches tools/train_net.py as a user does, for 3 steps forward and backward, with the recipe's
own head sizes, sequence lengths and fast paths (FlexAttention, compile, the fused loss, FP8, CUDA
graphs, background checkpoints). Depth is cut where only compile time grows with it; widths, heads and
lengths stay as shipped, since they decide which kernels run and what they need. A fast path that falls
back to its plain path passes the run but fails here: the GPU suite is where a fallback is found.
"""
import math
import re
import subprocess

import pytest
import torch

from tests.launch import ROOT, env, losses, train_cmd, train_sh

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m gpu on a GPU machine)"),
]

STEPS = 3
MT5 = "projects/MT5/configs/mt5_pretrain.py"
GPT_345M = "projects/GPT/configs/gpt2_345M.py"
GPT_DEMO = "projects/GPT/configs/gpt2_pretrain.py"
LLAMA = "projects/Llama/configs/llama_demo.py"
# The one warning line of libai_lite.utils.fallback.FastPath (and any other wording of a fallback).
FALLBACK = re.compile(r"failed at its first use|conversion failed|fall(ing|s)? back|fell back", re.I)


def _short(out, steps=STEPS):
    return [f"train.output_dir={out}", f"train.train_iter={steps}", "train.train_epoch=0", "train.log_period=1",
            "train.evaluation.enabled=False", "train.checkpointer.period=1000"]


def recipe(config, out, *overrides, steps=STEPS, resume=False, timeout=300, extra_env=None) -> str:
    """Train ``config`` with ``overrides`` for ``steps`` steps on cuda:0; returns the log. Fails on a non-zero
    exit, a non-finite loss or a fast path that fell back."""
    args = _short(out, steps) + list(overrides) + (["--resume"] if resume else [])
    r = subprocess.run(train_cmd(args, config), cwd=ROOT, env=env(**(extra_env or {})), capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    log = (out / "log.txt").read_text()
    assert "on cuda:0" in log, log[-2000:]
    fell = [line for line in (log + r.stderr).splitlines() if FALLBACK.search(line)]
    assert not fell, fell
    curve = losses(out)
    assert len(curve) >= 1 and all(math.isfinite(v) for v in curve.values()), curve
    return log


def same_as_dense(config, out, *overrides):
    """The run through FlexAttention and again through dense SDPA (LIBAI_LITE_ATTENTION=dense): the first
    step's loss and gradient norm agree to bf16's rounding. A kernel whose gradients are wrong but finite
    passes every other check here."""
    recipe(config, out / "flex", *overrides)
    recipe(config, out / "dense", *overrides, extra_env={"LIBAI_LITE_ATTENTION": "dense"})
    for key in ("total_loss", "grad_norm"):
        flex, dense = losses(out / "flex", key), losses(out / "dense", key)
        assert flex[1] == pytest.approx(dense[1], rel=5e-2), (key, flex, dense)


def test_mt5_recipe_at_shipped_widths(tmp_path):
    """LiBai's MT5 recipe as mt5_pretrain.py ships it but 2 layers deep, on one process: mT5-base's widths,
    12 heads of 64, encoder 512 / decoder 114, bf16, the relative bias through FlexAttention. The full
    depth compiles the same kernels for twelve times the compile time; it trains in bench/gpu.sh's
    mission_mt5 step, whose flex guard compares flex with the dense path at the first step of each shape."""
    same_as_dense(MT5, tmp_path, "model.cfg.hidden_layers=2")


def test_t5_v1_0(tmp_path):
    """T5 v1.0 (ReLU, tied and scaled head) at t5-small's widths: 8 heads of 64."""
    same_as_dense(MT5, tmp_path, "model.cfg.model_type=t5", "model.cfg.tie_word_embeddings=null",
                  "model.cfg.hidden_size=512", "model.cfg.num_attention_heads=8", "model.cfg.intermediate_size=2048",
                  "model.cfg.hidden_layers=2")


def test_llama_packed_documents_sliding_window_4k(tmp_path):
    """Llama 3 / Mistral's heads (128 wide, grouped 4:1) at 4k tokens with packed documents (document mask,
    positions reset) and a 1k sliding window: the block mask FlexAttention builds once per batch."""
    recipe(LLAMA, tmp_path / "llama", "model.cfg.max_seq_length=4096", "model.cfg.sliding_window=1024",
           "model.cfg.hidden_size=1024", "model.cfg.num_attention_heads=8", "model.cfg.num_key_value_heads=2",
           "model.cfg.ffn_hidden_size=2816", "model.cfg.hidden_layers=2", "dataloader.train.reset_attention_mask=True",
           "dataloader.train.reset_position_ids=True", "dataloader.train.eod_mask_loss=True",
           "train.train_micro_batch_size=1", "train.global_batch_size=1", "train.amp.enabled=True")


def test_gpt2_345M_compiled_fused_loss(tmp_path):
    """GPT-2 345M's widths (16 heads of 64, seq 1024), whole-model compile and the fused LM head + loss."""
    recipe(GPT_345M, tmp_path / "gpt", "model.cfg.hidden_layers=4", "train.compile.enabled=True",
           "model.cfg.fused_cross_entropy=True", "train.train_micro_batch_size=8", "train.global_batch_size=8",
           "train.amp.enabled=True")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 needs compute capability 8.9+")
@pytest.mark.parametrize("recipe_name", ["tensorwise", "rowwise"])
def test_fp8(tmp_path, recipe_name):
    """torchao's float8 linears at 345M's widths, both scaling recipes, compiled."""
    pytest.importorskip("torchao")
    recipe(GPT_345M, tmp_path / recipe_name, "model.cfg.hidden_layers=4", "train.fp8.enabled=True",
           f"train.fp8.recipe={recipe_name}", "train.compile.enabled=True", "train.train_micro_batch_size=8",
           "train.global_batch_size=8", "train.amp.enabled=True")


def test_reduce_overhead_with_accumulation_trains_the_eager_losses(tmp_path):
    """CUDA graphs (compile mode reduce-overhead) over 2 accumulated micro-batches: the eager losses."""
    common = ["model.cfg.hidden_layers=2", "train.train_micro_batch_size=4", "train.global_batch_size=8",
              "train.num_accumulation_steps=2", "model.cfg.embedding_dropout_prob=0.0",
              "model.cfg.attention_dropout_prob=0.0", "model.cfg.output_dropout_prob=0.0"]
    recipe(GPT_DEMO, tmp_path / "eager", *common, "train.compile.enabled=False")
    recipe(GPT_DEMO, tmp_path / "graphs", *common, "train.compile.enabled=True", "train.compile.mode=reduce-overhead")
    eager, graphs = losses(tmp_path / "eager"), losses(tmp_path / "graphs")
    # fp32 with TF32 off: compiled kernels reorder reductions, ~1e-6 relative on the first loss and a few
    # 1e-5 after Adam's normalised steps amplify it.
    for it in eager:
        assert graphs[it] == pytest.approx(eager[it], rel=1e-4), (it, eager, graphs)


def test_async_checkpoint_mid_run_resumes_with_the_same_losses(tmp_path):
    """A background save at step 2 of 4 while training goes on; resuming from it gives the uninterrupted losses."""
    common = ["model.cfg.embedding_dropout_prob=0.0", "model.cfg.attention_dropout_prob=0.0",
              "model.cfg.output_dropout_prob=0.0", "train.checkpointer.async_save=True"]
    whole = tmp_path / "whole"
    recipe(GPT_DEMO, whole, *common, steps=4)
    half = tmp_path / "half"
    recipe(GPT_DEMO, half, *common, "train.checkpointer.period=2", steps=2)
    recipe(GPT_DEMO, half, *common, "train.checkpointer.period=2", steps=4, resume=True)
    a, b = losses(whole), losses(half)
    for it in (3, 4):
        assert b[it] == pytest.approx(a[it], rel=1e-5), (it, a, b)


def test_two_ranks_share_the_gpu_with_zero2_float8_all_gather(tmp_path):
    """Two ranks on cuda:0 over gloo, ZeRO-2 with torchao's float8 all-gather (tensorwise)."""
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    out = tmp_path / "ranks"
    r = train_sh(2, _short(out) + ["train.dist.backend=gloo", "train.zero_optimization.enabled=True",
                                   "train.zero_optimization.stage=2", "train.fp8.enabled=True",
                                   "train.fp8.recipe=tensorwise", "train.amp.enabled=True",
                                   "model.cfg.hidden_size=1024", "model.cfg.ffn_hidden_size=4096",
                                   "model.cfg.num_attention_heads=16", "model.cfg.hidden_layers=2"],
                 config=GPT_DEMO, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    log = (out / "log.txt").read_text()
    assert "float8 all-gather" in log, log[-2000:]
    assert not FALLBACK.search(log), log[-2000:]
    assert all(math.isfinite(v) for v in losses(out).values())
