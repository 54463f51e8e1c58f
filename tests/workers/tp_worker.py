"""torchrun worker for tests/parallel/test_tensor_parallel.py, and the single-process reference it is compared with.

Usage: ``torchrun --nproc_per_node N tests/workers/tp_worker.py OUT_DIR TP DP``. Each rank builds the
models exactly as the one-process reference does (same seeds), splits them with
``apply_tensor_parallel`` over the tp mesh that ``setup_dist`` builds, and writes
``OUT_DIR/rank{r}.pt``: per case, the first step's loss and full gradients
(``.full_tensor()``), then the loss curve of ten AdamW steps with gradient clipping.
With DP > 1 the data-parallel dimension is FSDP2's ``fully_shard`` over the dp mesh and
every dp rank trains on its own half of each batch.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from libai_lite.lm.decoder import CausalLMLoss  # noqa: E402
from libai_lite.layers import (  # noqa: E402
    MLP,
    Embedding,
    Linear1D,
    MultiheadAttention,
    RMSLayerNorm,
    VocabEmbedding,
    init_method_normal,
)
from libai_lite.parallel.tensor_parallel import apply_tensor_parallel, loss_parallel_context  # noqa: E402
from projects.GPT.modeling.gpt_model import GPTForPreTraining  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 128, 16, 4, 10
TINY_GPT = dict(
    hidden_layers=2,
    vocab_size=VOCAB,
    hidden_size=64,
    ffn_hidden_size=256,
    num_attention_heads=4,
    max_seq_length=SEQ,
    embedding_dropout_prob=0.0,
    attention_dropout_prob=0.0,
    output_dropout_prob=0.0,
)
# (model kind, sequence parallel) run by the 2-process job.
TP_CASES = [("gpt", False), ("gpt", True), ("t5", False), ("t5", True)]
DP_CASES = [("gpt", True)]


# ------------------------------------------------------------------ a tiny T5-shaped model


class RelativeBias(nn.Module):
    """T5's per-head relative position bias, ``[1, heads, q, k]``, from a ``[buckets, heads]`` table.

    The table is declared ``parallel="col"`` (weight ``split(1)``, over its heads dimension), so
    under tensor parallelism each rank looks up only the bias of its own heads.
    """

    def __init__(self, num_buckets: int, num_heads: int, bidirectional: bool):
        super().__init__()
        self.num_buckets = num_buckets
        self.bidirectional = bidirectional
        self.relative_attention_bias = Embedding(num_buckets, num_heads, init_method=init_method_normal(0.5),
                                                 parallel="col")

    def forward(self, q_len: int, k_len: int, device) -> torch.Tensor:
        rel = torch.arange(k_len, device=device)[None, :] - torch.arange(q_len, device=device)[:, None]
        if self.bidirectional:
            half = self.num_buckets // 2
            buckets = rel.clamp(-(half - 1), half - 1) + half
        else:
            buckets = (-rel).clamp(0, self.num_buckets - 1)
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)


class TinyT5(nn.Module):
    """One encoder and one decoder layer, T5 v1.1 style, built only from libai_lite layers.

    Exercises what GPT does not: decoupled head size, T5 scaling, padding masks, a
    relative-position bias per attention stack, cross-attention's separate ``query`` and
    ``key_value`` projections, gated MLPs, RMS norms and an untied ``lm_head``. Sequence
    lengths come from the token ids, never from hidden states (which sequence parallelism
    shards).
    """

    def __init__(self, vocab=VOCAB, hidden=64, heads=4, head_size=8, ffn=128, buckets=8):
        super().__init__()
        init = init_method_normal(0.05)
        attn = dict(bias=False, head_size=head_size, softmax_scale=1.0, init_method=init)
        self.shared = VocabEmbedding(vocab, hidden, init_method=init_method_normal(1.0))
        self.dropout = nn.Dropout(0.0)
        self.enc_bias = RelativeBias(buckets, heads, bidirectional=True)
        self.enc_ln1, self.enc_ln2, self.enc_final = (RMSLayerNorm(hidden) for _ in range(3))
        self.enc_attn = MultiheadAttention(hidden, heads, attn_mask_type="padding", **attn)
        self.enc_mlp = MLP(hidden, ffn, bias=False, activation="gelu_tanh", gated=True, init_method=init)
        self.dec_bias = RelativeBias(buckets, heads, bidirectional=False)
        self.dec_ln1, self.dec_ln2, self.dec_ln3, self.dec_final = (RMSLayerNorm(hidden) for _ in range(4))
        self.dec_attn = MultiheadAttention(hidden, heads, attn_mask_type="causal", **attn)
        self.cross_attn = MultiheadAttention(hidden, heads, attn_mask_type="padding", is_cross_attention=True, **attn)
        self.dec_mlp = MLP(hidden, ffn, bias=False, activation="gelu_tanh", gated=True, init_method=init)
        self.lm_head = Linear1D(hidden, vocab, bias=False, parallel="vocab", init_method=init)
        self.loss_func = CausalLMLoss()

    def forward(self, input_ids, decoder_input_ids, labels, loss_mask=None):
        enc_len, dec_len = input_ids.shape[1], decoder_input_ids.shape[1]
        pad_mask = input_ids != 0
        h = self.dropout(self.shared(input_ids))
        bias = self.enc_bias(enc_len, enc_len, input_ids.device)
        h = h + self.enc_attn(self.enc_ln1(h), attention_mask=pad_mask, position_bias=bias)
        h = h + self.enc_mlp(self.enc_ln2(h))
        enc = self.enc_final(h)

        d = self.dropout(self.shared(decoder_input_ids))
        bias = self.dec_bias(dec_len, dec_len, decoder_input_ids.device)
        d = d + self.dec_attn(self.dec_ln1(d), position_bias=bias)
        d = d + self.cross_attn(self.dec_ln2(d), attention_mask=pad_mask, encoder_states=enc)
        d = d + self.dec_mlp(self.dec_ln3(d))
        logits = self.lm_head(self.dec_final(d) * (d.shape[-1] ** -0.5))
        return self.loss_func(logits, labels, loss_mask)


# ------------------------------------------------------------------ shared by worker and reference


def build(kind: str) -> nn.Module:
    """The tiny model of ``kind`` ("gpt" or "t5"), identically initialised on every call."""
    torch.manual_seed(0)
    return GPTForPreTraining(TINY_GPT) if kind == "gpt" else TinyT5()


def make_batches(kind: str, n: int) -> list[dict]:
    """``n`` fixed batches of ``BATCH`` rows, with ignored labels (-100) and a partial loss mask."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        dec_len = SEQ if kind == "gpt" else SEQ // 2
        labels = torch.randint(0, VOCAB, (BATCH, dec_len), generator=g)
        labels[0, :5] = -100
        labels[3, -3:] = -100
        loss_mask = torch.ones(BATCH, dec_len)
        loss_mask[1, :4] = 0
        if kind == "gpt":
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            out.append(dict(input_ids=ids, labels=labels, loss_mask=loss_mask))
        else:
            ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
            ids[2, -5:] = 0  # padding the encoder masks out
            dec = torch.randint(1, VOCAB, (BATCH, dec_len), generator=g)
            out.append(dict(input_ids=ids, decoder_input_ids=dec, labels=labels, loss_mask=loss_mask))
    return out


