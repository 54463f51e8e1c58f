"""Pipeline parallelism: cut a model into stages and run them with `torch.distributed.pipelining`.

How a model takes part (GPTForPreTraining and MT5ForPreTraining do all of this):

- ``model.pipeline_module()`` returns the inner module to cut. Its ``pipeline_spec`` (a
  ``PipelineSpec``; GPT's layout when absent) names the pieces: layer containers
  (``nn.ModuleDict`` keyed by the global layer index), what only the first stage keeps
  (``embeddings``), what only the last stage keeps (``final_layernorm``, ``lm_head``), pieces
  that go with a given layer (T5's encoder final norm with the last encoder layer) and the
  tied embedding/LM-head pair, if any. Its forward skips whichever piece is None (hidden
  states in, hidden states out); or, when the stage must carry more than one tensor (T5's
  encoder output, decoder states and position bias), it defines ``pipeline_forward``, which
  the stage runs instead of ``forward``.
- ``model.pipeline_loss_fn(output, labels)`` is the mean token loss of the last stage's output:
  logits, or per-token losses when the last stage fuses its LM head with the loss (GPT and MT5
  get the labels as a stage keyword input, ``lm_labels``, from ``pipeline_batch``).
- ``model.pipeline_metrics(output, labels)`` (optional, with ``pipeline_metric_names``): the
  logged scalars other than the loss (MT5's token accuracy) of one micro-batch's output; the
  stepper averages them over the micro-batches and sends them to every pipeline rank.
- ``model.pipeline_batch(batch)`` (optional; GPT's ``input_ids``/``labels`` when absent) turns
  a loader batch into ``(args, kwargs, labels)``: ``args`` go to the first stage, ``kwargs``
  (masks) to every stage, ``labels`` to the loss.

Stage ``s`` of ``num_stages`` keeps the layers ``stage_of_layer`` gives it; stage 0 keeps the
embeddings, the last stage the final norm and the LM head. With ``virtual_stages`` ``v`` per rank
(the interleaved schedule) pipeline rank ``r`` owns stages ``r, r + pp, ..., r + (v - 1) pp``.

Tied embeddings (Megatron's scheme): the LM head shares the token embedding's weight. When the
first and last stages live on different ranks, the last stage's ``lm_head.weight`` is a copy of
its own; ``sync_tied_weight_grads`` sums the two copies' gradients over the group {first-stage
rank, last-stage rank} of each (dp, tp) coordinate before clipping and the optimizer step, so
both copies take identical updates. Each copy keeps its own FQN:

    GPT_model.embeddings.token_embeddings.weight    on the first stage
    GPT_model.lm_head.weight                        on the last stage

A one-process model (one Parameter, two names) saves both FQNs with the same data through
``get_model_state_dict``, and its optimizer state under the embedding's FQN only. To load any
layout into any other, the rank that holds the copy without the embedding reads the copy's
entries from the embedding's FQN (``tied_checkpoint_aliases`` + ``alias_state_dict_keys``); the
optimizer state must be flattened (``StateDictOptions(flatten_optimizer_state_dict=True)``) so
each parameter's state is its own DCP key. ``pipeline_model_view`` gives the one module whose
state-dict FQNs are those of the unsplit model, whatever the number of local stages.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from ..layers.moe import collect_pipeline_moe_outputs, moe_layers
from ..utils.errors import UsageError
from .data_parallel import scale_grads_
from .expert_parallel import reduce_expert_norm

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}
# Schedules that drive several stages per rank; the others drive exactly one.
_MULTI_STAGE = {"interleaved_1f1b"}

# GPT's tied pair, relative to the module returned by `pipeline_module()`.
TIED_SOURCE = "embeddings.token_embeddings.weight"
TIED_COPY = "lm_head.weight"


@dataclass(frozen=True)
class PipelineSpec:
    """What a pipeline splitter needs to know about a model's pieces (attribute names on the pipeline module).

    ``layer_containers``: ``nn.ModuleDict``s keyed by global layer index, together numbering
    ``0..N-1``. ``first_stage`` / ``last_stage``: modules only stage 0 / the last stage keeps.
    ``with_layer``: module name -> the layer whose stage keeps it. ``tied``: ``(source, copy)``
    parameter paths of a weight shared by the first and last stage, or None.
    """

    layer_containers: tuple[str, ...] = ("layers",)
    first_stage: tuple[str, ...] = ("embeddings",)
    last_stage: tuple[str, ...] = ("final_layernorm", "lm_head")
    with_layer: tuple[tuple[str, int], ...] = ()
    tied: tuple[str, str] | None = (TIED_SOURCE, TIED_COPY)


GPT_SPEC = PipelineSpec()


# ------------------------------------------------------------------------------- splitting


def pipeline_module(model: nn.Module) -> nn.Module:
    """The inner module a splitter cuts: ``model.pipeline_module()`` when the model has one, else ``model``."""
    fn = getattr(model, "pipeline_module", None)
    return fn() if callable(fn) else model


def local_stage_ids(pp_rank: int, pp_size: int, virtual_stages: int = 1) -> list[int]:
    """The stages pipeline rank ``pp_rank`` owns: ``pp_rank, pp_rank + pp_size, ...`` (torch's loop-style placement)."""
    return [pp_rank + k * pp_size for k in range(virtual_stages)]


def _unwrap(module: nn.Module) -> nn.Module:
    # A DDP-wrapped stage keeps the model under `.module`, a stage run through `pipeline_forward`
    # under `.stage`; FSDP2 wraps in place, so the attribute lookups below see through it.
    while isinstance(module, (torch.nn.parallel.DistributedDataParallel, PipelineForward)):
        module = module.module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module.stage
    return module


def pipeline_spec(module: nn.Module) -> PipelineSpec:
    """The ``PipelineSpec`` of a pipeline module (or stage): its ``pipeline_spec``, or GPT's layout."""
    spec = getattr(_unwrap(module), "pipeline_spec", None)
    return spec if isinstance(spec, PipelineSpec) else GPT_SPEC


def _layer_items(inner: nn.Module, spec: PipelineSpec):
    for name in spec.layer_containers:
        container = getattr(inner, name)
        for key in list(container.keys()):
            yield container, key


def _check_split(inner: nn.Module, stage_ids: Sequence[int], num_stages: int, stage_of_layer: Sequence[int]) -> None:
    spec = pipeline_spec(inner)
    for attr in spec.layer_containers + spec.first_stage + spec.last_stage + tuple(n for n, _ in spec.with_layer):
        if not hasattr(inner, attr):
            raise UsageError(
                f"{type(inner).__name__} has no '{attr}': its pipeline_spec names it; a pipelined model's "
                f"pipeline_module() needs every piece its spec lists (GPT: embeddings, layers, final_layernorm, lm_head)"
            )
    num_layers = len(stage_of_layer)
    keys = sorted(int(k) for _, k in _layer_items(inner, spec))
    if keys and keys[-1] >= num_layers:
        raise UsageError(
            f"stage_of_layer has {num_layers} entries but the model has layer {keys[-1]}; "
            f"give one stage id per layer (layer_stages(num_layers, num_stages))"
        )
    bad = [s for s in stage_of_layer if not 0 <= s < num_stages]
    if bad:
        raise UsageError(f"stage_of_layer uses stage ids {sorted(set(bad))} outside 0..{num_stages - 1}; "
                         f"compute it with layer_stages(num_layers, {num_stages})")
    for s in stage_ids:
        if not 0 <= s < num_stages:
            raise UsageError(f"stage id {s} is outside 0..{num_stages - 1} for a {num_stages}-stage pipeline")


def _prune(inner: nn.Module, owned: set[int], num_stages: int, stage_of_layer: Sequence[int]) -> None:
    """Delete from `inner` (in place) what none of the stages in `owned` needs."""
    spec = pipeline_spec(inner)
    for container, key in _layer_items(inner, spec):
        if stage_of_layer[int(key)] not in owned:
            del container[key]
    if 0 not in owned:
        for name in spec.first_stage:
            setattr(inner, name, None)
    if num_stages - 1 not in owned:
        for name in spec.last_stage:
            setattr(inner, name, None)
    for name, layer in spec.with_layer:
        if stage_of_layer[layer] not in owned:
            setattr(inner, name, None)


def split_pipeline_stage(model: nn.Module, stage_id: int, num_stages: int, stage_of_layer: Sequence[int]) -> nn.Module:
    """Cut ``model`` down, in place, to pipeline stage ``stage_id`` and return the stage module.

    The stage module is ``pipeline_module(model)`` with the layers of other stages deleted, the
    spec's first-stage pieces (embeddings) set to None unless ``stage_id == 0`` and its
    last-stage pieces (``final_layernorm``, ``lm_head``) unless it is the last stage. ``model`` itself still holds the stage module, so its state dict
    has the unsplit model's FQNs for what this stage owns. Works on a model built on the ``meta``
    device (nothing is materialised here; see ``materialize_stage``). On the last stage of a
    multi-stage pipeline the LM head keeps the embedding's Parameter object, which the deleted
    embedding no longer shares: it becomes the head's own copy.
    """
    inner = pipeline_module(model)
    _check_split(inner, [stage_id], num_stages, stage_of_layer)
    _prune(inner, {stage_id}, num_stages, stage_of_layer)
    return inner


def build_stage_modules(
    model: nn.Module, stage_ids: Sequence[int], num_stages: int, stage_of_layer: Sequence[int]
) -> tuple[list[nn.Module], list[nn.Module]]:
    """Split ``model`` into this rank's stages: ``(stage_modules, models)``, both in ``stage_ids`` order.

    ``models[i]`` is a copy of ``model`` cut to stage ``stage_ids[i]`` (``stage_modules[i]`` is
    its pipeline module); pass ``models`` to ``pipeline_model_view`` for checkpoints. ``model``
    is first cut to the union of the local stages, so the copies (``copy.deepcopy``) are no
    bigger than what this rank keeps; the last local stage reuses ``model`` itself.
    """
    stage_ids = list(stage_ids)
    inner = pipeline_module(model)
    _check_split(inner, stage_ids, num_stages, stage_of_layer)
    _prune(inner, set(stage_ids), num_stages, stage_of_layer)
    models = [copy.deepcopy(model) for _ in stage_ids[:-1]] + [model]
    stages = [split_pipeline_stage(m, s, num_stages, stage_of_layer) for m, s in zip(models, stage_ids)]
    stages = [PipelineForward(s) if callable(getattr(s, "pipeline_forward", None)) else s for s in stages]
    return stages, models


class PipelineForward(nn.Module):
    """Runs a stage through its ``pipeline_forward`` (what ``PipelineStage`` calls is ``forward``).

    Tensor parallelism, activation checkpointing and FSDP are applied to this wrapper like to
    any stage: they find the layers by walking its modules. Parameter names gain a ``stage.``
    prefix here only; checkpoints use the unsplit model's names (``pipeline_model_view``).
    """

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, *args, **kwargs):
        return self.stage.pipeline_forward(*args, **kwargs)


