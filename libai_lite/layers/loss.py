"""Cross entropy that stays correct when the logits are split over the vocabulary, and the LM head fused with it."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .fused_linear_ce import gpu_linear_cross_entropy, select_kernel


class ParallelCrossEntropyLoss(nn.Module):
    """Per-token cross entropy in fp32, a plain tensor shaped like ``target`` (0 where ignored).

    The logits may be a DTensor sharded on the vocabulary if forward and backward run under torch's
    ``loss_parallel()``, which makes ``F.cross_entropy`` vocab-parallel.
    """

    def forward(self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        loss = F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), reduction="none",
                               ignore_index=ignore_index)
        if isinstance(loss, DTensor):
            # loss_parallel returns the loss replicated, so the local tensor holds every token.
            loss = loss.to_local()
        return loss.view(target.shape)


def scratch_rows(probs: torch.Tensor) -> int:
    """Rows of bf16/fp16 logits normalised per fp32 chunk (at least 8)."""
    # Small enough to stay in cache on a CPU; large on a GPU, where every chunk costs kernel launches.
    budget = 1 << 17 if probs.device.type == "cpu" else 1 << 26
    return max(1, min(probs.shape[0], max(8, budget // max(1, probs.shape[1]))))


class _LinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(hidden @ weight.T, target)`` per token, storing one ``[N, V]`` buffer.

    The logits buffer is overwritten with the softmax ``P`` and kept for backward, which never forms
    ``P - onehot``: ``d hidden = g (P W - W[t])`` and ``d W = P^T (g h) - scatter(t, g h)``. The loss
    ``log sum exp(x - max) + max - x[t]`` stays exact where ``P[t]`` underflows.

    With ``group`` the vocabulary rows are split over it. Each rank forms its ``[N, V / tp]`` slice from
    ``vocab_start``, two all-reduces of ``N`` values combine the row statistics, and the hidden gradient
    is this rank's partial sum.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, compute_dtype, with_top1, group, vocab_start):
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
            probs = h @ w.t()  # this rank's logits, turned into its slice of the softmax below
            valid = target != ignore_index
            local_target = target - vocab_start
            owned = valid & (local_target >= 0) & (local_target < probs.shape[1])
            safe_target = torch.where(owned, local_target, 0)
            acc = torch.promote_types(probs.dtype, torch.float32)  # row statistics in fp32 (fp64 stays)
            target_logit = probs.gather(1, safe_target[:, None])[:, 0].to(acc) * owned
            row_max = probs.amax(-1).to(acc)
            if group is not None:
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            denominator = torch.empty_like(row_max)
            rows = probs.shape[0] if probs.dtype == acc else scratch_rows(probs)
            for start in range(0, probs.shape[0], rows):
                chunk, end = probs[start:start + rows], start + rows
                e = chunk.to(acc).sub_(row_max[start:end, None]).exp_()  # in place when already fp32
                denominator[start:end] = e.sum(-1)
                if group is None:  # normalised before a half-precision copy rounds it
                    e.div_(denominator[start:end, None])
                if e is not chunk:
                    chunk.copy_(e)
            if group is not None:
                sums = torch.stack([denominator, target_logit])
                dist.all_reduce(sums, group=group)
                denominator, target_logit = sums[0], sums[1]
                probs.div_(denominator[:, None].to(probs.dtype))
            # Out of place: under torch 2.11's dynamo an output mutated in place gets all-zero gradients.
            loss = (denominator.log() + row_max - target_logit).masked_fill(~valid, 0.0)
            is_top1 = (target_logit >= row_max) & valid if with_top1 else valid.new_zeros(())
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:  # nothing to keep in evaluation
            ctx.save_for_backward(h, w, probs, safe_target, owned, valid)
            ctx.input_dtypes = (hidden.dtype, weight.dtype)
        ctx.mark_non_differentiable(is_top1)
        return loss, is_top1

    @staticmethod
    def backward(ctx, grad_loss, _grad_top1):
        # The one-hot terms only for targets in ``owned`` (this rank's vocabulary rows).
        h, w, probs, safe_target, owned, valid = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.input_dtypes
        scale = (grad_loss.float() * valid)[:, None]  # ignored tokens have a constant 0 loss
        grad_hidden = grad_weight = None
        with torch.autocast(h.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                onehot_rows = w[safe_target].float() * owned[:, None]
                grad_hidden = (probs @ w).float().sub_(onehot_rows).mul_(scale).to(hidden_dtype)
            if ctx.needs_input_grad[1]:
                scaled = h.float() * scale
                grad_weight = (probs.t() @ scaled.to(probs.dtype)).float()
                # Zeros for rows this rank does not own: a boolean selection would stall on a host read.
                grad_weight.index_add_(0, safe_target, torch.where(owned[:, None], scaled, 0.0), alpha=-1.0)
                grad_weight = grad_weight.to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def fusable_head_weight(weight: torch.Tensor) -> bool:
    """Whether ``linear_cross_entropy`` takes this LM-head weight: a plain tensor, or a DTensor
    split on the vocabulary (dim 0) over a 1-D mesh (tensor parallelism)."""
    if not isinstance(weight, DTensor):
        return True
    return weight.device_mesh.ndim == 1 and tuple(weight.placements) == (Shard(0),)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                         return_top1: bool = False, kernel: str | None = None):
    """Per-token cross entropy of the logits ``hidden @ weight.T``, fused with the LM head.

    Same contract as ``ParallelCrossEntropyLoss`` on ``F.linear(hidden, weight)``: fp32 loss shaped like
    ``target``, 0 where ignored, logits in autocast's dtype when autocast is on. ``weight`` may be a
    DTensor split on the vocabulary over a 1-D mesh; ``hidden`` is then replicated or, under sequence
    parallelism, this rank's slice of dim 1. ``return_top1=True`` also returns whether each target is
    the arg-max, False where ignored. ``kernel`` is ``buffer``, ``plain``, ``chunked`` or ``liger``;
    None lets ``fused_linear_ce.select_kernel`` choose.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    group, vocab_start = None, 0
    if isinstance(weight, DTensor):
        hidden, weight, group, vocab_start = _vocab_parallel_inputs(hidden, weight, target)
    kernel = kernel or select_kernel(hidden.device, group is not None, tokens=target.numel(), vocab=weight.shape[0])
    if kernel != "buffer":
        loss, is_top1 = gpu_linear_cross_entropy(kernel, hidden.reshape(-1, hidden.shape[-1]), weight,
                                                 target.reshape(-1), ignore_index, compute_dtype, return_top1,
                                                 group, vocab_start)
    else:
        loss, is_top1 = _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1),
                                                  ignore_index, compute_dtype, return_top1, group, vocab_start)
    if return_top1:
        return loss.view(target.shape), is_top1.view(target.shape)
    return loss.view(target.shape)


