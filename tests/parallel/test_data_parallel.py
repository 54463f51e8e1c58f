"""Data parallel, ZeRO-1/2/3, CPU offload, FSDP mixed precision and activation checkpointing.

The multi-process tests launch `tests/workers/dp_worker.py` under torchrun (gloo, CPU) once per group of
checks and compare what it writes with one process over the whole global batch.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.workers import dp_worker
from tests.launch import free_port, spawn_ranks, torchrun
from tests.workers.dp_worker import (CFG, DCP_MODES, DCP_STEPS, MODES, TP_MODES, batches, build_model, param_groups,
                                     reference_run)

from libai_lite.converters.activation_checkpoint import apply_activation_checkpointing, is_checkpointed, transformer_layers
from libai_lite.parallel.clip_grad import clip_grad_norm_
from libai_lite.parallel.data_parallel import apply_data_parallel, no_sync_context, validate_zero_config
from libai_lite.utils.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
FP32_MODES = [m for m, (_, _, dtype, _, _) in MODES.items() if dtype is None]



def _assert_tensors_close(got: dict, want: dict, what: str, **tol) -> None:
    assert set(got) == set(want), f"{what}: names differ {sorted(set(got) ^ set(want))}"
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m: f"{what} {name}: {m}", **tol)


@pytest.fixture(scope="module")
def reference():
    return reference_run()


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("stage", [4, -1, "2", 1.0, True])
def test_unknown_zero_stage_is_a_usage_error(stage):
    with pytest.raises(UsageError, match="does not exist; use 0"):
        apply_data_parallel(torch.nn.Linear(2, 2), None, stage)


@pytest.mark.parametrize("stage", [None, 0])
def test_offload_without_zero_is_a_usage_error(stage):
    with pytest.raises(UsageError, match=r"ZeRO is off \(stage 0\); use ZeRO stage 1 .* or 2/3"):
        apply_data_parallel(torch.nn.Linear(2, 2), None, stage, offload=True)


def test_zero1_with_offload_is_accepted_and_keeps_the_plain_model_at_dp1():
    """ZeRO-1 + offload (DeepSpeed's offload_optimizer) moves only the optimizer: no FSDP, the module as it was."""
    assert validate_zero_config(1, offload=True) == 1
    model = torch.nn.Linear(2, 2)

    class _OneRankMesh:
        def size(self):
            return 1

    assert apply_data_parallel(model, _OneRankMesh(), 1, offload=True) is model


def test_param_dtype_without_fsdp_is_a_usage_error():
    with pytest.raises(UsageError, match="use ZeRO stage 2 or 3"):
        validate_zero_config(1, param_dtype=torch.bfloat16)
    assert validate_zero_config(None) == 0 and validate_zero_config(3, True, torch.bfloat16) == 3


def test_activation_checkpointing_bad_input():
    with pytest.raises(UsageError, match="at least 1"):
        apply_activation_checkpointing(build_model(), every_n_layers=0)
    with pytest.raises(UsageError, match="found no transformer layers"):
        apply_activation_checkpointing(torch.nn.Sequential(torch.nn.Linear(2, 2)))


# ---------------------------------------------------------------- single process


def _grads_after_backward(model, x, y, seed: int = 5) -> dict:
    torch.manual_seed(seed)  # same dropout masks for both runs
    model(x, y)["lm_loss"].backward()
    return {dp_worker.clean_name(n): p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_same_grads_and_keys_and_recomputes():
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    # Dropout on: the recomputation must replay the same masks (RNG state is preserved).
    cfg = dict(CFG, embedding_dropout_prob=0.1, attention_dropout_prob=0.1, output_dropout_prob=0.1, hidden_layers=3)
    torch.manual_seed(0)
    plain = dp_worker.GPTForPreTraining(cfg)
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt)
    assert all(is_checkpointed(layer) for layer in transformer_layers(ckpt))

    calls = []
    # A pre-hook: recomputation stops early once the last saved activation is rebuilt, before
    # the MLP's forward returns, so a post-forward hook would not see it.
    transformer_layers(ckpt)[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    x, y = batches(1)[0]
    want = _grads_after_backward(plain, x, y)
    got = _grads_after_backward(ckpt, x, y)
    assert len(calls) == 2, "a checkpointed layer runs forward again during backward"
    _assert_tensors_close(got, want, "grads with activation checkpointing", rtol=0, atol=1e-6)

    assert list(ckpt.state_dict()) == list(plain.state_dict())
    assert list(get_model_state_dict(ckpt)) == list(get_model_state_dict(plain))
    opt_plain = torch.optim.AdamW(param_groups(plain))
    opt_ckpt = torch.optim.AdamW(param_groups(ckpt))
    _, osd_plain = get_state_dict(plain, opt_plain)
    _, osd_ckpt = get_state_dict(ckpt, opt_ckpt)
    assert list(osd_ckpt["state"]) == list(osd_plain["state"])
    assert [g["params"] for g in osd_ckpt["param_groups"]] == [g["params"] for g in osd_plain["param_groups"]]
    # A checkpoint-wrapped model loads a plain model's state_dict unchanged.
    ckpt.load_state_dict(plain.state_dict())


def test_activation_checkpointing_every_n_layers():
    model = dp_worker.GPTForPreTraining(dict(CFG, hidden_layers=5))
    apply_activation_checkpointing(model, every_n_layers=2)
    assert [is_checkpointed(layer) for layer in transformer_layers(model)] == [False, True, False, True, False]
    assert [layer.layer_idx for layer in transformer_layers(model)] == [0, 1, 2, 3, 4]
    # Applying again leaves wrapped layers alone (no double wrapping).
    apply_activation_checkpointing(model, every_n_layers=1)
    assert all(is_checkpointed(layer) for layer in transformer_layers(model))
    assert not any(is_checkpointed(layer._checkpoint_wrapped_module) for layer in transformer_layers(model))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.05, 1e9])
