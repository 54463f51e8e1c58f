"""torchrun worker for tests/layers/test_moe.py: expert parallelism of a tiny MoE GPT (and MT5) on gloo.

    torchrun --nproc_per_node 2 tests/workers/moe_worker.py OUT_DIR     (writes OUT_DIR/ckpt_ep2: a checkpoint saved at ep=2)
    torchrun --nproc_per_node 4 tests/workers/moe_worker.py OUT_DIR     (reads OUT_DIR/ckpt_ep2)

Every rank takes its contiguous slice of one fixed global batch. For each layout (ep size x ZeRO
stage) the worker trains a few steps and records the losses, the first step's gradients and norm,
and the final parameters, gathered into full tensors of every expert; rank 0 writes them to
OUT_DIR/moe_{nproc}.pt, where the test compares every layout with ep=1 at the same data-parallel
size (the load-balancing loss is computed on each rank's own tokens, so the data-parallel split,
not the expert layout, defines the loss). Then it loads the ep=2 checkpoint under each layout and
records the loss of the steps that follow.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from projects.GPT.modeling.gpt_model import GPTForPreTraining  # noqa: E402
from projects.MT5 import MT5ForPreTraining  # noqa: E402

from libai_lite.checkpoint import Checkpointer  # noqa: E402
from libai_lite.parallel.clip_grad import clip_grad_norm_  # noqa: E402
from libai_lite.parallel.data_parallel import apply_data_parallel  # noqa: E402
from libai_lite.parallel.expert_parallel import apply_expert_parallel, build_expert_mesh  # noqa: E402

# Capacity high enough that no token is ever dropped, so every layout routes identically.
MOE = dict(enabled=True, num_experts=4, top_k=2, ep_size=1, capacity_factor=None, aux_loss_weight=0.1,
           every_n_layers=1)
GPT_CFG = dict(hidden_layers=2, vocab_size=128, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
               max_seq_length=16, embedding_dropout_prob=0.0, attention_dropout_prob=0.0, output_dropout_prob=0.0,
               moe=MOE)
MT5_CFG = dict(vocab_size=128, hidden_size=32, hidden_layers=1, num_attention_heads=4, head_size=8, intermediate_size=48,
               embedding_dropout_prob=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               moe=dict(MOE, top_k=1, capacity_factor=4.0))
GLOBAL_BATCH, SEQ, STEPS = 8, 16, 3
LR, MAX_NORM = 1e-2, 0.5
# The checkpoint is saved after CKPT_STEPS steps; the test compares the steps after it, the
# second of which depends on the loaded optimizer state as well as the weights.
CKPT_STEPS, RESUME_STEPS = 2, 4


def build(family: str):
    torch.manual_seed(0)
    return GPTForPreTraining(GPT_CFG) if family == "gpt" else MT5ForPreTraining(MT5_CFG)


def batches(family: str, steps: int) -> list[dict]:
    """`steps` fixed global batches as keyword arguments of the model."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        if family == "gpt":
            tokens = torch.randint(0, 128, (GLOBAL_BATCH, SEQ + 1), generator=g)
            out.append({"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
        else:
            out.append({
                "encoder_input_ids": torch.randint(0, 128, (GLOBAL_BATCH, 12), generator=g),
                "decoder_input_ids": torch.randint(0, 128, (GLOBAL_BATCH, 6), generator=g),
                "labels": torch.randint(0, 128, (GLOBAL_BATCH, 6), generator=g),
            })
    return out


def local_slice(batch: dict, rank: int, size: int) -> dict:
    per = GLOBAL_BATCH // size
    return {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}


def clean_name(name: str) -> str:
    return name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")


def full(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().float().cpu().clone()


def gather_named(tensors: dict) -> dict:
    """Merge every rank's {name: tensor}: each expert lives on its ep rank only."""
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, tensors)
    merged = {}
    for piece in pieces:
        for name, t in piece.items():
            merged.setdefault(name, t)
    return merged


def full_grads(model) -> dict:
    return gather_named({clean_name(n): full(p.grad) for n, p in model.named_parameters() if p.grad is not None})


def full_params(model) -> dict:
    return gather_named({clean_name(n): full(p) for n, p in model.named_parameters()})


def mean_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def parallelize(family: str, ep: int, zero_stage: int, mesh):
    """The model under `ep` x data parallel at `zero_stage`, as DefaultTrainer.parallelize builds it."""
    model = build(family)
    expert_mesh = None
    if ep > 1:
        expert = build_expert_mesh(mesh, ep)
        apply_expert_parallel(model, expert)
        expert_mesh = expert["edp"]
    model = apply_data_parallel(model, mesh["dp"], zero_stage, expert_mesh=expert_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    return model, opt


def train_step(model, opt, batch: dict, rank: int, size: int) -> list[float]:
    out = model(**local_slice(batch, rank, size))
    loss = out["lm_loss"] + out["moe_aux_loss"]
    loss.backward()
    return [float(out["lm_loss"].detach()), float(out["moe_aux_loss"].detach())]


def run_layout(family: str, ep: int, zero_stage: int, mesh) -> dict:
    model, opt = parallelize(family, ep, zero_stage, mesh)
    rank, size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    result = {"losses": []}
    for step, batch in enumerate(batches(family, STEPS)):
        losses = train_step(model, opt, batch, rank, size)
        if step == 0:
            result["grads"] = full_grads(model)
        norm = clip_grad_norm_(list(model.parameters()), MAX_NORM)
        if step == 0:
            result["norm"] = norm
        opt.step()
        opt.zero_grad(set_to_none=True)
        result["losses"].append(mean_over_ranks(losses))
    result["params"] = full_params(model)
    result["num_local_experts"] = sum(1 for n, _ in model.named_parameters() if "experts" in n)
    return result


def resume_layout(ckpt: str, ep: int, zero_stage: int, mesh) -> list[list[float]]:
    """Load the ep=2 checkpoint (weights and optimizer) and train the steps after it."""
    model, opt = parallelize("gpt", ep, zero_stage, mesh)
    Checkpointer(model, opt).load(ckpt)
    rank, size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    losses = []
    for batch in batches("gpt", RESUME_STEPS)[CKPT_STEPS:]:
        losses.append(mean_over_ranks(train_step(model, opt, batch, rank, size)))
        clip_grad_norm_(list(model.parameters()), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def save_ep2_checkpoint(out_dir: str, mesh) -> list[list[float]]:
    """Train at ep=2 with ZeRO-2, save after CKPT_STEPS, and record the loss of the steps after it."""
    model, opt = parallelize("gpt", 2, 2, mesh)
    rank, size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    after = []
    for step, batch in enumerate(batches("gpt", RESUME_STEPS)):
        if step == CKPT_STEPS:
            Checkpointer(model, opt, out_dir).save("ckpt_ep2", {"iteration": step - 1})
        losses = mean_over_ranks(train_step(model, opt, batch, rank, size))
        clip_grad_norm_(list(model.parameters()), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= CKPT_STEPS:
            after.append(losses)
    return after


def main() -> None:
    out_dir = sys.argv[1]
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("pp", "dp", "tp"))
    results = {"layouts": {}, "resumed": {}}
    try:
        layouts = [("gpt", 1, 0), ("gpt", 2, 0), ("gpt", 2, 2)]
        if world == 2:
            layouts += [("mt5", 1, 0), ("mt5", 2, 2)]
        else:
            layouts += [("gpt", 4, 2), ("gpt", 4, 3)]
        for family, ep, stage in layouts:
            results["layouts"][(family, ep, stage)] = run_layout(family, ep, stage, mesh)
        ckpt = os.path.join(out_dir, "ckpt_ep2")
        if world == 2:
            results["saved_then"] = save_ep2_checkpoint(out_dir, mesh)
            resumes = [(2, 2), (1, 0)]
        else:
            resumes = [(4, 2), (2, 0), (1, 0)]
        dist.barrier()
        for ep, stage in resumes:
            results["resumed"][(ep, stage)] = resume_layout(ckpt, ep, stage, mesh)
        if dist.get_rank() == 0:
            torch.save(results, os.path.join(out_dir, f"moe_{world}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from tests.workers import run_and_exit

    run_and_exit(main)
