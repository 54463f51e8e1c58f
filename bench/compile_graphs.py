#!/usr/bin/env python
"""Graph breaks under torch.compile: one GPT and one Llama layer, each whole model with its fused loss, the losses,
and MT5 whole with padding masks on the dense path (a CPU's) and the FlexAttention path (a GPU's, forward only).

``torch._dynamo.explain`` traces each without running a backend and reports the graphs, the graph breaks
(each one a return to Python between compiled pieces, and a fusion boundary) and the ops traced. Tiny
shapes: the count depends on the code, not the size. A few seconds on a CPU.

    python bench/compile_graphs.py
"""
from __future__ import annotations

import torch
import torch._dynamo as dynamo

from libai_lite.layers import ParallelCrossEntropyLoss, linear_cross_entropy
from libai_lite.layers.flex_attention import attention_backend
from libai_lite.converters.activation_checkpoint import transformer_layers

CFG = dict(hidden_layers=2, vocab_size=128, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
           max_seq_length=16, embedding_dropout_prob=0.0, attention_dropout_prob=0.0, output_dropout_prob=0.0)


def gpt():
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    return GPTForPreTraining(CFG)


def llama():
    from projects.Llama.configs.model import cfg
    from projects.Llama.modeling.llama_model import LlamaForPreTraining

    return LlamaForPreTraining({**cfg, **dict(hidden_layers=2, vocab_size=128, hidden_size=32, ffn_hidden_size=64,
                                              num_attention_heads=4, num_key_value_heads=2, max_seq_length=16)})


def mt5():
    from projects.MT5 import MT5ForPreTraining

    return MT5ForPreTraining(dict(vocab_size=128, hidden_size=32, hidden_layers=2, num_attention_heads=4, head_size=8,
                                  intermediate_size=64, embedding_dropout_prob=0.0, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0))


def explain(fn, *args):
    dynamo.reset()
    e = dynamo.explain(fn)(*args)
    return e.graph_count, e.graph_break_count, e.op_count, [str(b.reason)[:120] for b in e.break_reasons]


def main():
    torch.manual_seed(0)
    x = torch.randint(0, 128, (4, 16))
    y = torch.randint(0, 128, (4, 16))
    h = torch.randn(4, 16, 32, requires_grad=True)
    rows = []
    for name, build in (("GPT", gpt), ("Llama", llama)):
        model = build()
        rows.append((f"{name} transformer layer", explain(transformer_layers(model)[0], h, None)))
        rows.append((f"{name} whole model + fused loss", explain(lambda a, b: model(a, labels=b)["lm_loss"], x, y)))
    # The span-corruption batch's shape: padded encoder and decoder, the decoder shorter (padded to flex's tile).
    model = mt5()
    enc_mask, dec_mask = torch.ones(4, 16, dtype=torch.bool), torch.ones(4, 8, dtype=torch.bool)
    enc_mask[1, 11:], dec_mask[1, 5:] = False, False
    for backend in ("dense", "flex"):
        with attention_backend(backend), torch.no_grad():  # the CPU has no flex backward
            step = lambda a, b: model(a, a[:, :8], b[:, :8], enc_mask, dec_mask, enc_mask)["lm_loss"]  # noqa: E731
            rows.append((f"MT5 whole model + fused loss, {backend} attention, forward", explain(step, x, y)))
    rows.append(("ParallelCrossEntropyLoss (logits)", explain(ParallelCrossEntropyLoss(), torch.randn(4, 16, 128), y)))
    rows.append(("linear_cross_entropy, CPU buffer kernel",
                 explain(linear_cross_entropy, torch.randn(4, 16, 32), torch.randn(128, 32), y)))
    rows.append(("linear_cross_entropy, chunked kernel",
                 explain(lambda a, b, t: linear_cross_entropy(a, b, t, kernel="chunked"), torch.randn(4, 16, 32),
                         torch.randn(128, 32), y)))
    print("| what | graphs | graph breaks | ops traced |\n| --- | ---: | ---: | ---: |")
    for name, (graphs, breaks, ops, reasons) in rows:
        print(f"| {name} | {graphs} | {breaks} | {ops} |" + (f" {'; '.join(reasons)}" if reasons else ""))


if __name__ == "__main__":
    main()