def test_clip_grad_norm_matches_torch_on_plain_tensors(norm_type, max_norm):
    x, y = batches(1)[0]
    ours, theirs = build_model(), build_model()
    for m in (ours, theirs):
        m(x, y)["lm_loss"].backward()
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, norm_type=norm_type)
    got = clip_grad_norm_(ours.parameters(), max_norm, norm_type=norm_type)
    # A 0-d tensor, as torch returns it: reading it back would stall a GPU every step.
    assert torch.is_tensor(got) and got.dim() == 0
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9, msg=lambda m: f"{n}: {m}")


def test_no_sync_context_is_a_no_op_for_a_plain_module():
    """A plain module has no gradient reduction to defer: backward inside the context accumulates as outside."""
    x, y = batches(1)[0]
    inside, outside = build_model(), build_model()
    with no_sync_context(inside, is_last_microbatch=False):
        inside(x, y)["lm_loss"].backward()
    outside(x, y)["lm_loss"].backward()
    for (n, p), q in zip(inside.named_parameters(), outside.parameters()):
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")


# ---------------------------------------------------------------- multi process


def test_dp2_every_zero_stage_matches_one_process(tmp_path, reference):
    """DDP, ZeRO-1/2/3, ZeRO-1+offload, ZeRO-3+offload, ZeRO-2 bf16, ZeRO-3+AC, and accumulation over 2
    micro-batches."""
    torchrun(2, "tests/workers/dp_worker.py", "numerics", str(tmp_path))
    results = torch.load(tmp_path / "numerics.pt")
    assert set(results) == set(MODES)
    for name in FP32_MODES:
        r = results[name]
        _assert_tensors_close(r["grads"], reference["grads"], f"{name} first-step grads", rtol=1e-4, atol=1e-6)
        assert float(r["norm"]) == pytest.approx(float(reference["norm"]), rel=1e-5), name
        # ZeRO-1's sharded optimizer step must update every parameter as one optimizer would.
        _assert_tensors_close(r["params_after_first_step"], reference["params_after_first_step"],
                              f"{name} params after one AdamW step", rtol=0, atol=1e-5)
        assert max(abs(a - b) for a, b in zip(r["losses"], reference["losses"])) < 1e-4, name
        # The weight-decay groups survive the wrapping (and ZeRO-1's partitioning).
        assert r["weight_decays"] == [0.1, 0.0, 0.0] and r["param_group_sizes"] == [10, 10, 8], name
    for name in ("ddp_accumulate", "zero3_accumulate"):
        assert results[name]["first_micro_unsynced"], f"{name}: gradients were reduced on a non-final micro-batch"
    bf16 = results["zero2_bf16"]
    assert set(bf16["grads"]) == set(reference["grads"])
    for name, want in reference["grads"].items():
        rel = float((bf16["grads"][name] - want).norm() / want.norm())
        assert rel < 5e-2, f"zero2_bf16 grad {name} relative error {rel:.3g}"
    assert max(abs(a - b) for a, b in zip(bf16["losses"], reference["losses"])) < 3e-2


