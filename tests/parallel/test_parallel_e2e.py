"""Every parallel layout, launched the way users launch it, trains the same loss curve as one process.

Runs tools/train.sh (torchrun, gloo, CPU) with only `train.dist.*`, `train.zero_optimization.*`
and `train.activation_checkpoint.*` changed, and compares `metrics.json` step for step with a
one-process run of the same global batch. Gradient-level parity of each piece is checked in
tests/parallel/test_{tensor,pipeline,data}_parallel.py.
"""
import json

import pytest

from tests.launch import losses, one_error_line, tiny, train_net, train_ranks, train_sh

STEPS = 10
COMMON = [
    f"train.train_iter={STEPS}",
    "train.evaluation.enabled=False",
    "train.checkpointer.period=1000",
    "model.cfg.attention_dropout_prob=0.0",
    "model.cfg.output_dropout_prob=0.0",
    "model.cfg.hidden_layers=4",
    "model.cfg.num_attention_heads=4",
    # global batch 8 = micro 2 x dp x accumulation, whatever the layout
    "train.train_micro_batch_size=2",
    "train.global_batch_size=8",
    # The vocabulary is padded to a multiple of this x tensor_parallel_size: 8000 ids pad to 8192
    # for tp 1 and 2 alike, so every layout builds the same model.
    "tokenization.make_vocab_size_divisible_by=256",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    r = train_net(tiny(tmp / "out", tmp / "cache", *COMMON))
    assert r.returncode == 0, r.stderr[-3000:]
    curve = losses(tmp / "out")
    assert sorted(curve) == list(range(1, STEPS + 1))
    return curve


LAYOUTS = {
    "tp2": (2, ["train.dist.tensor_parallel_size=2"]),
    "tp2_sequence_parallel": (2, ["train.dist.tensor_parallel_size=2", "train.dist.sequence_parallel=True"]),
    "dp2": (2, []),
    "dp2_zero1": (2, ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=1"]),
    "dp2_zero2": (2, ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=2"]),
    "dp2_zero3_actckpt": (2, ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=3",
                              "train.activation_checkpoint.enabled=True"]),
    "dp2_zero3_offload": (2, ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=3",
                              "train.zero_optimization.offload=True"]),
    "dp2_tp2_zero2": (4, ["train.dist.tensor_parallel_size=2", "train.zero_optimization.enabled=True",
                          "train.zero_optimization.stage=2"]),
    "pp2_gpipe": (2, ["train.dist.pipeline_parallel_size=2", "train.dist.pipeline_schedule=gpipe"]),
    "pp2_1f1b": (2, ["train.dist.pipeline_parallel_size=2", "train.dist.pipeline_schedule=1f1b"]),
    "pp2_interleaved_1f1b": (2, ["train.dist.pipeline_parallel_size=2", "train.dist.pipeline_schedule=interleaved_1f1b",
                                 "train.dist.virtual_pipeline_size=2"]),
    "dp2_pp2": (4, ["train.dist.pipeline_parallel_size=2"]),
    "tp2_pp2": (4, ["train.dist.pipeline_parallel_size=2", "train.dist.tensor_parallel_size=2"]),
    "dp2_tp2_pp2_zero2": (8, ["train.dist.pipeline_parallel_size=2", "train.dist.tensor_parallel_size=2",
                              "train.zero_optimization.enabled=True", "train.zero_optimization.stage=2"]),
}


# With -m slow: eight processes on a 2-core CI machine (the composition of dp2_tp2_zero2 and the
# 4-rank checkpoint test's tp2_pp2), and layouts whose path a default test already takes: tp2
# (test_tensor_parallel, the copied projects), dp2 and dp2_zero2 (dp2_tp2_zero2, dp2_zero1,
# test_train_e2e), pp2_1f1b (the copied projects, Llama), tp2_pp2 (the resharding checkpoint test).
# pp2_gpipe (test_pipeline_parallel's GPipe test), dp2_zero1 (test_data_parallel's every ZeRO stage).
# dp2_pp2 (pp2_interleaved_1f1b and the 4-rank checkpoint test), dp2_zero3_offload (dp2_zero3_actckpt; the
# offload itself: test_data_parallel).
SLOW_LAYOUTS = {"dp2_tp2_pp2_zero2", "tp2", "dp2", "dp2_zero2", "pp2_1f1b", "tp2_pp2", "pp2_gpipe", "dp2_zero1",
                "dp2_pp2", "dp2_zero3_offload"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_LAYOUTS else n for n in LAYOUTS])
