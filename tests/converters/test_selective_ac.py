"""Selective activation checkpointing: the no-checkpointing gradients, with less memory than none and more than full.

In-process: GPT, Llama and MT5 (two stacks, ``encoder_layers``/``decoder_layers``) give bitwise the
gradients of the uncheckpointed model in both modes, and the activation bytes one forward leaves for
backward (torch's ``MemTracker``: every tensor storage alive after the forward that is not a parameter,
buffer, gradient or optimizer state) order as none > selective > full. Recomputation replays the same
kernels on the same inputs, so equality is exact.
The torchrun test launches this file as a worker (``... tests/converters/test_selective_ac.py OUT LAYOUT``):
selective checkpointing under tp=2 (with sequence parallelism) and under ZeRO-3 trains the one-process
losses of the uncheckpointed model.
"""
from __future__ import annotations

import copy
import json
import sys

import pytest
import torch

from libai_lite.converters.activation_checkpoint import apply_activation_checkpointing
from libai_lite.utils.errors import UsageError

BATCH, SEQ, VOCAB = 4, 32, 128
STEPS, LR = 3, 0.5


def gpt():
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    return GPTForPreTraining(dict(hidden_layers=2, vocab_size=VOCAB, hidden_size=64, ffn_hidden_size=128,
                                  num_attention_heads=4, max_seq_length=SEQ, embedding_dropout_prob=0.0,
                                  attention_dropout_prob=0.0, output_dropout_prob=0.0))


def llama():
    from projects.Llama.configs.model import cfg
    from projects.Llama.modeling.llama_model import LlamaForPreTraining

    return LlamaForPreTraining({**cfg, **dict(hidden_layers=2, vocab_size=VOCAB, hidden_size=64, ffn_hidden_size=160,
                                              num_attention_heads=4, num_key_value_heads=2, max_seq_length=SEQ)})


def mt5():
    from projects.MT5 import MT5ForPreTraining

    return MT5ForPreTraining(dict(vocab_size=VOCAB, hidden_size=64, hidden_layers=2, num_attention_heads=4,
                                  head_size=16, intermediate_size=128, embedding_dropout_prob=0.0,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def batch(name):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if name == "mt5":
        return (x, x[:, : SEQ // 2].contiguous()), y[:, : SEQ // 2].contiguous()
    return (x,), y


MODELS = {"gpt": gpt, "llama": llama, "mt5": mt5}


def forward_backward(model, name):
    """Loss, gradients by (unwrapped) name and the activation bytes alive between forward and backward."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    args, labels = batch(name)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = model(*args, labels=labels)["lm_loss"]
        activations = tracker.get_tracker_snapshot("current")[torch.device("cpu")][_MemRefType.ACT]
        loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, activations


@pytest.mark.parametrize("name", list(MODELS))
def test_selective_gives_the_gradients_with_memory_between_none_and_full(name):
    torch.manual_seed(0)
    base = MODELS[name]()
    results = {}
    for mode in ("none", "full", "selective"):
        model = copy.deepcopy(base)
        if mode != "none":
            apply_activation_checkpointing(model, 1, mode)
        results[mode] = forward_backward(model, name)
    loss, grads, none_bytes = results["none"]
    for mode in ("full", "selective"):
        assert torch.equal(results[mode][0], loss), mode
        assert grads.keys() == results[mode][1].keys()
        for key, grad in grads.items():
            assert torch.equal(results[mode][1][key], grad), (mode, key)
    full_bytes, selective_bytes = results["full"][2], results["selective"][2]
    assert none_bytes > selective_bytes > full_bytes, (none_bytes, selective_bytes, full_bytes)


def test_unknown_mode_is_one_line():
    with pytest.raises(UsageError, match="train.activation_checkpoint.mode='partial' is not a mode; use one of "
                                         "full, selective"):
        apply_activation_checkpointing(gpt(), 1, "partial")


# ---------------------------------------------------------------------------------------------- torchrun
# name -> (processes, train.dist, zero stage)
LAYOUTS = {
    "tp2_sequence_parallel": (2, dict(tensor_parallel_size=2, sequence_parallel=True), 0),
    "dp2_zero3": (2, dict(), 3),
}


def train(model, step_fn) -> list[float]:
    """SGD for STEPS steps on the fixed batch, the loss of each."""
    opt = torch.optim.SGD(model, lr=LR)
    curve = []
    for _ in range(STEPS):
        curve.append(float(step_fn()))
        opt.step()
        opt.zero_grad()
    return curve


def _worker(out: str, layout_name: str) -> None:
    """One torchrun rank: the tiny GPT under LAYOUTS[layout_name] with selective checkpointing, trained;
    rank 0 writes the losses to ``out``."""
    import torch.distributed as dist

    from libai_lite.parallel.parallelize import parallelize_model
    from libai_lite.parallel.tensor_parallel import loss_parallel_context
    from libai_lite.utils.distributed import setup_dist

    _, dist_cfg, zero = LAYOUTS[layout_name]
    layout = setup_dist(dist_cfg, dict(enabled=bool(zero), stage=zero))
    torch.manual_seed(0)
    pm = parallelize_model(gpt(), layout, activation_checkpoint_every=1, activation_checkpoint_mode="selective")
    (x,), y = batch("gpt")
    per_rank = BATCH // layout.data_parallel_size
    rows = slice(layout.dp_rank * per_rank, (layout.dp_rank + 1) * per_rank)

    def step():
        with loss_parallel_context(layout.tensor_parallel_size > 1):
            loss = pm.module(x[rows], labels=y[rows])["lm_loss"]
            loss.backward()
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=layout.group("dp"))
        return loss / layout.data_parallel_size

    curve = train(pm.parameters(), step)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(curve, f)
    dist.barrier()
    dist.destroy_process_group()


# ZeRO-3 with (full) checkpointing is in tests/parallel/test_parallel_e2e.py's default run already.
@pytest.mark.parametrize("layout_name", [pytest.param(n, marks=pytest.mark.slow) if n == "dp2_zero3" else n
                                         for n in LAYOUTS])
def test_selective_layout_matches_one_process(tmp_path, layout_name):
    from tests.launch import torchrun

    torch.manual_seed(0)
    model = gpt()
    (x,), y = batch("gpt")

    def step():
        loss = model(x, labels=y)["lm_loss"]
        loss.backward()
        return loss.detach()

    reference = train(model.parameters(), step)
    out = tmp_path / "losses.json"
    torchrun(LAYOUTS[layout_name][0], "tests/converters/test_selective_ac.py", out, layout_name)
    # Only the layout's reductions differ (tensor-parallel partial sums over 2 ranks, the data-parallel
    # gradient average): a few ulp per step, carried by each SGD step; widest sum: the vocabulary.
    rtol = STEPS * VOCAB * torch.finfo(torch.float32).eps
    assert json.loads(out.read_text()) == pytest.approx(reference, rel=rtol, abs=0)


if __name__ == "__main__":
    from tests.workers import run_and_exit

    run_and_exit(_worker, sys.argv[1], sys.argv[2])
