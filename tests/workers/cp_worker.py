"""torchrun worker for tests/parallel/test_context_parallel.py: context parallelism against one process.

Usage: ``torchrun --nproc_per_node N tests/workers/cp_worker.py OUT_DIR CP TP ZERO_STAGE``. Every rank
builds each case's model twice from one seed: a reference it trains alone on the whole global batch
(one process), and a copy parallelized by ``parallelize_model`` under the layout ``setup_dist`` builds
(``dp`` is the rest of the world), trained through ``Trainer.forward_backward`` on its dp replica's
half of the batch, which the trainer cuts to this cp rank's chunks. It writes ``OUT_DIR/rank{r}.pt``:
per case, both runs' losses over STEPS AdamW steps and the max gradient difference at the first step.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from libai_lite.engine.trainer import Trainer
from libai_lite.model import output_metrics
from libai_lite.parallel.parallelize import parallelize_model
from libai_lite.utils.distributed import destroy, setup_dist
from projects.GPT.modeling.gpt_model import GPTForPreTraining
from projects.Llama.modeling.llama_model import LlamaForPreTraining

VOCAB, SEQ, BATCH, STEPS = 128, 16, 4, 3
GPT = dict(hidden_layers=2, vocab_size=VOCAB, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
           max_seq_length=SEQ, embedding_dropout_prob=0.0, attention_dropout_prob=0.0, output_dropout_prob=0.0)
# Grouped-query attention (4 query heads on 2 key/value heads) and rotary positions.
LLAMA = dict(hidden_layers=2, vocab_size=VOCAB, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
             num_key_value_heads=2, max_seq_length=SEQ)
CASES = ("gpt", "llama", "gpt_packed")


def batch_for(case: str) -> dict:
    """The global batch: every label counted (so each dp replica's token mean weighs the same)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    if case == "gpt_packed":
        # Documents of uneven lengths crossing the cp chunk borders; positions restart per document.
        cuts = [(0, 5, 11), (0, 3, 9), (0, 8, 14), (0, 2, 7)]
        doc = torch.zeros(BATCH, SEQ, dtype=torch.long)
        pos = torch.zeros(BATCH, SEQ, dtype=torch.long)
        for row, starts in enumerate(cuts):
            for d, start in enumerate(starts):
                end = starts[d + 1] if d + 1 < len(starts) else SEQ
                doc[row, start:end] = d
                pos[row, start:end] = torch.arange(end - start)
        batch.update(document_ids=doc, position_ids=pos)
    return batch


def build(case: str):
    torch.manual_seed(0)
    return (LlamaForPreTraining(LLAMA) if case == "llama" else GPTForPreTraining(GPT)).float()


def grads_by_name(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None:
            out[name.replace("module.", "")] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def run(out: Path, cp: int, tp: int, zero: int) -> None:
    layout = setup_dist({"context_parallel_size": cp, "tensor_parallel_size": tp},
                        {"enabled": zero > 0, "stage": zero} if zero else None)
    dp, dp_rank = layout.data_parallel_size, layout.dp_rank
    results = {}
    for case in CASES:
        batch = batch_for(case)
        ref = build(case)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        pm = parallelize_model(build(case), layout)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        trainer = Trainer(pm.module, [batch], opt, None, output_metrics(pm.source),
                          context_parallel=pm.context_parallel)
        per = BATCH // dp
        mine = {k: v[dp_rank * per:(dp_rank + 1) * per] for k, v in batch.items()}
        ref_losses, losses, grad_diff, grad_scale = [], [], 0.0, 0.0
        for step in range(STEPS):
            loss = ref(**batch)["lm_loss"]
            loss.backward()
            ref_losses.append(loss.item())
            losses.append(float(trainer.forward_backward([mine])["lm_loss"]))
            if step == 0:
                ours, theirs = grads_by_name(pm.module), grads_by_name(ref)
                assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
                grad_diff = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
                grad_scale = max(theirs[k].abs().max().item() for k in theirs)
            for o in (ref_opt, opt):
                o.step()
                o.zero_grad(set_to_none=True)
        results[case] = dict(ref=ref_losses, cp=losses, grad_diff=grad_diff, grad_scale=grad_scale)
    torch.save(results, out / f"rank{layout.rank}.pt")
    destroy()


if __name__ == "__main__":
    from tests.workers import run_and_exit

    run_and_exit(run, Path(sys.argv[1]), *map(int, sys.argv[2:5]))