def _single_process_checkpoint(path: Path):
    """Train DCP_STEPS steps in one process and save a DCP checkpoint (no process group)."""
    model = build_model()
    opt = torch.optim.AdamW(param_groups(model), **dp_worker.OPTIM)
    dp_worker.train_steps(model, opt, 0, 1, batches(DCP_STEPS))
    dp_worker.save_checkpoint(model, opt, str(path))
    return model, opt


def test_dcp_checkpoints_move_between_zero_dp2_and_one_process(tmp_path):
    model, opt = _single_process_checkpoint(tmp_path / "ckpt_single")
    want_params = dp_worker.full_params(model)
    want_optim = dp_worker.full_optim_state(model, opt)
    dp_worker.train_steps(model, opt, 0, 1, batches(DCP_STEPS + 1)[DCP_STEPS:])
    want_next = dp_worker.full_params(model)
    assert len(want_optim) == len(want_params) and all("exp_avg" in s for s in want_optim.values())

    torchrun(2, "tests/workers/dp_worker.py", "dcp", str(tmp_path))
    results = torch.load(tmp_path / "dcp.pt")
    for name in DCP_MODES:
        loaded = results[f"{name}_loaded_single"]
        _assert_tensors_close(loaded["params"], want_params, f"{name} loaded params", rtol=0, atol=0)
        assert set(loaded["optim"]) == set(want_optim)
        for fqn, state in want_optim.items():
            _assert_tensors_close(loaded["optim"][fqn], state, f"{name} loaded optimizer state {fqn}", rtol=0, atol=0)
        _assert_tensors_close(loaded["params_next_step"], want_next, f"{name} step after loading", rtol=0, atol=1e-5)

        # And back: the dp=2 checkpoint into one process, optimizer state included, bit for bit.
        saved = results[f"{name}_saved"]
        fresh = build_model()
        fresh_opt = torch.optim.AdamW(param_groups(fresh), **dp_worker.OPTIM)
        dp_worker.load_checkpoint(fresh, fresh_opt, str(tmp_path / f"ckpt_{name}"))
        _assert_tensors_close(dp_worker.full_params(fresh), saved["params"], f"{name} checkpoint params", rtol=0, atol=0)
        got_optim = dp_worker.full_optim_state(fresh, fresh_opt)
        assert set(got_optim) == set(want_optim) == set(saved["optim"])
        for fqn, state in saved["optim"].items():
            assert float(got_optim[fqn]["step"]) == DCP_STEPS, f"{name} {fqn} step count"
            _assert_tensors_close(got_optim[fqn], state, f"{name} checkpoint optimizer state {fqn}", rtol=0, atol=0)
        # It is the same training as one process (Adam amplifies float noise on near-zero gradients).
        _assert_tensors_close(saved["params"], want_params, f"{name} dp=2 training", rtol=0, atol=1e-4)
        assert fresh_opt.param_groups[0]["weight_decay"] == 0.1


