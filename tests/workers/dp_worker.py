"""torchrun worker for tests/parallel/test_data_parallel.py: data parallel / ZeRO runs of a tiny GPT on gloo.

    torchrun --nproc_per_node 2 tests/workers/dp_worker.py numerics OUT_DIR
    torchrun --nproc_per_node 2 tests/workers/dp_worker.py dcp OUT_DIR      (reads OUT_DIR/ckpt_single)
    torchrun --nproc_per_node 4 tests/workers/dp_worker.py tp OUT_DIR       (dp=2 x tp=2)

Every rank takes its contiguous slice of one fixed global batch; rank 0 writes what the test
compares with a single process over the whole batch (`reference_run` below, imported by the test):
losses averaged over ranks, gradients and parameters as full tensors.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from projects.GPT.modeling.gpt_model import GPTForPreTraining  # noqa: E402

from libai_lite.optim.build import get_default_optimizer_params  # noqa: E402
from libai_lite.converters.activation_checkpoint import apply_activation_checkpointing  # noqa: E402
from libai_lite.parallel.clip_grad import clip_grad_norm_  # noqa: E402
from libai_lite.parallel.data_parallel import (  # noqa: E402
    apply_data_parallel,
    build_zero1_optimizer,
    no_sync_context,
)

CFG = dict(
    hidden_layers=2,
    vocab_size=128,
    hidden_size=32,
    ffn_hidden_size=64,
    num_attention_heads=4,
    max_seq_length=16,
    embedding_dropout_prob=0.0,
    attention_dropout_prob=0.0,
    output_dropout_prob=0.0,
)
GLOBAL_BATCH, SEQ, STEPS = 4, 16, 10
OPTIM = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
WEIGHT_DECAY, MAX_NORM = 0.1, 1.0

# name -> (zero_stage, offload, param_dtype, activation checkpointing, micro-batches per rank)
MODES = {
    "ddp": (0, False, None, False, 1),
    "zero1": (1, False, None, False, 1),
    "zero1_offload": (1, True, None, False, 1),
    "zero2": (2, False, None, False, 1),
    "zero3": (3, False, None, False, 1),
    "zero3_offload": (3, True, None, False, 1),
    "zero2_bf16": (2, False, torch.bfloat16, False, 1),
    "zero3_ac": (3, False, None, True, 1),
    "ddp_accumulate": (0, False, None, False, 2),
    "zero3_accumulate": (3, False, None, False, 2),
}


def build_model() -> GPTForPreTraining:
    """The tiny GPT, identical on every process (same seed, same CPU kernels)."""
    torch.manual_seed(0)
    return GPTForPreTraining(CFG)


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` fixed global batches of (input_ids, labels)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, CFG["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def param_groups(model):
    """Weight-decay groups as the trainer builds them (biases and norms without decay)."""
    return get_default_optimizer_params(model, weight_decay=WEIGHT_DECAY)


def clean_name(name: str) -> str:
    """Parameter name without the DDP / checkpoint-wrapper prefixes, as in the state_dict."""
    return name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")


def full(t: torch.Tensor) -> torch.Tensor:
    """A full, plain fp32 CPU copy of a tensor or DTensor."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().float().cpu().clone()


