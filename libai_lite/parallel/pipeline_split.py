"""Cutting a model into pipeline stages by the ``layer_idx`` its pieces declare, and its tied weights.

A stage keeps the pieces of ``model.pipeline_module()`` that the layout places on it: entries of layer
``nn.ModuleDict``s keyed by global layer index, pieces with a ``layer_idx``, and parameterless pieces,
which every stage keeps. The model's forward skips pieces set to None, or it defines ``pipeline_forward``.

Tied embeddings: ``model.pipeline_tied`` names ``(source, copy)`` parameter paths. On different ranks
``sync_tied_weight_grads`` sums both copies' gradients over the first and last stage ranks, so both take
identical updates. A rank holding only the copy loads it from the source's checkpoint entries.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.tensor import DTensor

from ..model import pipeline_module, pipeline_tied, tie_weights, unwrap
from ..utils.errors import UsageError
from ..utils.parallel_dims import V_SHAPE_SCHEDULES


def trainable_parameters(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The trainable parameters of ``modules``, each once (a tied weight or a shared view appears twice)."""
    seen, out = set(), []
    for m in modules:
        for p in m.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def stage_style(schedule: str | None) -> str:
    """torch's stage placement for ``schedule``: ``"v"`` (ZBV, DualPipeV) or ``"loop"`` (all others)."""
    return "v" if str(schedule or "").lower() in V_SHAPE_SCHEDULES else "loop"


def stage_ranks(pp_size: int, num_stages: int, schedule: str | None = None) -> list[int]:
    """The pipeline rank of each stage under ``schedule``'s placement (the mapping its torch class uses)."""
    mapping = generate_stage_to_rank_mapping(pp_size, num_stages, style=stage_style(schedule))
    return [mapping[s] for s in range(num_stages)]


def local_stage_ids(pp_rank: int, pp_size: int, virtual_stages: int = 1, schedule: str | None = None) -> list[int]:
    """The stages pipeline rank ``pp_rank`` owns, ascending: ``pp_rank, pp_rank + pp_size, ...`` (torch's
    loop placement), or ``pp_rank, 2 * pp_size - 1 - pp_rank, ...`` for a V-shape ``schedule``."""
    ranks = stage_ranks(pp_size, pp_size * virtual_stages, schedule)
    return [s for s, r in enumerate(ranks) if r == pp_rank]


class PipelineForward(nn.Module):
    """Runs a stage through its ``pipeline_forward`` (what ``PipelineStage`` calls is ``forward``); parameter
    names gain a ``module.`` prefix here only (checkpoints use ``pipeline_model_view``)."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.module = stage

    def forward(self, *args, **kwargs):
        return self.module.pipeline_forward(*args, **kwargs)


def pipeline_pieces(inner: nn.Module):
    """``(container or None, name, module)`` for every placeable piece of a pipeline module."""
    for name, child in list(inner.named_children()):
        if isinstance(child, nn.ModuleDict) and all(k.isdigit() for k in child.keys()):
            for key, layer in list(child.items()):
                yield child, key, layer
        elif child is not None:
            yield None, name, child


def layer_index_of(module: nn.Module, key: str) -> int | None:
    """The layer a piece of ``pipeline_pieces`` belongs to: its ``layer_idx``, else its numeric key, else None."""
    idx = getattr(module, "layer_idx", None)
    return int(idx) if idx is not None else int(key) if key.isdigit() else None


def _check_split(inner: nn.Module, stage_ids: Sequence[int], num_stages: int, stage_of_layer: Sequence[int]) -> None:
    num_layers = len(stage_of_layer)
    for container, key, module in pipeline_pieces(inner):
        idx = layer_index_of(module, key)
        if idx is None:
            if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
                raise UsageError(f"{type(inner).__name__}.{key} has parameters but no layer_idx, so no pipeline "
                                 f"stage can own it; build it with layer_idx=<the layer it goes with> (0 for "
                                 f"embeddings, the last layer for a head)")
        elif idx >= num_layers:
            raise UsageError(f"stage_of_layer has {num_layers} entries but the model has layer {idx}; "
                             f"give one stage id per layer (layer_stages(num_layers, num_stages))")
    bad = [s for s in stage_of_layer if not 0 <= s < num_stages]
    if bad:
        raise UsageError(f"stage_of_layer uses stage ids {sorted(set(bad))} outside 0..{num_stages - 1}; "
                         f"compute it with layer_stages(num_layers, {num_stages})")
    for s in stage_ids:
        if not 0 <= s < num_stages:
            raise UsageError(f"stage id {s} is outside 0..{num_stages - 1} for a {num_stages}-stage pipeline")


def _prune(inner: nn.Module, owned: set[int], stage_of_layer: Sequence[int]) -> None:
    """Delete from ``inner`` (in place) what none of the stages in ``owned`` keeps."""
    for container, key, module in pipeline_pieces(inner):
        idx = layer_index_of(module, key)
        if idx is None or stage_of_layer[idx] in owned:
            continue
        if container is not None:
            del container[key]
        else:
            setattr(inner, key, None)


def split_pipeline_stage(model: nn.Module, stage_id: int, num_stages: int, stage_of_layer: Sequence[int]) -> nn.Module:
    """Cut ``model`` (possibly on meta) down, in place, to pipeline stage ``stage_id``; returns the stage
    module, which ``model`` still holds, so its state dict keeps the unsplit model's FQNs."""
    inner = pipeline_module(model)
    _check_split(inner, [stage_id], num_stages, stage_of_layer)
    _prune(inner, {stage_id}, stage_of_layer)
    return inner