def test_layout_matches_one_process(tmp_path, reference, name):
    nproc, extra = LAYOUTS[name]
    r = train_ranks(nproc, tiny(tmp_path / "out", tmp_path / "cache", *COMMON, *extra))
    assert r.returncode == 0, r.stderr[-4000:]
    curve = losses(tmp_path / "out")
    assert sorted(curve) == sorted(reference)
    for it in reference:
        assert curve[it] == pytest.approx(reference[it], rel=2e-4, abs=2e-4), (name, it)


@pytest.mark.parametrize(
    "nproc,extra,needle",
    [
        # These two are tests/engine/test_bad_input.py's layout_not_fitting_world and _model cases.
        pytest.param(2, ["train.dist.tensor_parallel_size=4", "train.dist.strict_layout=True"],
                     "but 2 were launched", marks=pytest.mark.slow),
        (2, ["train.dist.data_parallel_size=4"], "does not match the world size"),
        (1, ["model.cfg.num_attention_heads=4", "model.cfg.hidden_size=66"], None),
        pytest.param(2, ["train.dist.tensor_parallel_size=2", "model.cfg.num_attention_heads=3",
                         "model.cfg.hidden_size=66"], "does not divide model.cfg.num_attention_heads=3",
                     marks=pytest.mark.slow),
        # Refused in process too (tests/engine/test_run_spec.py); two processes with -m slow.
        pytest.param(2, ["train.dist.pipeline_parallel_size=2", "model.cfg.hidden_layers=1"],
                     "more stages than the model's 1 layers", marks=pytest.mark.slow),
        # The range table refuses it in process too (tests/engine/test_bad_input.py).
        pytest.param(2, ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=4"],
                     "train.zero_optimization.stage=4 is out of range", marks=pytest.mark.slow),
        (2, ["train.zero_optimization.offload=True"], "offload"),
        (2, ["train.dist.tensor_parallel_size=2", "train.dist.sequence_parallel=True", "model.cfg.max_seq_length=31"],
         "the model's sequences have 31 tokens: use a sequence length divisible by 2"),
    ],
)
def test_invalid_layouts_fail_fast_with_one_line(tmp_path, nproc, extra, needle):
    out = tmp_path / "out"
    args = tiny(out, tmp_path / "cache", "train.train_iter=2", *extra)
    if needle is None:
        # A head count that does not divide the hidden size is the model's own check.
        r = train_net(args)
        assert r.returncode == 1
        one_error_line(r)
        return
    r = train_sh(nproc, args, timeout=120)
    assert r.returncode != 0
    assert needle in one_error_line(r)
    assert not out.exists()


# Resumed on four processes with -m slow (data parallel resharding: test_data_parallel's DCP test).
@pytest.mark.parametrize("name,nproc", [("one", 1), pytest.param("dp4", 4, marks=pytest.mark.slow)])
def test_checkpoint_from_tp2_pp2_resumes_under_another_layout(tmp_path, reference, name, nproc):
    """DCP reshards: a tp=2 x pp=2 checkpoint continues the same loss curve under other layouts."""
    import shutil

    args = [*COMMON, "train.checkpointer.period=5"]
    src = tmp_path / "tp2pp2"
    r = train_ranks(4, tiny(src, tmp_path / "cache", *args, "train.dist.pipeline_parallel_size=2",
                            "train.dist.tensor_parallel_size=2"))
    assert r.returncode == 0, r.stderr[-4000:]
    out = tmp_path / name
    shutil.copytree(src, out)
    # Resume from the iteration-5 checkpoint, as if the run had stopped there.
    (out / "last_checkpoint").write_text("model_0000004")
    with open(out / "metrics.json") as f:
        rows = [line for line in f if json.loads(line)["iteration"] <= 5]
    (out / "metrics.json").write_text("".join(rows))
    resumed = tiny(out, tmp_path / "cache", *args) + ["--resume"]
    r = train_ranks(nproc, resumed)
    assert r.returncode == 0, r.stderr[-4000:]
    curve = losses(out)
    for it in range(6, STEPS + 1):
        assert curve[it] == pytest.approx(reference[it], rel=2e-4, abs=2e-4), (name, it)
    if name == "dp4":
        assert "data_parallel_size changed from 1 to 4" in (out / "log.txt").read_text()


MT5_CONFIG = "projects/MT5/configs/mt5_pretrain.py"
MT5_COMMON = [
    "model.cfg.hidden_layers=2", "model.cfg.hidden_size=64", "model.cfg.num_attention_heads=4",
    "model.cfg.head_size=16", "model.cfg.intermediate_size=128", "dataloader.train.max_seq_length=64",
    "dataloader.train.num_workers=0", "train.train_micro_batch_size=2", "train.global_batch_size=8",
    "train.num_accumulation_steps=null", "train.train_epoch=0", f"train.train_iter={STEPS}", "train.log_period=1",
    "train.evaluation.enabled=False", "train.checkpointer.period=1000", "train.amp.enabled=False",
    "train.zero_optimization.enabled=False", "train.dist.data_parallel_size=null",
    "train.dist.tensor_parallel_size=1", "tokenization.make_vocab_size_divisible_by=256", "optim.lr=1e-3",
]