def full_grads(model) -> dict[str, torch.Tensor]:
    return {clean_name(n): full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def full_params(model) -> dict[str, torch.Tensor]:
    return {clean_name(n): full(p) for n, p in model.named_parameters()}


def reference_run(steps: int = STEPS) -> dict:
    """One process over the whole global batch: first-step loss/grads/norm, loss curve, final params."""
    model = build_model()
    opt = torch.optim.AdamW(param_groups(model), **OPTIM)
    result = {"losses": []}
    for step, (x, y) in enumerate(batches(steps)):
        loss = model(x, y)["lm_loss"]
        loss.backward()
        if step == 0:
            result["grads"] = full_grads(model)
        norm = clip_grad_norm_(model.parameters(), MAX_NORM)
        if step == 0:
            result["norm"] = norm
        opt.step()
        opt.zero_grad(set_to_none=True)
        result["losses"].append(float(loss.detach()))
        if step == 0:
            result["params_after_first_step"] = full_params(model)
    result["params"] = full_params(model)
    return result


def _mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _local_slice(x: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    per = x.shape[0] // dp_size
    return x[dp_rank * per : (dp_rank + 1) * per]


def _gradients_not_reduced(model) -> bool:
    """After a micro-batch under no_sync_context(..., False): did no gradient reduction happen?

    FSDP2 leaves the sharded `.grad` unset until it reduce-scatters; DDP leaves each rank's own
    local gradient, which differs between ranks that saw different samples.
    """
    grads = [p.grad for p in model.parameters()]
    if all(g is None for g in grads):
        return True
    mine = next(g for g in grads if g is not None).detach().clone()
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, mine)
    return not all(torch.equal(pieces[0], other) for other in pieces[1:])


def build_optimizer(model, zero_stage: int, dp_mesh, offload: bool = False):
    """AdamW with weight-decay groups; ZeRO-1 shards it over dp (and with ``offload`` steps it on the host)."""
    raw = model.module if hasattr(model, "module") else model
    if zero_stage == 1:
        return build_zero1_optimizer(torch.optim.AdamW, param_groups(raw), dp_mesh.get_group(), offload=offload,
                                     **OPTIM)
    return torch.optim.AdamW(param_groups(raw), **OPTIM)


def train_mode(name: str, dp_mesh, steps: int = STEPS, model=None) -> dict:
    """Run `steps` steps of one mode; the first step's grads/norm and the loss curve."""
    stage, offload, param_dtype, ac, micro = MODES[name]
    if model is None:
        model = build_model()
    if ac:
        apply_activation_checkpointing(model)
    model = apply_data_parallel(model, dp_mesh, stage, offload=offload, param_dtype=param_dtype)
    opt = build_optimizer(model, stage, dp_mesh, offload)
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    result = {"losses": []}
    for step, (x, y) in enumerate(batches(steps)):
        x, y = _local_slice(x, dp_rank, dp_size), _local_slice(y, dp_rank, dp_size)
        total = 0.0
        for m, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            with no_sync_context(model, m == micro - 1):
                loss = model(xm, ym)["lm_loss"] / micro
                loss.backward()
            total += float(loss.detach())
            if step == 0 and m == 0 and micro > 1:
                result["first_micro_unsynced"] = _gradients_not_reduced(model)
        if step == 0:
            result["grads"] = full_grads(model)
        norm = clip_grad_norm_(model.parameters(), MAX_NORM)
        if step == 0:
            result["norm"] = norm
        opt.step()
        opt.zero_grad(set_to_none=True)
        result["losses"].append(_mean_over_ranks(total))
        if step == 0:
            result["params_after_first_step"] = full_params(model)
    result["params"] = full_params(model)
    result["param_group_sizes"] = [len(g["params"]) for g in opt.param_groups]
    result["weight_decays"] = [g["weight_decay"] for g in opt.param_groups]
    return result


def run_numerics(out_dir: str, dp_mesh) -> None:
    results = {name: train_mode(name, dp_mesh) for name in MODES}
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "numerics.pt"))


# ------------------------------------------------------------------ checkpoints (DCP)

DCP_STEPS = 3
DCP_MODES = ("zero3", "zero1", "zero1_offload")