def build_stage_modules(
    model: nn.Module, stage_ids: Sequence[int], num_stages: int, stage_of_layer: Sequence[int]
) -> tuple[list[nn.Module], list[nn.Module]]:
    """Split ``model`` into this rank's stages: ``(stage_modules, models)`` in ``stage_ids`` order, ``models[i]``
    a copy of ``model`` cut to stage ``stage_ids[i]`` (for ``pipeline_model_view``). ``model`` is first cut
    to the union of the local stages, so the copies are no bigger than what this rank keeps."""
    stage_ids = list(stage_ids)
    inner = pipeline_module(model)
    _check_split(inner, stage_ids, num_stages, stage_of_layer)
    _prune(inner, set(stage_ids), stage_of_layer)
    models = [copy.deepcopy(model) for _ in stage_ids[:-1]] + [model]
    stages = [split_pipeline_stage(m, s, num_stages, stage_of_layer) for m, s in zip(models, stage_ids)]
    stages = [PipelineForward(s) if callable(getattr(s, "pipeline_forward", None)) else s for s in stages]
    return stages, models


def materialize_stage(stage_module: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate a meta-device stage on ``device`` and initialise it with each submodule's ``reset_parameters``
    (in another RNG order than a whole-model init: make the tied copies equal with ``broadcast_tied_weights``)."""
    stage_module.to_empty(device=device)
    with torch.no_grad():
        for module in stage_module.modules():
            if callable(reset := getattr(module, "reset_parameters", None)):
                reset()
    # to_empty swaps parameters module by module, so a tie inside one stage comes apart.
    tie_weights(unwrap(stage_module))
    return stage_module


def _merge_views(mods: list[nn.Module], path: str) -> nn.Module:
    if len(mods) == 1:
        return mods[0]
    for m in mods:
        own = [n for n, t in (*m._parameters.items(), *m._buffers.items()) if t is not None]
        if own:
            raise UsageError(f"two local pipeline stages both own '{path}' ({own}); "
                             f"stage_of_layer assigns each layer once")
    view = nn.ModuleDict() if all(isinstance(m, nn.ModuleDict) for m in mods) else nn.Module()
    names: list[str] = []
    for m in mods:
        names += [n for n, c in m._modules.items() if c is not None and n not in names]
    for name in names:
        children = [m._modules[name] for m in mods if m._modules.get(name) is not None]
        view.add_module(name, _merge_views(children, f"{path}.{name}" if path else name))
    return view


def pipeline_model_view(models: Sequence[nn.Module]) -> nn.Module:
    """One module over this rank's stage copies whose FQNs are those of the unsplit model (a tree of plain
    containers holding the same submodules), for checkpoints and optimizer groups; not for forward."""
    return _merge_views(list(models), "")


# ------------------------------------------------------------------------------- tied weights


def _tied_present(stage_modules: Sequence[nn.Module], which: int) -> list[nn.Parameter]:
    """The tie's source (``which=0``) or copy (1) on each stage that has it (a cut piece is None)."""
    found = []
    for stage in stage_modules:
        if paths := pipeline_tied(stage):
            with contextlib.suppress(AttributeError):
                found.append(unwrap(stage).get_parameter(paths[which]))
    return found


