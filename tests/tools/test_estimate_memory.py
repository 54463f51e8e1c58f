"""tools/estimate_memory.py and libai_lite.planning against what runs.

The benchmark's smoke rows (bench/memory.py: a 4-rank torchrun job measuring each configuration's peak
per rank) must agree with the planner within 15%; a 1.3B GPT on 16 GiB devices must not fit and the
suggested overrides, applied to the config, must fit; a layout the world size does not divide, and a
size that is not one, are one `error:` line each.
"""
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from libai_lite.utils.errors import UsageError
from libai_lite.planning import MemoryPlanner, PlanSettings, parse_bytes
from tests.launch import ROOT, free_port

GPT_1_3B = "projects/GPT/configs/gpt2_1.3B.py"
TOLERANCE = 0.15  # the acceptance: estimate within 15% of the measured peak


def _load_tool():
    spec = importlib.util.spec_from_file_location("estimate_memory", ROOT / "tools" / "estimate_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_tool(capsys, *argv):
    """(exit status, stdout, stderr) of tools/estimate_memory.py run in this process (from the repo root)."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rc = _load_tool().main([str(a) for a in argv])
    finally:
        os.chdir(cwd)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _bench_rows(configs: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "bench/memory.py", "--smoke", "--configs", configs], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["configs"]


def test_compare_offload_prints_zero1_peaks_with_and_without_offload_side_by_side():
    """bench/memory.py --compare-offload: both ZeRO-1 peaks and their ratio, measured here (where the planner must
    agree within 15%, the shard's host copies included) and predicted for a GPU, where offload lowers the peak."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "bench/memory.py", "--smoke", "--compare-offload"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    _assert_within(summary["configs"], "no_zero,zero1,zero1_offload")
    c = summary["offload_comparison"]
    measured = c["measured_peak_step_bytes"]
    assert c["measured_ratio"] == pytest.approx(measured["zero1_offload"] / measured["zero1"], abs=1e-3)
    assert c["predicted_ratio"] < 1 and c["predicted_host_bytes"] > summary["configs"]["zero1"]["optimizer_bytes"]
    assert "ZeRO-1 peak step (MiB/rank)" in proc.stdout and "predicted (cuda)" in proc.stdout


def _assert_within(rows: dict, names: str) -> None:
    # Every row asked for must be there: a benchmark that returns nothing must not pass.
    assert sorted(rows) == sorted(names.split(",")), rows
    for name, row in rows.items():
        measured, estimated = row["peak_step_bytes"], row["estimated_peak_step_bytes"]
        assert abs(estimated / measured - 1) <= TOLERANCE, (
            f"{name}: estimated {estimated / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")


@pytest.mark.slow
def test_smoke_rows_within_15_percent():
    """DDP's persistent buckets and ZeRO-3's gathered layers (every row, with activation checkpointing and the
    unfused loss, runs with -m slow: four ranks on two busy cores take about 25 s a row)."""
    _assert_within(_bench_rows("no_zero,zero3"), "no_zero,zero3")


@pytest.mark.slow
def test_all_smoke_rows_within_15_percent():
    names = "no_zero,zero1,zero2,zero3,zero3_offload,no_zero_ac,zero3_ac,no_zero_unfused_ce"
    _assert_within(_bench_rows(names), names)


def test_1_3b_gpt_does_not_fit_16gib_and_the_suggestion_fits(capsys):
    rc, out, err = run_tool(capsys, GPT_1_3B, "--nproc", 8, "--device-memory", "16GiB")
    assert rc == 2, out + err
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("does not fit in 16.00 GiB per device"), verdict
    assert " try " in verdict, verdict
    overrides = verdict.split(" try ", 1)[1].split(" (estimated")[0].split()
    assert overrides and all("=" in o for o in overrides), verdict
    # The suggestion is a config change: applied to the config, the tool says it fits.
    rc, out, err = run_tool(capsys, GPT_1_3B, "--nproc", 8, "--device-memory", "16GiB", *overrides)
    assert rc == 0, out + err
    assert out.strip().splitlines()[-1].startswith("fits in 16.00 GiB per device"), out


def test_packed_documents_take_the_tokenizers_end_of_document_id(capsys):
    """As the trainer does, the planner fills dataloader.train.eod_token_id from the tokenizer when it is null."""
    rc, out, err = run_tool(capsys, "projects/Llama/configs/llama_demo.py", "dataloader.train.reset_attention_mask=True",
                            "dataloader.train.eod_mask_loss=True", "dataloader.train.num_workers=0")
    assert rc == 0, out + err
    assert out.strip().splitlines()[-1].startswith("note: the peak counts tensors"), out


def test_layout_that_does_not_divide_is_one_line(capsys):
    rc, out, err = run_tool(capsys, GPT_1_3B, "--nproc", 6, "train.dist.tensor_parallel_size=4")
    assert rc == 1 and out == ""
    assert err.strip().splitlines() == [
        "error: world size 6 is not divisible by pipeline_parallel_size(1) x tensor_parallel_size(4); launch a "
        "multiple of 4 processes or change train.dist"]


def test_device_memory_that_is_not_a_size_is_one_line(capsys):
    rc, out, err = run_tool(capsys, GPT_1_3B, "--device-memory", "lots")
    assert rc == 1
    assert err.strip() == "error: device memory 'lots' is not a size; write it like 80GiB, 16GB or 512MiB"


@pytest.mark.parametrize("argv, line", [
    (["--device-memory", "-5GiB"], "error: device memory '-5GiB' is not positive; give one device's memory, like "
                                   "80GiB or 16GB"),
    (["--device-memory=0"], "error: device memory '0' is not positive; give one device's memory, like 80GiB or 16GB"),
    (["--nproc", "x"], "error: argument --nproc: invalid int value: 'x'; see tools/estimate_memory.py --help"),
    (["--device-memory"], "error: argument --device-memory: expected one argument; see tools/estimate_memory.py "
                          "--help")])
def test_a_bad_option_is_one_line_and_exit_1_not_the_does_not_fit_status(capsys, argv, line):
    """argparse's usage and exit 2 ('-5GiB' read as an option) were this tool's 'does not fit' status."""
    try:
        rc, out, err = run_tool(capsys, GPT_1_3B, *argv)
    except SystemExit as e:  # argparse's own errors leave through exit
        captured = capsys.readouterr()
        rc, out, err = e.code, captured.out, captured.err
    assert (rc, out, err.strip()) == (1, "", line)


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("16 GB") == 16 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1e9") == 10**9


# ------------------------------------------------------------------ the planner's counting, on a tiny GPT


def _tiny_gpt_planner(layers=4):
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    cfg = dict(hidden_layers=layers, vocab_size=256, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
               max_seq_length=32, embedding_dropout_prob=0.0, attention_dropout_prob=0.0, output_dropout_prob=0.0)
    sample = {"input_ids": torch.zeros(32, dtype=torch.long), "labels": torch.zeros(32, dtype=torch.long)}
    return MemoryPlanner(lambda: GPTForPreTraining(cfg), sample), GPTForPreTraining, cfg


def test_pipeline_stages_hold_what_the_splitter_keeps():
    """Per pipeline rank, the planner's parameters are those the pipeline splitter leaves on that stage."""
    from libai_lite.model import pipeline_num_layers
    from libai_lite.parallel.pipeline_split import split_pipeline_stage
    from libai_lite.utils.parallel_dims import layer_stages

    planner, cls, cfg = _tiny_gpt_planner(layers=4)
    settings = PlanSettings(world_size=2, pipeline_parallel_size=2, num_microbatches=4)
    for rank, (modules, _layers) in enumerate(planner._stages(settings)):
        counted = sum(p.numel for _i, p in planner._params(modules, 1))
        with torch.device("meta"):
            model = cls(cfg)
        stage = split_pipeline_stage(model, rank, 2, layer_stages(pipeline_num_layers(model), 2))
        assert counted == sum(p.numel() for p in {id(p): p for p in stage.parameters()}.values())


def test_tensor_parallel_splits_what_the_layers_declare():
    """Megatron's split under tp=2, counted by hand for the tiny GPT: the vocabulary, QKV, the attention output
    weight and both MLP weights (and the column-split biases) halve; norms, position embeddings and
    row-split biases stay whole."""
    planner, _cls, _cfg = _tiny_gpt_planner(layers=4)
    h, ffn, vocab, seq, layers = 64, 256, 256, 32, 4
    split_per_layer = 3 * h * h + 3 * h + h * h + ffn * h + ffn + h * ffn
    whole_per_layer = 4 * h + 2 * h  # two layer norms (weight, bias), two row-split biases
    whole = planner.estimate(PlanSettings(device="cpu"))
    tp2 = planner.estimate(PlanSettings(world_size=2, tensor_parallel_size=2, device="cpu"))
    assert whole.num_parameters == vocab * h + seq * h + layers * (split_per_layer + whole_per_layer) + 2 * h
    assert tp2.num_parameters == vocab * h // 2 + seq * h + layers * (split_per_layer // 2 + whole_per_layer) + 2 * h
    assert tp2.params == tp2.num_parameters * 4
    # Activations in the split regions (attention, MLP interior) halve; the residual stream does not.
    assert whole.activations / 2 < tp2.activations < whole.activations


def test_activation_checkpointing_and_zero_reduce_the_peak():
    planner, _cls, _cfg = _tiny_gpt_planner()
    base = PlanSettings(world_size=4, data_parallel_size=4, micro_batch_size=4, device="cpu")
    plain = planner.estimate(base)
    assert planner.estimate(dataclasses.replace(base, activation_checkpoint_every=1)).activations < plain.activations
    zero3 = planner.estimate(dataclasses.replace(base, zero_stage=3))
    assert zero3.params * 4 >= plain.params and zero3.params < plain.params / 3
    assert zero3.peak < plain.peak


def test_zero_at_data_parallel_size_one_is_planned_as_the_plain_model_the_trainer_trains():
    """apply_data_parallel trains the plain model under ZeRO-2/3 at dp=1 without offload: the same estimate."""
    planner, _cls, _cfg = _tiny_gpt_planner()
    base = PlanSettings(world_size=1, micro_batch_size=4, device="cpu")
    plain = planner.estimate(base)
    for stage in (2, 3):
        zero = planner.estimate(dataclasses.replace(base, zero_stage=stage))
        assert (zero.params, zero.grads, zero.optimizer, zero.peak) == (plain.params, plain.grads, plain.optimizer,
                                                                       plain.peak)
    # Offload still moves the state to host memory through FSDP.
    offloaded = planner.estimate(dataclasses.replace(base, zero_stage=3, offload=True, device="cuda"))
    assert offloaded.host > 0


def test_zero1_offload_moves_the_optimizer_state_to_the_host_row():
    """ZeRO-1 + offload (DeepSpeed's offload_optimizer): the device keeps parameters and gradients, the host this
    rank's optimizer state beside its shard's copies of parameters and gradients."""
    planner, _cls, _cfg = _tiny_gpt_planner()
    base = PlanSettings(world_size=2, data_parallel_size=2, zero_stage=1, micro_batch_size=4, device="cuda")
    zero1 = planner.estimate(base)
    offload = planner.estimate(dataclasses.replace(base, offload=True))
    assert (offload.params, offload.grads, offload.optimizer) == (zero1.params, zero1.grads, zero1.optimizer)
    assert zero1.host == 0 and offload.host >= offload.optimizer > 0
    # The shard is about half the parameters at dp=2: its two copies and its state, not the whole model's.
    assert offload.host < offload.optimizer + 2 * offload.params
    assert offload.peak <= zero1.peak - offload.optimizer
    zero3_offload = planner.estimate(dataclasses.replace(base, zero_stage=3, offload=True))
    assert zero3_offload.peak < offload.peak  # FSDP's offload moves the parameters and gradients too
    assert "ZeRO-1 + offload" in offload.settings.describe()
    # On a CPU the host copies of the shard's parameters and gradients are more of the same memory.
    on_cpu = planner.estimate(dataclasses.replace(base, offload=True, device="cpu"))
    copies = 2 * offload.optimizer / planner.state_ratio
    assert on_cpu.host == 0
    assert on_cpu.peak - planner.estimate(dataclasses.replace(base, device="cpu")).peak == pytest.approx(copies, abs=2)


def test_bad_layout_is_refused():
    planner, _cls, _cfg = _tiny_gpt_planner()
    with pytest.raises(UsageError, match="does not match the world size"):
        planner.estimate(PlanSettings(world_size=4, data_parallel_size=3))
    with pytest.raises(UsageError, match="tensor_parallel_size=3 does not divide"):
        planner.estimate(PlanSettings(world_size=3, tensor_parallel_size=3))


def test_startup_line_is_the_tools_estimate():
    """The line the trainer logs at start-up states the estimate tools/estimate_memory.py prints for the run."""
    from libai_lite.config import LazyConfig
    from libai_lite.planning import gib, planner_from_config, resolve_for_plan, startup_estimate

    def load():
        cfg = LazyConfig.load(str(ROOT / "projects/GPT/configs/gpt2_pretrain.py"))
        return LazyConfig.apply_overrides(cfg, ["model.cfg.hidden_layers=2", "model.cfg.max_seq_length=32",
                                                f"dataloader.train.data_prefix={ROOT}/data_test/gpt2/demo_gpt2_text_document",
                                                f"tokenization.tokenizer.vocab_file={ROOT}/data_test/gpt2/vocab.json",
                                                f"tokenization.tokenizer.merges_file={ROOT}/data_test/gpt2/merges.txt"])

    planner, settings = planner_from_config(load(), 1, "cpu")
    expected = planner.estimate(settings)
    spec, _ = resolve_for_plan(load(), 1)  # batch sizes and the padded vocabulary, as the trainer resolves them
    line = startup_estimate(spec, "cpu", planner.sample)
    assert line.startswith("Memory estimate per rank (pp=1 dp=1 tp=1, no ZeRO, micro-batch 8, fp32): ")
    assert f"peak {gib(expected.peak)}" in line and f"params {gib(expected.params)}" in line
    # An estimate that cannot be made says so instead of stopping the run.
    assert startup_estimate(spec, "cpu", {}).startswith("Memory estimate not available (")


def test_accelerator_kernels_hold_under_activation_checkpointing():
    """Planned for an accelerator, attention runs the fused kernel in the forward and in the checkpointed
    layers' recomputation alike (else the recomputed tensors would not match the saved ones); with attention
    dropout the fused kernel keeps less than the CPU's math path, which stores the [seq, seq] probabilities."""
    from libai_lite.planning import trace_activations
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    cfg = dict(hidden_layers=2, vocab_size=256, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
               max_seq_length=64, attention_dropout_prob=0.1)
    batch = {"input_ids": torch.zeros(2, 64, dtype=torch.long), "labels": torch.zeros(2, 64, dtype=torch.long)}

    def kept(**options):
        trace = trace_activations(lambda: GPTForPreTraining(cfg), batch, **options)
        return sum(e[0] for e in trace.events[:trace.forward_end])

    for amp in (None, torch.bfloat16):
        assert kept(amp_dtype=amp, activation_checkpoint_every=1, device="cuda") > 0
    assert kept(device="cuda") < kept(device="cpu")


def test_with_flex_forced_the_trace_runs_dense_attention_and_flex_still_runs_after_it(monkeypatch):
    """LIBAI_LITE_ATTENTION=flex: the start-up trace of MT5 once failed (flex's operator has no rule under
    its recorder), and the run's first real flex call then failed too ("Attempt to trace generator") and fell
    back to dense attention. Now the trace is the dense one and flex then trains (backward allowed on the CPU)."""
    import torch.nn.attention.flex_attention as torch_flex

    from libai_lite.layers import flex_attention as flex_module
    from libai_lite.layers.flex_attention import attention_backend
    from libai_lite.planning import trace_activations
    from projects.MT5 import MT5ForPreTraining

    cfg = dict(vocab_size=256, hidden_size=32, hidden_layers=2, num_attention_heads=4, head_size=8,
               intermediate_size=64, embedding_dropout_prob=0.0, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 12:] = False
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"encoder_input_ids": ids[:, :16], "decoder_input_ids": ids[:, 16:24], "labels": ids[:, 24:],
             "encoder_attn_mask": mask, "decoder_attn_mask": torch.ones(2, 8, dtype=torch.bool),
             "encoder_decoder_attn_mask": mask}
    with attention_backend("dense"):
        dense = trace_activations(lambda: MT5ForPreTraining(cfg), batch, device="cuda")
    monkeypatch.setattr(torch_flex, "_validate_device", lambda *args: None)
    flex_module._flex_or_dense.reset()
    try:
        with attention_backend("flex"):
            forced = trace_activations(lambda: MT5ForPreTraining(cfg), batch, device="cuda")
            MT5ForPreTraining(cfg)(**batch)["lm_loss"].backward()
        assert not flex_module._flex_or_dense.fell_back, flex_module._flex_or_dense.fallback_reason
    finally:
        flex_module._flex_or_dense.reset()
    assert forced.events == dense.events


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sequence-parallel"])
def test_tensor_parallel_activations_match_a_tp2_run(tmp_path, sequence_parallel):
    """What the forward keeps per rank under tp=2 (split attention/MLP interiors and vocabulary slice; with
    sequence parallelism the residual stream too, the blocks' gathered inputs whole), measured on two ranks."""
    worker = ROOT / "tests" / "tools" / "tp_memory_worker.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MALLOC_MMAP_THRESHOLD_="65536",
               MALLOC_TRIM_THRESHOLD_="0")
    out = tmp_path / "kept.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                           "127.0.0.1", "--master_port", str(free_port()), str(worker), str(int(sequence_parallel)), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(out.read_text())
    sys.path.insert(0, str(ROOT / "tests" / "tools"))
    from tp_memory_worker import CFG, MICRO_BATCH
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    seq = CFG["max_seq_length"]
    sample = {"input_ids": torch.zeros(seq, dtype=torch.long), "labels": torch.zeros(seq, dtype=torch.long)}
    planner = MemoryPlanner(lambda: GPTForPreTraining(CFG), sample)
    est = planner.estimate(PlanSettings(world_size=2, tensor_parallel_size=2, sequence_parallel=sequence_parallel,
                                        micro_batch_size=MICRO_BATCH, device="cpu"))
    assert abs(est.activations / measured - 1) <= TOLERANCE, (est.activations, measured)


def test_a_training_run_logs_its_memory_estimate_at_start_up(tmp_path):
    from tests.launch import tiny, train_net

    out = tmp_path / "run"
    r = train_net(tiny(out, tmp_path / "cache", "train.train_iter=1", "train.evaluation.enabled=False",
                       "train.log_memory_estimate=True"))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in (out / "log.txt").read_text().splitlines() if "Memory estimate per rank" in line]
    assert len(lines) == 1 and "peak" in lines[0] and "not available" not in lines[0], lines