def split(batch: dict, parts: int, part: int) -> dict:
    """Rows ``part`` of ``parts`` equal slices of a batch (what one data-parallel rank sees)."""
    rows = BATCH // parts
    return {k: v[part * rows:(part + 1) * rows] for k, v in batch.items()}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run_case(model: nn.Module, kind: str, parallel: bool, parts: int = 1, part: int | None = None) -> dict:
    """First-step loss and gradients, then ten clipped AdamW steps; the trainer's step, in short.

    ``part=None`` accumulates all ``parts`` slices of each batch (the one-process reference
    for data parallelism); an integer trains on that slice only (one dp rank).
    """
    batches = make_batches(kind, STEPS)
    slices = range(parts) if part is None else [part]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    result: dict = {"losses": [], "grad_norms": []}
    for step, batch in enumerate(batches):
        loss_sum, nll_sum = 0.0, 0.0
        for p in slices:
            with loss_parallel_context(parallel):
                out = model(**split(batch, parts, p))
                (out["lm_loss"] / len(slices)).backward()
            loss_sum += float(out["lm_loss"].detach()) / len(slices)
            nll_sum += float(out["nll_sum"])
        if step == 0:
            result["loss0"], result["nll_sum0"] = loss_sum, nll_sum
            result["grads0"] = {n: full(p.grad).detach().clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        result["grad_norms"].append(float(full(norm)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        result["losses"].append(loss_sum)
    return result


def reference(kind: str, parts: int = 1) -> dict:
    """The same case on one process without any parallelism."""
    return run_case(build(kind), kind, parallel=False, parts=parts)


# ------------------------------------------------------------------ the torchrun side


def _loss_comms(model: nn.Module) -> dict:
    """Placement of the GPT logits and the collectives CausalLMLoss issues on them, forward and backward."""
    from torch.distributed.tensor.debug import CommDebugMode

    batch = make_batches("gpt", 1)[0]
    logits = model.GPT_model(batch["input_ids"])
    leaf = logits.detach().requires_grad_()
    with CommDebugMode() as comm, loss_parallel_context(True):
        out = model.loss_func(leaf, batch["labels"], batch["loss_mask"])
        out["lm_loss"].backward()
    return {
        "placements": [str(p) for p in logits.placements],
        "local_shape": list(logits.to_local().shape),
        "grad_local_shape": list(leaf.grad.to_local().shape),
        "comms": {str(k): v for k, v in comm.get_comm_counts().items()},
    }


def main(out_dir: str, tp: int, dp: int) -> None:
    from omegaconf import OmegaConf

    from libai_lite.utils.distributed import destroy, setup_dist

    ctx = setup_dist(OmegaConf.create(dict(data_parallel_size=dp, tensor_parallel_size=tp, pipeline_parallel_size=1)))
    try:
        results = {}
        for kind, sp in TP_CASES if dp == 1 else DP_CASES:
            model = build(kind)
            apply_tensor_parallel(model, ctx.mesh["tp"], sequence_parallel=sp)
            if dp > 1:
                from torch.distributed.fsdp import fully_shard

                fully_shard(model, mesh=ctx.mesh["dp"])
            placements = {n: [str(x) for x in p.placements] for n, p in model.named_parameters()}
            results[f"{kind}_sp{int(sp)}"] = run_case(model, kind, parallel=True, parts=dp, part=ctx.dp_rank)
            results[f"{kind}_sp{int(sp)}"]["placements"] = placements
            if kind == "gpt" and dp == 1:
                results[f"loss_comms_sp{int(sp)}"] = _loss_comms(model)
        results["meta"] = dict(dp_rank=ctx.dp_rank, tp_rank=ctx.tp_rank, world=ctx.world_size)
        torch.save(results, Path(out_dir) / f"rank{ctx.rank}.pt")
        # Leave together: a gloo peer that tears down while another still talks aborts.
        torch.distributed.barrier()
    finally:
        destroy()


if __name__ == "__main__":
    from tests.workers import run_and_exit

    run_and_exit(main, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