def tied_weight_params(stage_modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The tied Parameters present on this rank, each once (resolved now, so Parameters swapped in
    by TP or FSDP are the ones returned)."""
    return list({id(p): p for p in _tied_present(stage_modules, 0) + _tied_present(stage_modules, 1)}.values())


def tied_weight_copies(stage_modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Copies on this rank that are not the source Parameter itself: a gradient norm skips them so
    the tied weight counts once."""
    sources = _tied_present(stage_modules, 0)
    return [p for p in _tied_present(stage_modules, 1) if all(p is not q for q in sources)]


def build_tied_weight_group(mesh, pp_dim: str = "pp", schedule: str | None = None, virtual_stages: int = 1):
    """This rank's process group {first-stage rank, last-stage rank} for its (dp, tp) coordinate, None
    when one rank holds both (one pipeline rank, or a V-shape ``schedule``). Collective
    (``dist.new_group``): every rank calls it, in order."""
    ranks = mesh.mesh
    pp_index = mesh.mesh_dim_names.index(pp_dim)
    pp_size = ranks.shape[pp_index]
    last = stage_ranks(pp_size, pp_size * virtual_stages, schedule)[-1]
    if last == 0:
        return None
    columns = ranks.movedim(pp_index, 0).reshape(pp_size, -1)
    me = dist.get_rank()
    mine = None
    for c in range(columns.shape[1]):
        pair = [int(columns[0, c]), int(columns[last, c])]
        group = dist.new_group(pair)
        if me in pair:
            mine = group
    return mine


def _local(t: torch.Tensor) -> torch.Tensor:
    # Both copies are split alike under TP and FSDP (Shard(0)), so the two ranks' local shards hold the same rows.
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def sync_tied_weight_grads(stage_modules: Sequence[nn.Module], group) -> None:
    """Sum the tied gradients, the local copies' then over ``group`` (None when every copy is local), so
    every copy holds the tied weight's gradient. Call after backward, before unscaling and clipping."""
    params = tied_weight_params(stage_modules)
    missing = [i for i, p in enumerate(params) if p.grad is None]
    if missing:
        raise RuntimeError(f"tied weight copies {missing} on this rank have no gradient; run backward first")
    if group is not None and not params:
        raise RuntimeError("this rank is in a tied-weight group but holds no tied weight")
    for p in params:
        # Under TP a gradient can come back replicated or partial while the weight is vocab-sharded.
        if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    grads = [p.grad for p in params]
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
    """Copy the first stage's source weight into every copy (once, at setup, after ``materialize_stage``)."""
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
    src = me if sources else next(r for r in dist.get_process_group_ranks(group) if r != me)
    buf = _local(params[0]).contiguous()
    dist.broadcast(buf, src=src, group=group)
    for p in params:
        _local(p).copy_(buf)


def tied_checkpoint_aliases(model_view: nn.Module, tied: tuple[str, str] | None) -> dict[str, str]:
    """``{copy FQN: source FQN}`` when this rank holds the copy of ``tied`` (``pipeline_tied``) without the
    source, else ``{}``."""
    if not tied:
        return {}
    tied_source, tied_copy = tied
    names = {n for n, _ in model_view.named_parameters(remove_duplicate=False)}
    for name in names:
        if name == tied_copy or name.endswith("." + tied_copy):
            source = name[: len(name) - len(tied_copy)] + tied_source
            if source not in names:
                return {name: source}
    return {}


def tied_copies_with_source(model_view: nn.Module, tied: tuple[str, str] | None) -> dict[str, str]:
    """``{copy FQN: source FQN}`` when this rank holds the copy and the source of ``tied`` as separate
    parameters, as under a V-shaped schedule, else ``{}``. An unpipelined checkpoint holds the optimizer
    state once, under the source, and the copy's is filled from it at load."""
    if not tied:
        return {}
    tied_source, tied_copy = tied
    params = dict(model_view.named_parameters(remove_duplicate=False))
    for name in params:
        if name == tied_copy or name.endswith("." + tied_copy):
            source = name[: len(name) - len(tied_copy)] + tied_source
            if source in params and params[source] is not params[name]:
                return {name: source}
    return {}


def alias_state_dict_keys(state: dict, aliases: dict[str, str]) -> dict:
    """Rename keys of a model state dict, a flattened optimizer state dict (``state.FQN.x``,
    ``param_groups.FQN.x``) or a dict of those (``{"model": ..., "optim": ...}``) by ``aliases``.

    Apply before ``dcp.load`` and the inverse before ``set_state_dict``; the tensors are shared, so what
    DCP loads under the alias lands in the copy.
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