def full_optim_state(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    """Optimizer state keyed by parameter name with full tensors, whatever the sharding."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _, osd = get_state_dict(model, opt)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, state in osd["state"].items():
        if state:
            out[fqn] = {k: full(v) if torch.is_tensor(v) else v for k, v in state.items()}
    if dist.is_initialized() and dist.get_world_size() > 1:
        # ZeRO-1 keeps each parameter's state on its owner only: merge the ranks' pieces.
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, out)
        for piece in pieces:
            for fqn, state in piece.items():
                out.setdefault(fqn, state)
    return out


def train_steps(model, opt, dp_rank: int, dp_size: int, steps) -> None:
    for x, y in steps:
        x, y = _local_slice(x, dp_rank, dp_size), _local_slice(y, dp_rank, dp_size)
        model(x, y)["lm_loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def save_checkpoint(model, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def load_checkpoint(model, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def run_dcp(out_dir: str, dp_mesh) -> None:
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    results = {}
    for name in DCP_MODES:
        stage, offload = MODES[name][:2]
        # A single-process checkpoint loaded here: parameters, optimizer state, and one more step.
        model = apply_data_parallel(build_model(), dp_mesh, stage, offload=offload)
        opt = build_optimizer(model, stage, dp_mesh, offload)
        load_checkpoint(model, opt, os.path.join(out_dir, "ckpt_single"))
        loaded = {"params": full_params(model), "optim": full_optim_state(model, opt)}
        train_steps(model, opt, dp_rank, dp_size, batches(DCP_STEPS + 1)[DCP_STEPS:])
        loaded["params_next_step"] = full_params(model)
        results[f"{name}_loaded_single"] = loaded
        # Trained here and saved for the single process to load.
        model = apply_data_parallel(build_model(), dp_mesh, stage, offload=offload)
        opt = build_optimizer(model, stage, dp_mesh, offload)
        train_steps(model, opt, dp_rank, dp_size, batches(DCP_STEPS))
        save_checkpoint(model, opt, os.path.join(out_dir, f"ckpt_{name}"))
        results[f"{name}_saved"] = {"params": full_params(model), "optim": full_optim_state(model, opt)}
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "dcp.pt"))


# ------------------------------------------------------------------ with tensor parallelism

TP_MODES = {"replicate_tp": 0, "zero2_tp": 2, "zero3_tp_ac": 3}


def apply_test_tp(model, tp_mesh) -> None:
    """A minimal Megatron MLP split so parameters are DTensors on the tp mesh (others stay plain)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in model.GPT_model.layers.values():
        parallelize_module(layer.mlp, tp_mesh, {"dense_h_to_4h": ColwiseParallel(), "dense_4h_to_h": RowwiseParallel()})


def run_tp(out_dir: str, mesh) -> None:
    results = {}
    for name, stage in TP_MODES.items():
        model = build_model()
        apply_test_tp(model, mesh["tp"])
        if name.endswith("_ac"):
            apply_activation_checkpointing(model)
        model = apply_data_parallel(model, mesh["dp"], stage, tp_enabled=True)
        opt = torch.optim.AdamW(param_groups(model), **OPTIM)
        dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
        x, y = batches(1)[0]
        loss = model(_local_slice(x, dp_rank, dp_size), _local_slice(y, dp_rank, dp_size))["lm_loss"]
        loss.backward()
        grads = full_grads(model)
        meshes = sorted({tuple(p.grad.device_mesh.mesh_dim_names) for p in model.parameters() if hasattr(p.grad, "device_mesh")})
        norm = clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        results[name] = {
            "loss": _mean_over_ranks(float(loss)),
            "grads": grads,
            "norm": norm,
            "grad_meshes": meshes,
            "params_after_first_step": full_params(model),
        }
    if dist.get_rank() == 0:
        torch.save(results, os.path.join(out_dir, "tp.pt"))


def main() -> None:
    group, out_dir = sys.argv[1], sys.argv[2]
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    tp = 2 if group == "tp" else 1
    mesh = init_device_mesh("cpu", (1, world // tp, tp), mesh_dim_names=("pp", "dp", "tp"))
    try:
        if group == "numerics":
            run_numerics(out_dir, mesh["dp"])
        elif group == "dcp":
            run_dcp(out_dir, mesh["dp"])
        elif group == "tp":
            run_tp(out_dir, mesh)
        else:
            raise SystemExit(f"unknown group {group!r}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from tests.workers import run_and_exit

    run_and_exit(main)