def materialize_stage(stage_module: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate a meta-device stage on ``device`` and initialise it with each submodule's ``reset_parameters``.

    Values differ from a whole-model init (the RNG is drawn in another order), so the tied
    LM-head copy must then be made equal to the embedding: call ``broadcast_tied_weights``.
    """
    stage_module.to_empty(device=device)
    with torch.no_grad():
        for module in stage_module.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    # to_empty swaps parameters module by module, so a tie inside one stage comes apart.
    tie = getattr(stage_module, "tie_weights", None)
    if callable(tie):
        tie()
    return stage_module


def _merge_views(mods: list[nn.Module], path: str) -> nn.Module:
    if len(mods) == 1:
        return mods[0]
    for m in mods:
        own = [n for n, p in m._parameters.items() if p is not None] + [n for n, b in m._buffers.items() if b is not None]
        if own:
            raise UsageError(f"two local pipeline stages both own '{path}' ({own}); stage_of_layer assigns each layer once")
    view = nn.ModuleDict() if all(isinstance(m, nn.ModuleDict) for m in mods) else nn.Module()
    names: list[str] = []
    for m in mods:
        names += [n for n, c in m._modules.items() if c is not None and n not in names]
    for name in names:
        children = [m._modules[name] for m in mods if m._modules.get(name) is not None]
        view.add_module(name, _merge_views(children, f"{path}.{name}" if path else name))
    return view


def pipeline_model_view(models: Sequence[nn.Module]) -> nn.Module:
    """One module over this rank's stage copies whose FQNs are those of the unsplit model.

    For checkpoints (``get_state_dict``) and for optimizer parameter groups; not for forward.
    With one stage per rank it is that model; with several it is a tree of plain containers
    holding the very same submodules (and so the same Parameters the optimizer steps).
    """
    return _merge_views(list(models), "")


# ------------------------------------------------------------------------------- tied weights


def _get_attr_path(module: nn.Module, path: str):
    module = _unwrap(module)
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _tied_paths(stage: nn.Module) -> tuple[str, str] | tuple[()]:
    return pipeline_spec(stage).tied or ()


def _tied_present(stage_modules: Sequence[nn.Module], which: int) -> list[nn.Parameter]:
    """The tie's source (``which=0``, the embedding) or copy (1, the LM head) on each stage that has it."""
    found = []
    for stage in stage_modules:
        paths = _tied_paths(stage)
        if paths and (p := _get_attr_path(stage, paths[which])) is not None:
            found.append(p)
    return found


def tied_weight_params(stage_modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The tied embedding/LM-head Parameters present on this rank, each once (resolved now, so
    Parameters swapped in by TP or FSDP are the ones returned)."""
    out: list[nn.Parameter] = []
    for stage in stage_modules:
        for path in _tied_paths(stage):
            p = _get_attr_path(stage, path)
            if p is not None and all(p is not q for q in out):
                out.append(p)
    return out


def tied_weight_copies(stage_modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """LM-head copies on this rank that are not the embedding's own Parameter: gradient-norm
    computations skip them so the tied weight counts once."""
    sources = _tied_present(stage_modules, 0)
    return [p for p in _tied_present(stage_modules, 1) if all(p is not q for q in sources)]


def build_tied_weight_group(mesh, pp_dim: str = "pp"):
    """This rank's process group {first-stage rank, last-stage rank} for its (dp, tp) coordinate.

    Every rank must call it (``dist.new_group`` is collective), in the same order. Returns None
    when the pipeline has one rank (the tie is then one Parameter, or copies on one rank).
    """
    ranks = mesh.mesh
    pp_index = mesh.mesh_dim_names.index(pp_dim)
    pp_size = ranks.shape[pp_index]
    if pp_size == 1:
        return None
    columns = ranks.movedim(pp_index, 0).reshape(pp_size, -1)
    me = dist.get_rank()
    mine = None
    for c in range(columns.shape[1]):
        pair = [int(columns[0, c]), int(columns[-1, c])]
        group = dist.new_group(pair)
        if me in pair:
            mine = group
    return mine


def _local(t: torch.Tensor) -> torch.Tensor:
    # Both copies are split alike under TP (Shard(0) on the vocab) and FSDP (Shard(0)), so the
    # local shards of the two ranks in a tie group hold the same rows.
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def sync_tied_weight_grads(stage_modules: Sequence[nn.Module], group) -> None:
    """Sum the tied embedding/LM-head gradients so every copy holds the gradient of the tied weight.

    Local copies (several stages on one rank) are summed first, then the sum is all-reduced over
    ``group`` (from ``build_tied_weight_group``; None when all copies are local). Call it after
    the backward of a step and before unscaling, clipping and the optimizer step.
    """
    params = tied_weight_params(stage_modules)
    for p in params:
        # Under TP the embedding's gradient can come back replicated or partial while the weight
        # is vocab-sharded; both copies must hold the same rows before their shards are summed.
        if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    grads = [p.grad for p in params if p.grad is not None]
    if len(grads) != len(params):
        missing = [i for i, p in enumerate(params) if p.grad is None]
        raise RuntimeError(f"tied weight copies {missing} on this rank have no gradient; run backward first")
    if group is not None and not grads:
        # A rank in a tie group with neither copy cannot happen with first/last-stage groups.
        raise RuntimeError("this rank is in a tied-weight group but holds no tied weight")
    if not grads:
        return
    total = _local(grads[0]).clone()
    for g in grads[1:]:
        total += _local(g)
    if group is not None:
        dist.all_reduce(total, group=group)
    for g in grads:
        _local(g).copy_(total)


@torch.no_grad()
def broadcast_tied_weights(stage_modules: Sequence[nn.Module], group) -> None:
    """Copy the first stage's token embedding into every LM-head copy (once, at setup).

    Needed when the stages were initialised separately (``materialize_stage``); a model built
    whole with the same seed on every rank already starts with equal copies. ``group`` is the
    one from ``build_tied_weight_group`` (None when every copy is on this rank). All ranks call it.
    """
    params = tied_weight_params(stage_modules)
    sources = _tied_present(stage_modules, 0)
    if sources:
        for p in params:
            if p is not sources[0]:
                _local(p).copy_(_local(sources[0]))
    if group is None:
        return
    if not params:
        raise RuntimeError("this rank is in a tied-weight group but holds no tied weight")
    me = dist.get_rank()
    # The group is {first-stage rank, last-stage rank}: the source is whichever holds the embedding.
    src = me if sources else next(r for r in dist.get_process_group_ranks(group) if r != me)
    buf = _local(params[0]).contiguous()
    dist.broadcast(buf, src=src, group=group)
    for p in params:
        _local(p).copy_(buf)


def tied_checkpoint_aliases(model_view: nn.Module, spec: PipelineSpec = GPT_SPEC) -> dict[str, str]:
    """``{copy FQN: embedding FQN}`` when this rank holds the LM-head copy without the embedding.

    Loading reads the copy's model and optimizer entries from the embedding's, which every
    layout saves (a one-process checkpoint has no optimizer state under the head's FQN).
    ``spec`` is the pipeline module's (``pipeline_spec``); a model without a tie has no aliases.
    """
    if spec.tied is None:
        return {}
    tied_source, tied_copy = spec.tied
    names = {n for n, _ in model_view.named_parameters(remove_duplicate=False)}
    for name in names:
        if name == tied_copy or name.endswith("." + tied_copy):
            source = name[: len(name) - len(tied_copy)] + tied_source
            if source not in names:
                return {name: source}
    return {}


def alias_state_dict_keys(state: dict, aliases: dict[str, str]) -> dict:
    """Rename keys of a model state dict, a flattened optimizer state dict (``state.FQN.x``,
    ``param_groups.FQN.x``) or a dict of those (``{"model": ..., "optim": ...}``) by ``aliases``.

    Apply before ``dcp.load`` and apply the inverse mapping afterwards, before ``set_state_dict``:
    the tensors are the same objects, so what DCP loads under the alias lands in the copy.
    """
    if not aliases:
        return state

    def rename(key: str) -> str:
        for prefix in ("", "state.", "param_groups."):
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            for old, new in aliases.items():
                if rest == old or rest.startswith(old + "."):
                    return prefix + new + rest[len(old):]
        return key

    out = {}
    for key, value in state.items():
        out[rename(key) if isinstance(key, str) else key] = (
            alias_state_dict_keys(value, aliases) if isinstance(value, dict) and key in ("model", "optim") else value
        )
    return out


# ------------------------------------------------------------------------------- schedules


def check_schedule(schedule: str, num_stages: int, pp_size: int, n_microbatches: int) -> str:
    """Validate a schedule choice against torch's rules; returns the normalised name or raises UsageError."""
    name = str(schedule).lower()
    if name not in SCHEDULES:
        raise UsageError(f"unknown pipeline schedule {schedule!r}; use one of {sorted(SCHEDULES)}")
    if n_microbatches < 1:
        raise UsageError(f"n_microbatches={n_microbatches} must be at least 1 (train.num_accumulation_steps)")
    if num_stages % pp_size:
        raise UsageError(f"{num_stages} pipeline stages do not divide over {pp_size} pipeline ranks; "
                         f"use a multiple of {pp_size} stages")
    virtual = num_stages // pp_size
    if name in _MULTI_STAGE:
        if virtual < 2:
            raise UsageError(f"schedule 'interleaved_1f1b' needs at least 2 virtual stages per pipeline rank, got "
                             f"{virtual}; set 2 or more virtual stages or use '1f1b'")
        rounds = max(1, n_microbatches // pp_size)
        if n_microbatches % rounds:
            raise UsageError(
                f"schedule 'interleaved_1f1b' needs n_microbatches ({n_microbatches}) to be a multiple of "
                f"max(1, n_microbatches // pp) = {rounds}; use a multiple of pipeline_parallel_size ({pp_size})"
            )
    else:
        if virtual != 1:
            raise UsageError(f"schedule {name!r} runs one stage per pipeline rank, got {virtual}; "
                             f"use 'interleaved_1f1b' for virtual stages")
        if name == "1f1b" and n_microbatches < num_stages:
            raise UsageError(f"schedule '1f1b' needs n_microbatches ({n_microbatches}) >= the number of stages "
                             f"({num_stages}); raise train.num_accumulation_steps to {num_stages} or use 'gpipe'")
    return name


def build_pipeline_schedule(
    stage_modules: Sequence[nn.Module],
    stage_ids: Sequence[int],
    num_stages: int,
    pp_group,
    device: torch.device,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
):
    """``PipelineStage``s for this rank's stage modules and the torch schedule named ``schedule``.

    ``loss_fn(output, target)`` is the mean loss of one micro-batch; the schedule divides the
    accumulated gradients by ``n_microbatches`` (``scale_grads=True``), so they are the gradient
    of the mean of micro-batch losses. Call ``step(inputs...)`` on the rank of stage 0 and
    ``step(target=labels)`` on the rank of the last stage (``PipelineStepper`` does this).
    """
    pp_size = dist.get_world_size(pp_group)
    pp_rank = dist.get_rank(pp_group)
    name = check_schedule(schedule, num_stages, pp_size, n_microbatches)
    expected = local_stage_ids(pp_rank, pp_size, num_stages // pp_size)
    if list(stage_ids) != expected or len(stage_modules) != len(expected):
        raise UsageError(f"pipeline rank {pp_rank} of {pp_size} must own stages {expected} of {num_stages}, "
                         f"got stage ids {list(stage_ids)} for {len(stage_modules)} modules")
    stages = [
        PipelineStage(module, sid, num_stages, device, group=pp_group)
        for module, sid in zip(stage_modules, stage_ids)
    ]
    cls = SCHEDULES[name]
    if name in _MULTI_STAGE:
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)


# ------------------------------------------------------------------------------- gradient norm


def _norm_of(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    """Per-group norms as plain tensors: DTensor grads are grouped by mesh and placements and
    their norm made full (`get_total_norm` on DTensors returns a partial DTensor); an expert group's
    norm also covers the experts on the other ranks of its expert-parallel group."""
    plain = [g for g in grads if not isinstance(g, DTensor)]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            groups.setdefault((g.device_mesh, tuple(g.placements)), []).append(g)
    norms = []
    if plain:
        norms.append(torch.nn.utils.get_total_norm(plain, norm_type))
    for (mesh, _), group in groups.items():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        norms.append(reduce_expert_norm(norm, mesh, norm_type))
    return norms


@torch.no_grad()
def clip_grad_norm_pipeline(
    params: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    pp_group=None,
    *,
    exclude_from_norm: Iterable[torch.Tensor] = (),
    device: torch.device | None = None,
) -> torch.Tensor:
    """Clip gradients by the total norm over all pipeline stages; returns that norm (same on every rank).

    Each stage's norm (DTensor gradients made full) is raised to ``norm_type`` and summed over
    ``pp_group`` (max for ``inf``), as torchtitan does. ``exclude_from_norm`` (the LM-head copies,
    ``tied_weight_copies``) are scaled but not counted, so the tied weight counts once.
    ``max_norm=inf`` only measures.
    """
    params = [p for p in params]
    skip = {id(p) for p in exclude_from_norm}
    norm_type = float(norm_type)
    grads = [p.grad for p in params if p.grad is not None and id(p) not in skip]
    if device is None:
        ref = grads[0] if grads else next((p for p in params), None)
        device = (ref.to_local() if isinstance(ref, DTensor) else ref).device if ref is not None else torch.device("cpu")
    norms = [n.to(device=device, dtype=torch.float32) for n in _norm_of(grads, norm_type)]
    inf = norm_type == float("inf")
    if not norms:
        total = torch.zeros((), device=device)
    elif inf:
        total = torch.stack(norms).max()
    else:
        total = torch.stack(norms).pow(norm_type).sum()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=pp_group)
    if not inf:
        total = total.pow(1.0 / norm_type)
    if max_norm != float("inf"):
        scale_grads_(params, torch.clamp(float(max_norm) / (total + 1e-6), max=1.0))
    return total


# ------------------------------------------------------------------------------- the step


class PipelineStepper:
    """Runs one optimizer step's forward and backward through the pipeline.

    ``step(input_ids, labels)`` takes the step's ``n_microbatches`` micro-batches concatenated on
    dim 0 (every rank may pass them; only stage 0 uses the inputs and only the last stage the
    labels) and leaves in the stage parameters the gradient of the mean of micro-batch losses,
    the tied copies already summed, ready for ``clip_grad_norm_`` and ``optimizer.step()``.
    """

    def __init__(
        self,
        stage_modules: Sequence[nn.Module],
        stage_ids: Sequence[int],
        num_stages: int,
        pp_group,
        device: torch.device,
        schedule: str,
        n_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        tied_group=None,
        batch_fn: Callable[[dict], tuple[tuple, dict, torch.Tensor]] | None = None,
        metrics_fn: Callable[[torch.Tensor, torch.Tensor], dict] | None = None,
        metric_names: Sequence[str] = (),
    ):
        self.stage_modules = list(stage_modules)
        self.metrics_fn = metrics_fn
        self.metric_names = tuple(metric_names) if metrics_fn is not None else ()
        self._metric_records: list[torch.Tensor] = []
        self.batch_fn = batch_fn
        self.stage_ids = list(stage_ids)
        self.num_stages = num_stages
        self.pp_group = pp_group
        self.device = torch.device(device)
        self.n_microbatches = int(n_microbatches)
        self.tied_group = tied_group
        self.loss_fn = loss_fn
        self.is_first = 0 in self.stage_ids
        self.is_last = num_stages - 1 in self.stage_ids
        pp_size = dist.get_world_size(pp_group)
        # The last stage sits on pipeline rank (num_stages - 1) % pp = pp - 1.
        self._last_rank = dist.get_global_rank(pp_group, (num_stages - 1) % pp_size)
        self._grad_scaler = None
        self._losses: list[torch.Tensor] = []
        # A stage returns hidden states, not the auxiliary loss: MoE layers back-propagate it themselves.
        self._moe_layers = [m for module in self.stage_modules for m in moe_layers(module)]
        for m in self._moe_layers:
            m.aux_loss_in_backward = True
        has_moe = torch.tensor([len(self._moe_layers)], device=self.device)
        if dist.get_world_size(pp_group) > 1:
            dist.all_reduce(has_moe, group=pp_group)
        self._has_moe = bool(has_moe.item())
        self.step_metrics: dict = {}
        self.schedule = build_pipeline_schedule(
            self.stage_modules, self.stage_ids, num_stages, pp_group, self.device, schedule,
            self.n_microbatches, self._loss,
        )

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # torch also calls this on placeholder outputs while inferring backward metadata, so
        # the step's losses come from the schedule's `losses` list, not from here.
        loss = self.loss_fn(output, target)
        if self.metric_names:
            metrics = self.metrics_fn(output.detach(), target)
            self._metric_records.append(torch.stack([metrics[k].float() for k in self.metric_names]))
        if self._grad_scaler is not None and torch.is_grad_enabled():
            return self._grad_scaler.scale(loss)
        return loss

    def split_batch(self, batch: dict) -> tuple[tuple, dict, torch.Tensor]:
        """``(first-stage inputs, every-stage kwargs, labels)`` of a loader batch (the model's ``pipeline_batch``)."""
        if self.batch_fn is not None:
            return self.batch_fn(batch)
        return (batch["input_ids"],), {}, batch["labels"]

    def parameters(self) -> list[nn.Parameter]:
        """This rank's trainable parameters, each once."""
        seen, out = set(), []
        for m in self.stage_modules:
            for p in m.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _check_batch(self, tensor: torch.Tensor, what: str) -> None:
        if tensor.shape[0] % self.n_microbatches:
            raise UsageError(f"{what} has {tensor.shape[0]} rows, not a multiple of the {self.n_microbatches} "
                             f"micro-batches per step; pass num_accumulation_steps micro-batches concatenated")

    def _run(self, fn, inputs, labels: torch.Tensor | None, kwargs: dict | None) -> None:
        args = ()
        if self.is_first:
            if inputs is None:
                raise ValueError("the first pipeline stage needs its inputs (input_ids)")
            inputs = (inputs,) if torch.is_tensor(inputs) else tuple(inputs)
            for i, t in enumerate(inputs):
                self._check_batch(t, "input_ids" if len(inputs) == 1 else f"pipeline input {i}")
            args = tuple(t.to(self.device) for t in inputs)
        target = None
        if self.is_last:
            if labels is None:
                raise ValueError("the last pipeline stage needs labels")
            self._check_batch(labels, "labels")
            target = labels.to(self.device)
        kwargs = {k: v.to(self.device) for k, v in (kwargs or {}).items()}
        for k, v in kwargs.items():
            self._check_batch(v, k)
        self._losses = []
        self._metric_records = []
        fn(*args, target=target, losses=self._losses, **kwargs)

    def _broadcast_losses(self, values: list[float]) -> list[float]:
        t = torch.tensor(values if self.is_last else [0.0] * len(values), dtype=torch.float64, device=self.device)
        if dist.get_world_size(self.pp_group) > 1:
            dist.broadcast(t, src=self._last_rank, group=self.pp_group)
        return t.tolist()

    def step(self, input_ids, labels: torch.Tensor | None, grad_scaler=None,
             broadcast_loss: bool = True, kwargs: dict | None = None) -> torch.Tensor | None:
        """Forward + backward of one step; returns the mean micro-batch loss (a 0-d float64 tensor).

        ``input_ids`` is the first stage's input, a tensor or a tuple of tensors (T5's encoder
        and decoder ids); ``kwargs`` (masks) reach every stage and every rank must pass them.

        The loss is returned on every pipeline rank when ``broadcast_loss`` (for logging), else
        on the last stage only (None elsewhere). With ``grad_scaler`` (fp16) each micro-batch
        loss is scaled before its backward; the returned loss is unscaled. With MoE layers,
        ``step_metrics`` then holds the step's ``moe_aux_loss`` (already in the gradients),
        ``moe_dropped_frac`` and ``moe_load_max`` on every pipeline rank; with ``metrics_fn`` (the
        model's ``pipeline_metrics``), also the micro-batch mean of each of ``metric_names``.
        """
        for m in self.stage_modules:
            m.train()
        self._grad_scaler = grad_scaler
        loss_scale = float(grad_scaler.get_scale()) if grad_scaler is not None else 1.0
        for m in self._moe_layers:
            m.aux_grad_scale = loss_scale
            m.step_records = []
        try:
            self._run(lambda *a, **k: self.schedule.step(*a, return_outputs=False, **k), input_ids, labels, kwargs)
        finally:
            self._grad_scaler = None
        sync_tied_weight_grads(self.stage_modules, self.tied_group)
        self.step_metrics = {}
        if self._has_moe:
            self.step_metrics = collect_pipeline_moe_outputs(self.stage_modules, self.n_microbatches, self.pp_group)
        loss = [0.0] * (1 + len(self.metric_names))
        if self.is_last:
            # Scaling by the loss scale (a power of two) is exact, so dividing it out is too.
            loss[0] = float(torch.stack([l.detach().float() for l in self._losses]).mean()) / loss_scale
            if self.metric_names:
                # The last n: on its first step torch also calls the loss on placeholder outputs.
                loss[1:] = torch.stack(self._metric_records[-self.n_microbatches:]).mean(0).tolist()
        if broadcast_loss:
            loss = self._broadcast_losses(loss)
        elif not self.is_last:
            return None
        self.step_metrics.update(
            {k: torch.tensor(v, dtype=torch.float32) for k, v in zip(self.metric_names, loss[1:])})
        return torch.tensor(loss[0], dtype=torch.float64)

    @torch.no_grad()
    def eval_step(self, input_ids, labels: torch.Tensor | None, kwargs: dict | None = None) -> dict:
        """Forward only; ``{"lm_loss", "nll_sum", "num_tokens"}`` as float tensors on every pipeline rank.

        ``nll_sum`` weights each micro-batch's mean loss by its count of labels other than -100,
        so ``nll_sum / num_tokens`` is the token-weighted mean the perplexity evaluator wants.
        """
        modes = [m.training for m in self.stage_modules]
        for m in self.stage_modules:
            m.eval()
        try:
            self._run(self.schedule.eval, input_ids, labels, kwargs)
        finally:
            for m, mode in zip(self.stage_modules, modes):
                m.train(mode)
        values = [0.0, 0.0]
        if self.is_last:
            chunks = torch.tensor_split(labels, self.n_microbatches, dim=0)
            counts = [float((c != -100).sum()) for c in chunks]
            values = [sum(float(l) * n for l, n in zip(self._losses, counts)), sum(counts)]
        nll, tokens = self._broadcast_losses(values)
        return {
            "lm_loss": torch.tensor(nll / tokens if tokens else 0.0, dtype=torch.float64),
            "nll_sum": torch.tensor(nll, dtype=torch.float64),
            "num_tokens": torch.tensor(tokens, dtype=torch.float64),
        }

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``clip_grad_norm_pipeline`` over this rank's stages, the tied weight counted once."""
        return clip_grad_norm_pipeline(
            self.parameters(), max_norm, norm_type, self.pp_group,
            exclude_from_norm=tied_weight_copies(self.stage_modules), device=self.device,
        )