def _vocab_parallel_inputs(hidden, weight, target):
    """``(whole hidden, local weight, group, vocab_start)``: ``hidden`` gathered over the weight's mesh
    (sequence-sharded or replicated), its backward reducing the ranks' partial gradients back."""
    mesh = weight.device_mesh
    if not fusable_head_weight(weight):
        raise ValueError(f"linear_cross_entropy needs the weight split on the vocabulary over one mesh "
                         f"dimension, got placements {tuple(weight.placements)} on a {mesh.ndim}-D mesh")
    tp = mesh.size()
    if tuple(hidden.shape[:-1]) == tuple(target.shape):
        layout = Replicate()
    elif hidden.dim() == 3 and hidden.shape[1] * tp == target.shape[1]:
        layout = Shard(1)  # sequence parallelism: this rank's slice of the sequence
    else:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match target {tuple(target.shape)} "
                         f"(whole, or split on the sequence over {tp} ranks)")
    # Backward turns the partial gradients into the input's layout: an all-reduce for a replicated
    # input, a reduce-scatter for a sequence slice.
    full = DTensor.from_local(hidden, mesh, [layout], run_check=False).redistribute(mesh, [Replicate()])
    local_weight = weight.to_local()
    vocab_start = mesh.get_local_rank() * local_weight.shape[0]
    return full.to_local(grad_placements=[Partial()]), local_weight, mesh.get_group(), vocab_start
