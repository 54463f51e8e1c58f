"""torchrun worker for tests/parallel/test_pipeline_parallel.py: one pipeline schedule, several checks per launch.

    torchrun --nproc_per_node 2|4 tests/workers/pp_worker.py WORKDIR SCHEDULE VIRTUAL_STAGES PHASE[,PHASE...]

SCHEDULE and VIRTUAL_STAGES may be comma-separated lists of equal length: the phases then run for
each schedule in turn in one launch (tests/parallel/test_pipeline_schedules.py), and `grads` writes
`{schedule}_v{virtual}_grads_rank{r}.pt`.

WORKDIR holds `data.pt` (model cfg, seed, batch, optimizer settings) written by the test; each
phase writes `{schedule}_{phase}_rank{r}.pt` there. Phases:

  grads         one step on the fixed batch: loss, every gradient by FQN, the total grad norm;
                then the same step with a GradScaler (loss and gradients scaled by 256)
  grads_custom  the same with train.dist.custom_pipeline_stage_id-style split [0, 0, 0, 1]
  train         `steps` AdamW steps with clipping (losses, norms), eval_step, a DCP save with the
                optimizer to `ckpt_pp2_{schedule}/`, and the final parameters
  resume        a meta-device build materialised per stage, tied copies broadcast, then the
                one-process checkpoint `ckpt_pp1/` loaded (model + optimizer) and trained on
  fp16          `fp16_steps` AdamW steps the fp16 trainer's way (autocast, synced loss scaler from
                `fp16_init_scale`, unscale, clip, step, update): losses, norms, loss scales
  fsdp          (4 processes: pp=2 x dp=2) stage modules under FSDP2 `fully_shard`; each dp rank
                steps on its half of `dp_input_ids`, with clipping over DTensor gradients
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from libai_lite.parallel.pipeline import PipelineStepper  # noqa: E402
from libai_lite.parallel.pipeline_split import (  # noqa: E402
    alias_state_dict_keys,
    broadcast_tied_weights,
    build_stage_modules,
    build_tied_weight_group,
    local_stage_ids,
    materialize_stage,
    pipeline_model_view,
    tied_checkpoint_aliases,
)
from libai_lite.utils.distributed import destroy, setup_dist  # noqa: E402
from libai_lite.utils.parallel_dims import layer_stages  # noqa: E402
from projects.GPT.modeling.gpt_model import GPTForPreTraining, GPTModel  # noqa: E402

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Pipeline:
    """One model cut for this rank, its checkpoint view, tie group and stepper."""

    def __init__(self, ctx, data, schedule, virtual, custom=None, meta=False, fsdp=False):
        num_layers = data["cfg"]["hidden_layers"]
        pp = ctx.pipeline_parallel_size
        self.num_stages = pp * virtual
        stage_of_layer = layer_stages(num_layers, self.num_stages, custom)
        self.stage_ids = local_stage_ids(ctx.pp_rank, pp, virtual, schedule)
        torch.manual_seed(data["seed"])
        if meta:
            with torch.device("meta"):
                model = GPTForPreTraining(data["cfg"])
        else:
            model = GPTForPreTraining(data["cfg"])
        self.stages, models = build_stage_modules(model, self.stage_ids, self.num_stages, stage_of_layer)
        if meta:
            for stage in self.stages:
                materialize_stage(stage, ctx.device)
        if fsdp:
            # As torchtitan does under pipelining: parameters stay gathered between micro-batches.
            for stage in self.stages:
                for layer in stage.layers.values():
                    fully_shard(layer, mesh=ctx.mesh["dp"], reshard_after_forward=False)
                fully_shard(stage, mesh=ctx.mesh["dp"], reshard_after_forward=False)
        self.view = pipeline_model_view(models)
        self.tied_group = build_tied_weight_group(ctx.mesh, schedule=schedule, virtual_stages=virtual)
        if meta:
            broadcast_tied_weights(self.stages, self.tied_group)
        self.stepper = PipelineStepper(
            self.stages, self.stage_ids, self.num_stages, ctx.group("pp"), ctx.device, schedule,
            data["n_microbatches"], model.pipeline_loss_fn, self.tied_group, batch_fn=model.pipeline_batch,
        )

    def step(self, data, **options):
        """One step on the data's batch, split as the trainer splits a loader batch (labels reach the
        stages as ``lm_labels`` for the fused head)."""
        args, kwargs, labels = self.stepper.split_batch({"input_ids": data["input_ids"], "labels": data["labels"]})
        return self.stepper.step(args, labels, kwargs=kwargs, **options)

    def eval_step(self, data):
        args, kwargs, labels = self.stepper.split_batch({"input_ids": data["input_ids"], "labels": data["labels"]})
        return self.stepper.eval_step(args, labels, kwargs=kwargs)

    def optimizer(self, data):
        return torch.optim.AdamW(self.view.parameters(), lr=data["lr"], weight_decay=data["weight_decay"])


def _save(workdir, name, rank, obj):
    torch.save(obj, os.path.join(workdir, f"{name}_rank{rank}.pt"))


def _params(view):
    return {n: p.detach().clone() for n, p in view.named_parameters()}


def phase_grads(ctx, data, workdir, schedule, virtual, custom=None, tag="grads"):
    pipe = Pipeline(ctx, data, schedule, virtual, custom)
    loss = pipe.step(data)
    grads = {n: p.grad.detach().clone() for n, p in pipe.view.named_parameters()}
    norm = pipe.stepper.clip_grad_norm_(float("inf"))
    layers = sorted(int(k) for s in pipe.stages for k in s.layers.keys())
    # The fp16 path: every micro-batch loss scaled before backward, the reported loss not.
    for p in pipe.view.parameters():
        p.grad = None
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaled_loss = pipe.step(data, grad_scaler=scaler)
    scaled_grads = {n: p.grad.detach().clone() for n, p in pipe.view.named_parameters()}
    _save(workdir, f"{schedule}_{tag}", ctx.rank,
          {"loss": float(loss), "grads": grads, "norm": float(norm), "stage_ids": pipe.stage_ids, "layers": layers,
           "scaled_loss": float(scaled_loss), "scaled_grads": scaled_grads})


def _train(pipe, opt, data, steps):
    losses, norms = [], []
    for _ in range(steps):
        loss = pipe.step(data)
        norms.append(float(pipe.stepper.clip_grad_norm_(data["max_norm"])))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses, norms


def phase_train(ctx, data, workdir, schedule, virtual):
    pipe = Pipeline(ctx, data, schedule, virtual)
    opt = pipe.optimizer(data)
    losses, norms = _train(pipe, opt, data, data["steps"])
    ev = pipe.eval_step(data)
    model_sd, optim_sd = get_state_dict(pipe.view, opt, options=FLAT)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(workdir, f"ckpt_pp2_{schedule}"))
    state = {k: v.detach().clone() for k, v in optim_sd.items() if isinstance(v, torch.Tensor)}
    _save(workdir, f"{schedule}_train", ctx.rank, {
        "losses": losses, "norms": norms, "eval": {k: float(v) for k, v in ev.items()},
        "params": _params(pipe.view), "optim": state,
    })


def phase_fp16(ctx, data, workdir, schedule, virtual):
    """The trainer's fp16 step under the pipeline: autocast, a loss scaler whose overflow check agrees
    on every rank, unscale, clip over the pipeline, scaler step and update; an initial scale large
    enough that the first steps overflow and are skipped."""
    from libai_lite.engine.amp import build_loss_scaler

    pipe = Pipeline(ctx, data, schedule, virtual)
    opt = pipe.optimizer(data)
    scaler = build_loss_scaler(ctx.device, data["fp16_init_scale"], 1000)
    losses, norms, scales = [], [], []
    for _ in range(data["fp16_steps"]):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = pipe.step(data, grad_scaler=scaler)
        scaler.unscale_(opt)
        norms.append(float(pipe.stepper.clip_grad_norm_(data["max_norm"])))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        scales.append(float(scaler.get_scale()))
    _save(workdir, f"{schedule}_v{virtual}_fp16", ctx.rank, {"losses": losses, "norms": norms, "scales": scales})


def phase_resume(ctx, data, workdir, schedule, virtual):
    pipe = Pipeline(ctx, data, schedule, virtual, meta=True)
    on_meta = [n for n, t in list(pipe.view.named_parameters()) + list(pipe.view.named_buffers()) if t.is_meta]
    tied = {n: p.detach().clone() for n, p in pipe.view.named_parameters()
            if n.endswith(("token_embeddings.weight", "lm_head.weight"))}
    opt = pipe.optimizer(data)
    model_sd, optim_sd = get_state_dict(pipe.view, opt, options=FLAT)
    aliases = tied_checkpoint_aliases(pipe.view, GPTModel.pipeline_tied)
    state = alias_state_dict_keys({"model": model_sd, "optim": optim_sd}, aliases)
    dcp.load(state, checkpoint_id=os.path.join(workdir, "ckpt_pp1"))
    state = alias_state_dict_keys(state, {v: k for k, v in aliases.items()})
    set_state_dict(pipe.view, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT)
    loaded = _params(pipe.view)
    losses, norms = _train(pipe, opt, data, data["resume_steps"])
    _save(workdir, f"{schedule}_resume", ctx.rank, {
        "on_meta": on_meta, "tied_after_broadcast": tied, "aliases": aliases, "loaded": loaded,
        "losses": losses, "norms": norms,
    })


def phase_fsdp(ctx, data, workdir, schedule, virtual):
    pipe = Pipeline(ctx, data, schedule, virtual, fsdp=True)
    opt = pipe.optimizer(data)
    rows = slice(ctx.dp_rank * 2 * data["n_microbatches"], (ctx.dp_rank + 1) * 2 * data["n_microbatches"])
    batch = {"input_ids": data["dp_input_ids"][rows], "labels": data["dp_labels"][rows]}
    losses, norms = _train(pipe, opt, batch | {k: data[k] for k in ("max_norm",)}, data["fsdp_steps"])
    placements = sorted({str(tuple(p.placements)) for p in pipe.view.parameters()})
    tied = {n: p.detach().full_tensor() for n, p in pipe.view.named_parameters()
            if n.endswith(("token_embeddings.weight", "lm_head.weight"))}
    _save(workdir, f"{schedule}_fsdp", ctx.rank,
          {"losses": losses, "norms": norms, "placements": placements, "tied": tied, "pp_rank": ctx.pp_rank})


def main():
    workdir, phases = sys.argv[1], sys.argv[4].split(",")
    schedules, virtuals = sys.argv[2].split(","), sys.argv[3].split(",")
    data = torch.load(os.path.join(workdir, "data.pt"), weights_only=True)
    ctx = setup_dist({"pipeline_parallel_size": data.get("pp", 2), "timeout": 120})
    try:
        for (schedule, virtual), phase in ((sv, p) for sv in zip(schedules, map(int, virtuals)) for p in phases):
            if phase == "grads":
                # Several schedules in one launch may repeat a name (virtual 1 and 2): tag by both.
                tag = f"v{virtual}_grads" if len(schedules) > 1 else "grads"
                phase_grads(ctx, data, workdir, schedule, virtual, tag=tag)
            elif phase == "grads_custom":
                phase_grads(ctx, data, workdir, schedule, virtual, custom=data["custom_stage_ids"], tag="grads_custom")
            elif phase == "train":
                phase_train(ctx, data, workdir, schedule, virtual)
            elif phase == "fp16":
                phase_fp16(ctx, data, workdir, schedule, virtual)
            elif phase == "fsdp":
                phase_fsdp(ctx, data, workdir, schedule, virtual)
            elif phase == "resume":
                phase_resume(ctx, data, workdir, schedule, virtual)
            else:
                raise SystemExit(f"unknown phase {phase}")
        # Leave together: a gloo peer that tears down while the other still talks aborts.
        dist.barrier()
    finally:
        destroy()


if __name__ == "__main__":
    from tests.workers import run_and_exit

    run_and_exit(main)