@pytest.fixture(scope="module")
def mt5_reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mt5ref")
    r = train_net([f"train.output_dir={tmp / 'out'}", f"dataloader.train.cache_dir={tmp / 'cache'}", *MT5_COMMON],
                  config=MT5_CONFIG)
    assert r.returncode == 0, r.stderr[-3000:]
    return {key: losses(tmp / "out", key) for key in ("total_loss", "token_acc")}


@pytest.mark.parametrize("name,nproc,extra", [
    ("tp2", 2, ["train.dist.tensor_parallel_size=2"]),
    # ZeRO-2 does not see which model it shards (the GPT layouts and MoE tests run it by default).
    pytest.param("dp2_zero2", 2, ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=2"],
                 marks=pytest.mark.slow),
    # Four processes: with -m slow (the GPT layouts run dp x tp and tp x pp by default).
    pytest.param("dp2_tp2_zero2_actckpt", 4,
                 ["train.dist.tensor_parallel_size=2", "train.zero_optimization.enabled=True",
                  "train.zero_optimization.stage=2", "train.activation_checkpoint.enabled=True"],
                 marks=pytest.mark.slow),
    # 4 stages of one layer each: cuts inside the encoder (the encoder bias travels), at the
    # encoder/decoder boundary and inside the decoder (the decoder bias travels).
    ("pp2_interleaved_1f1b", 2, ["train.dist.pipeline_parallel_size=2", "train.dist.pipeline_schedule=interleaved_1f1b",
                                 "train.dist.virtual_pipeline_size=2"]),
    pytest.param("tp2_pp2", 4, ["train.dist.pipeline_parallel_size=2", "train.dist.tensor_parallel_size=2"],
                 marks=pytest.mark.slow),
])
def test_mt5_layout_matches_one_process(tmp_path, mt5_reference, name, nproc, extra):
    out = tmp_path / "out"
    r = train_ranks(nproc, [f"train.output_dir={out}", f"dataloader.train.cache_dir={tmp_path / 'cache'}",
                            *MT5_COMMON, *extra], config=MT5_CONFIG)
    assert r.returncode == 0, r.stderr[-4000:]
    # Token accuracy too: under pipeline parallelism it comes from the last stage to every rank's log.
    for key, reference in mt5_reference.items():
        curve = losses(out, key)
        assert sorted(curve) == sorted(reference) == list(range(1, STEPS + 1)), key
        for it in reference:
            assert curve[it] == pytest.approx(reference[it], rel=2e-4, abs=2e-4), (name, key, it)
    assert mt5_reference["total_loss"][STEPS] < mt5_reference["total_loss"][1]
    assert mt5_reference["token_acc"][STEPS] > 0


@pytest.mark.slow
def test_t5_tied_head_under_pp2_matches_one_process(tmp_path):
    """T5 v1.0 ties the LM head to the embedding: the last stage's copy and the first stage's
    embedding take identical updates, so the pp=2 curve is the one-process curve."""
    curves = {}
    for name, nproc, extra in (("one", 1, []), ("pp2", 2, ["train.dist.pipeline_parallel_size=2"])):
        args = [f"train.output_dir={tmp_path / name}", f"dataloader.train.cache_dir={tmp_path / 'cache'}",
                *MT5_COMMON, "model.cfg.model_type=t5", *extra]
        r = train_ranks(nproc, args, config=MT5_CONFIG)
        assert r.returncode == 0, r.stderr[-4000:]
        curves[name] = losses(tmp_path / name)
    assert sorted(curves["pp2"]) == list(range(1, STEPS + 1))
    for it in curves["one"]:
        assert curves["pp2"][it] == pytest.approx(curves["one"][it], rel=2e-4, abs=2e-4), it


def test_mt5_pipeline_num_layers_that_disagrees_with_the_model_is_refused(tmp_path):
    out = tmp_path / "out"
    r = train_sh(2, [f"train.output_dir={out}", f"dataloader.train.cache_dir={tmp_path / 'cache'}", *MT5_COMMON,
                     "train.dist.pipeline_parallel_size=2", "train.dist.pipeline_num_layers=6"],
                 config=MT5_CONFIG, timeout=120)
    assert r.returncode != 0
    assert "train.dist.pipeline_num_layers=6 but the model has 4 layers" in one_error_line(r)
    assert not out.exists()