# With -m slow: test_parallel_e2e's dp2_tp2_zero2 runs the same composition by default.
@pytest.mark.slow
def test_dp2_tp2_data_parallel_composes_with_tensor_parallel(tmp_path):
    """dp=2 x tp=2: FSDP2 replicate (no ZeRO), ZeRO-2 and ZeRO-3+AC over DTensor (tp) parameters."""
    torchrun(4, "tests/workers/dp_worker.py", "tp", str(tmp_path))
    results = torch.load(tmp_path / "tp.pt")
    ref = reference_run(steps=1)
    for name in TP_MODES:
        r = results[name]
        # Parameters split by tp and plain ones end on different meshes: the case torch's clip cannot take.
        assert r["grad_meshes"] == [("dp",), ("dp", "tp")], name
        assert r["loss"] == pytest.approx(ref["losses"][0], abs=1e-5), name
        _assert_tensors_close(r["grads"], ref["grads"], f"{name} grads", rtol=1e-4, atol=1e-6)
        assert float(r["norm"]) == pytest.approx(float(ref["norm"]), rel=1e-5), name
        _assert_tensors_close(r["params_after_first_step"], ref["params_after_first_step"], f"{name} params", rtol=0, atol=1e-5)


@pytest.mark.slow  # tests/tools/test_estimate_memory.py runs two of its rows by default
def test_memory_benchmark_smoke():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "bench/memory.py", "--smoke"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"no_zero", "zero1", "zero2", "zero3", "zero3_offload"} <= set(result["configs"])
    for row in result["configs"].values():
        assert row["param_bytes"] > 0 and row["optimizer_bytes"] > 0


def _step_with_overflow_on_rank_1(rank: int, world: int, port: int, out: str, plain: bool) -> None:
    import torch.distributed as dist

    from libai_lite.engine.amp import build_loss_scaler

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)  # the same weights on both ranks
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)  # the configs' optimizer
    scaler = (torch.amp.GradScaler("cpu", init_scale=256.0) if plain
              else build_loss_scaler(torch.device("cpu"), 256.0, 1000))
    before = model.weight.detach().clone()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    if rank == 1:  # e.g. an expert, or a ZeRO shard, that only this rank holds overflowed
        model.weight.grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    torch.save({"stepped": not torch.equal(before, model.weight.detach()), "scale": scaler.get_scale()},
               os.path.join(out, f"{rank}.pt"))
    # Every rank past its last collective before teardown: tearing gloo down while a peer still
    # talks to it can abort the process ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


# torch's own GradScaler with -m slow: the trainer builds its scaler with build_loss_scaler.
@pytest.mark.parametrize("plain", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["build_loss_scaler", "plain-GradScaler"])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path, plain):
    spawn_ranks(_step_with_overflow_on_rank_1, 2, (2, free_port(), str(tmp_path), plain))
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    if plain:
        # What the synchronised scaler prevents: rank 0 steps, rank 1 skips, the replicas part ways.
        assert [r["stepped"] for r in ranks] == [True, False]
        return
    assert [r["stepped"] for r in ranks] == [False, False]
    assert [r["scale"] for r in ranks] == [128.0, 128.0]


def _offload_step_after_a_weight_load(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from libai_lite.parallel.data_parallel import build_zero1_optimizer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for name in ("plain", "offload"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        opt = (torch.optim.AdamW(model.parameters(), lr=0.1) if name == "plain" else
               build_zero1_optimizer(torch.optim.AdamW, model.parameters(), dist.group.WORLD, offload=True, lr=0.1))
        for step in range(2):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == 0:  # as a checkpoint load or a weights-only load writes the device weights
                model.load_state_dict({k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()})
        results[name] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(results, os.path.join(out, f"{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_zero1_offload_steps_from_the_weights_on_the_device(tmp_path):
    """The host copies are refreshed from the device each step: weights loaded between steps are what the next
    step updates, as with a plain optimizer (a host copy kept as the master would undo the load)."""
    spawn_ranks(_offload_step_after_a_weight_load, 2, (2, free_port(), str(tmp_path)))
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        _assert_tensors_close(got["offload"], got["plain"], f"rank {rank} after a load and a step", rtol=0, atol=1e-6)
