"""Cross entropy that stays correct when the logits are split over the vocabulary, and the LM head fused with it."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


class ParallelCrossEntropyLoss(nn.Module):
    """Per-token cross entropy (``reduction="none"``) computed in fp32.

    The logits may be a plain tensor or a DTensor sharded on the vocabulary dimension.
    In the sharded case call it under ``torch.distributed.tensor.parallel.loss_parallel()``
    (which also must wrap ``backward``): that context makes ``F.cross_entropy`` itself
    vocab-parallel, which is why this layer goes through ``F.cross_entropy`` and not
    a hand-written logsumexp. The result is always a plain tensor shaped like ``target``
    (ignored positions hold 0), so callers can mask and sum it without DTensor rules.
    """

    def forward(self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        loss = F.cross_entropy(
            logits.float().flatten(0, -2), target.flatten(), reduction="none", ignore_index=ignore_index
        )
        if isinstance(loss, DTensor):
            # loss_parallel returns the per-token loss replicated over the tensor-parallel
            # ranks, so the local tensor already holds every token's value (no communication).
            loss = loss.to_local()
        return loss.view(target.shape)


# Size of the fp32 softmax scratch buffer used when the logits are bf16/fp16. On a CPU it is
# about 512 KiB, so it stays in cache while a chunk is normalised and copied back; on a GPU,
# where every chunk costs kernel launches, it is large (256 MiB) and a step takes a few chunks.
_SCRATCH_ELEMENTS = {"cpu": 1 << 17}
_SCRATCH_ELEMENTS_ACCELERATOR = 1 << 26
_MIN_SCRATCH_ROWS = 8
# Below this target probability, -log(p) loses digits to the fp32 underflow of p (the loss is
# above ~69 nats); such rows are recomputed exactly from their logits.
_TINY_PROB = 1e-30


def _scratch_rows(probs: torch.Tensor) -> int:
    """Rows of ``probs`` per fp32 scratch chunk (``_SCRATCH_ELEMENTS`` for its device, at least one)."""
    budget = _SCRATCH_ELEMENTS.get(probs.device.type, _SCRATCH_ELEMENTS_ACCELERATOR)
    return max(1, min(probs.shape[0], max(_MIN_SCRATCH_ROWS, budget // max(1, probs.shape[1]))))


def _save_for_head_backward(ctx, hidden, weight, h, w, probs, safe_target, owned, valid) -> None:
    """Keep what ``_head_backward`` needs, when an input wants a gradient (nothing in evaluation)."""
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
        ctx.save_for_backward(h, w, probs, safe_target, owned, valid)
        ctx.input_dtypes = (hidden.dtype, weight.dtype)


def _head_backward(ctx, grad_loss):
    """Gradients of ``hidden`` and ``weight`` from the saved softmax ``P``: ``g (P W - W[t])`` and
    ``P^T (g h) - scatter(t, g h)``, the one-hot terms only for targets in ``owned`` (this rank's
    vocabulary rows; every valid target without tensor parallelism)."""
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
            grad_weight.index_add_(0, safe_target[owned], scaled[owned], alpha=-1.0)
            grad_weight = grad_weight.to(weight_dtype)
    return grad_hidden, grad_weight


class _LinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(hidden @ weight.T, target)`` per token, storing one ``[N, V]`` buffer.

    The unfused path keeps the logits, the fp32 copy autocast makes of them, the log-softmax
    output, a zero-filled gradient and the log-softmax backward's output: up to five
    ``[N, V]`` tensors and as many passes over them. Here the logits buffer is overwritten with
    the softmax and kept for backward, where ``softmax - onehot`` is never formed: the one-hot
    part and the per-token gradient scale are applied to the small ``[N, H]`` / ``[V, H]``
    products instead (``d hidden = g * (P @ W - W[target])``, ``d W = P.T @ (g * hidden) -
    scatter(target, g * hidden)``).
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, compute_dtype, with_top1):
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(compute_dtype)
            w = weight.to(compute_dtype)
            probs = h @ w.t()  # the logits, normalised in place below
            valid = target != ignore_index
            safe_target = torch.where(valid, target, 0)
            if probs.dtype in (torch.float32, torch.float64):
                # softmax's CPU and CUDA kernels read a row before writing it, so out= may alias.
                torch.softmax(probs, -1, out=probs)
                target_prob = probs.gather(1, safe_target[:, None])[:, 0]
                top_prob = probs.amax(-1) if with_top1 else None
            else:
                target_prob = torch.empty(target.shape, dtype=torch.float32, device=probs.device)
                top_prob = torch.empty_like(target_prob) if with_top1 else None
                rows = _scratch_rows(probs)
                scratch = torch.empty(rows, probs.shape[1], dtype=torch.float32, device=probs.device)
                for start in range(0, probs.shape[0], rows):
                    chunk = probs[start:start + rows]
                    p = scratch[: chunk.shape[0]]
                    torch.softmax(chunk, -1, dtype=torch.float32, out=p)
                    target_prob[start:start + rows] = p.gather(1, safe_target[start:start + rows, None])[:, 0]
                    if with_top1:
                        top_prob[start:start + rows] = p.amax(-1)
                    chunk.copy_(p)
                del scratch
            loss = target_prob.log().neg_()
            # Rows whose target probability underflowed (or is NaN): recompute exactly.
            redo = (~(target_prob >= _TINY_PROB) & valid).nonzero()[:, 0]
            if redo.numel():
                logits = (h[redo] @ w.t()).float()
                loss[redo] = (torch.logsumexp(logits, -1) - logits.gather(1, safe_target[redo, None])[:, 0])
            loss.masked_fill_(~valid, 0.0)
            # softmax is monotone, so the target is the top-1 logit iff it has the top probability.
            is_top1 = (target_prob >= top_prob) & valid if with_top1 else valid.new_zeros(())
        _save_for_head_backward(ctx, hidden, weight, h, w, probs, safe_target, valid, valid)
        ctx.mark_non_differentiable(is_top1)
        return loss, is_top1

    @staticmethod
    def backward(ctx, grad_loss, _grad_top1):
        return (*_head_backward(ctx, grad_loss), None, None, None, None)


def fusable_head_weight(weight: torch.Tensor) -> bool:
    """Whether ``linear_cross_entropy`` takes this LM-head weight: a plain tensor, or a DTensor
    split on the vocabulary (dim 0) over a 1-D mesh (tensor parallelism)."""
    if not isinstance(weight, DTensor):
        return True
    return weight.device_mesh.ndim == 1 and tuple(weight.placements) == (Shard(0),)


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
    return_top1: bool = False,
):
    """Per-token cross entropy of the logits ``hidden @ weight.T``, fused with the LM head.

    Same contract as ``ParallelCrossEntropyLoss`` applied to ``F.linear(hidden, weight)``: fp32
    loss shaped like ``target``, 0 where ``target == ignore_index``, the logits computed in
    autocast's dtype when autocast is on. It holds one ``[tokens, vocab]`` buffer instead of up
    to five and makes fewer passes over it; the loss stays exact (fp32 softmax). Both tensors
    may be plain tensors, or ``weight`` a DTensor split on the vocabulary over a 1-D mesh (the
    tensor-parallel head): each rank then forms its slice of the logits only, and ``hidden`` may
    be replicated or, under sequence parallelism, this rank's slice of the sequence (dim 1).
    ``return_top1=True`` also returns whether each target is the arg-max of its logits (bool,
    False where ignored), for token accuracy from the probabilities already computed.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    if isinstance(weight, DTensor):
        loss, is_top1 = _vocab_parallel(hidden, weight, target, ignore_index, compute_dtype, return_top1)
    else:
        loss, is_top1 = _LinearCrossEntropy.apply(
            hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), ignore_index, compute_dtype, return_top1
        )
    if return_top1:
        return loss.view(target.shape), is_top1.view(target.shape)
    return loss.view(target.shape)


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """``_LinearCrossEntropy`` with the weight's rows (the vocabulary) split over ``group``.

    Megatron's vocabulary-parallel cross entropy fused with the head: each rank forms only
    its ``[N, V / tp]`` slice of the logits; the row max, the softmax denominator and the target
    logit are combined with two all-reduces of ``N`` values. ``hidden`` is the whole (gathered)
    input on every rank; the hidden gradient returned is this rank's partial sum, which the
    caller reduces over the group.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, ignore_index, compute_dtype, with_top1, group, vocab_start):
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(compute_dtype)
            w = weight.to(compute_dtype)
            probs = h @ w.t()  # this rank's logits, turned into its slice of the softmax below
            valid = target != ignore_index
            local_target = target - vocab_start
            owned = valid & (local_target >= 0) & (local_target < probs.shape[1])
            safe_target = torch.where(owned, local_target, 0)
            acc = torch.promote_types(probs.dtype, torch.float32)  # row statistics in fp32 (fp64 stays)
            target_logit = probs.gather(1, safe_target[:, None])[:, 0].to(acc) * owned
            row_max = probs.amax(-1).to(acc)
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            if probs.dtype == acc:
                probs.sub_(row_max[:, None]).exp_()
                denominator = probs.sum(-1)
            else:
                denominator = torch.empty_like(row_max)
                rows = _scratch_rows(probs)
                for start in range(0, probs.shape[0], rows):
                    chunk = probs[start:start + rows]
                    e = chunk.to(acc).sub_(row_max[start:start + rows, None]).exp_()
                    denominator[start:start + rows] = e.sum(-1)
                    chunk.copy_(e)
            sums = torch.stack([denominator, target_logit])
            dist.all_reduce(sums, group=group)
            denominator, target_logit = sums[0], sums[1]
            probs.div_(denominator[:, None].to(probs.dtype))
            loss = (denominator.log() + row_max - target_logit).masked_fill_(~valid, 0.0)
            is_top1 = (target_logit >= row_max) & valid if with_top1 else valid.new_zeros(())
        _save_for_head_backward(ctx, hidden, weight, h, w, probs, safe_target, owned, valid)
        ctx.mark_non_differentiable(is_top1)
        return loss, is_top1

    @staticmethod
    def backward(ctx, grad_loss, _grad_top1):
        # The hidden gradient is this rank's partial sum; _vocab_parallel's DTensor reduces it.
        return (*_head_backward(ctx, grad_loss), None, None, None, None, None, None)


def _vocab_parallel(hidden, weight, target, ignore_index, compute_dtype, return_top1):
    """Gather ``hidden`` over the weight's mesh (sequence-sharded or replicated), run the split
    head + loss, and let DTensor's autograd reduce the partial hidden gradients back."""
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
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
    # Backward turns the per-rank partial gradients into the input's layout: an all-reduce for a
    # replicated input, a reduce-scatter for a sequence slice.
    full = DTensor.from_local(hidden, mesh, [layout], run_check=False).redistribute(mesh, [Replicate()])
    full = full.to_local(grad_placements=[Partial()])
    local_weight = weight.to_local()
    vocab_start = mesh.get_local_rank() * local_weight.shape[0]
    return _VocabParallelLinearCrossEntropy.apply(
        full.reshape(-1, full.shape[-1]), local_weight, target.reshape(-1), ignore_index, compute_dtype,
        return_top1, mesh.get_group(), vocab_start,
    )
