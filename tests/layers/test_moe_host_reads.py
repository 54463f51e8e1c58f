"""An MoE layer's training step reads nothing back to the host (with a capacity; at expert-parallel size 1 and 2).

Host reads are what stall a GPU's launch queue: ``aten._local_scalar_dense`` (``.item()``, ``float()``,
``bool()``), ``aten.nonzero``, boolean-mask ``aten.index``, ops that size their output by the data
(``bincount``), and ``Tensor.tolist`` (no op on the CPU, so it is wrapped). Counted on the CPU with
``bench.host_reads`` over forward, the statistics the model reports, and backward.
"""
from __future__ import annotations

import pytest
import torch

from libai_lite.layers import MoEConfig, MoELayer, collect_moe_outputs
from bench.host_reads import count_host_reads


def _step(layer, x):
    out = layer(x)
    stats = collect_moe_outputs(layer)
    (out.square().mean() + stats["moe_aux_loss"]).backward()
    return stats


@pytest.mark.parametrize("top_k, gated", [(1, False), (2, True)])
def test_moe_forward_and_backward_read_nothing_back(top_k, gated):
    torch.manual_seed(0)
    cfg = MoEConfig(enabled=True, num_experts=4, top_k=top_k, capacity_factor=1.0)
    layer = MoELayer(cfg, hidden_size=16, ffn_hidden_size=32, activation="silu", gated=gated, bias=False)
    x = torch.randn(2, 12, 16)
    with count_host_reads() as counter:
        stats = _step(layer, x)
    assert dict(counter.counts) == {}
    # The statistics are tensors, read when the trainer logs; the counter sees that read.
    with count_host_reads() as counter:
        float(stats["moe_dropped_frac"])
    assert counter.counts["_local_scalar_dense"] == 1


def test_the_counter_sees_the_reads_of_the_unlimited_capacity_path():
    # Without a capacity the experts take exactly their tokens, whose counts the host must know:
    # the counter is able to fail.
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(enabled=True, num_experts=4, capacity_factor=None), hidden_size=16,
                     ffn_hidden_size=32, activation="gelu")
    with count_host_reads() as counter:
        _step(layer, torch.randn(2, 12, 16))
    assert counter.counts["nonzero"] >= 1 and counter.counts["tolist"] >= 1


def test_fixed_capacity_dispatch_equals_the_variable_one():
    # The same routing run both ways: zero-padded fixed slots against exactly the kept tokens.
    torch.manual_seed(0)
    cfg = MoEConfig(enabled=True, num_experts=4, top_k=2, capacity_factor=0.75)
    layer = MoELayer(cfg, hidden_size=16, ffn_hidden_size=32, activation="silu", gated=True, bias=True)
    x = torch.randn(24, 16, requires_grad=True)
    from libai_lite.layers.router import route

    routing = route(layer.router(x), layer.top_k, layer.capacity_factor)
    assert not routing.keep.all()  # some assignments dropped: the spare slot is exercised
    fixed = layer._fixed_capacity(x, routing)
    variable = layer._variable(x, routing)
    torch.testing.assert_close(fixed, variable)
    g = torch.randn_like(fixed)
    params = [x, *layer.experts.parameters()]
    for a, b in zip(torch.autograd.grad(fixed, params, g, retain_graph=True), torch.autograd.grad(variable, params, g)):
        torch.testing.assert_close(a, b)


def test_an_mt5_moe_training_step_reads_nothing_back():
    # The whole model: embeddings, T5 attention with padding, MoE feed-forwards in every layer, the
    # fused LM head and loss; forward and backward.
    from projects.MT5 import MT5ForPreTraining

    torch.manual_seed(0)
    cfg = dict(vocab_size=128, hidden_size=32, hidden_layers=2, num_attention_heads=4, head_size=8,
               intermediate_size=48, embedding_dropout_prob=0.0, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, model_type="mt5",
               moe=dict(enabled=True, num_experts=4, top_k=2, capacity_factor=1.25, every_n_layers=1))
    model = MT5ForPreTraining(cfg)
    enc, dec = torch.randint(1, 128, (2, 16)), torch.randint(1, 128, (2, 8))
    enc_mask, dec_mask = torch.ones(2, 16, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    enc_mask[1, 12:] = 0
    dec_mask[1, 6:] = 0
    labels = dec.masked_fill(dec_mask == 0, -100)
    for _ in range(2):  # the second step is counted (anything built once is built)
        model.zero_grad(set_to_none=True)
        with count_host_reads() as counter:
            out = model(encoder_input_ids=enc, decoder_input_ids=dec, labels=labels, encoder_attn_mask=enc_mask,
                        decoder_attn_mask=dec_mask)
            (out["lm_loss"] + out["moe_aux_loss"]).backward()
    assert dict(counter.counts) == {}


def _ep2_worker(rank, init_file):
    """Two ranks, ep=2, capacity 0.75: the fixed-slot exchange gives each rank the outputs and gradients the
    whole layer gives on one process, and its forward and backward read nothing back."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from libai_lite.parallel.expert_parallel import apply_expert_parallel, build_expert_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        cfg = MoEConfig(enabled=True, num_experts=4, top_k=2, capacity_factor=0.75, ep_size=2)
        whole = MoELayer(cfg, hidden_size=16, ffn_hidden_size=32, activation="silu", gated=True, bias=True)
        layer, both = copy.deepcopy(whole), copy.deepcopy(whole)
        inputs = torch.randn(2, 2, 12, 16)  # one micro-batch per rank
        mesh = init_device_mesh("cpu", (1, 2, 1, 1), mesh_dim_names=("pp", "dp", "cp", "tp"))
        apply_expert_parallel(layer, build_expert_mesh(mesh, 2))
        x = inputs[rank].clone().requires_grad_()
        with count_host_reads() as counter:
            out = layer(x)
            out.square().sum().backward()
        assert dict(counter.counts) == {}, dict(counter.counts)
        ref_x = inputs[rank].clone().requires_grad_()
        ref = whole(ref_x)
        ref.square().sum().backward()
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(x.grad, ref_x.grad)
        # The router is replicated: its gradient here is this rank's tokens' share, as on one process.
        torch.testing.assert_close(layer.router.weight.grad, whole.router.weight.grad)
        # An expert's gradient sums every token any rank sent it: the whole layer's over both micro-batches.
        for r in range(2):
            both(inputs[r]).square().sum().backward()
        for key, expert in layer.experts.items():
            for (name, p), q in zip(expert.named_parameters(), both.experts[key].parameters()):
                torch.testing.assert_close(p.grad, q.grad, msg=f"expert {key} {name}")
        # Evaluation (no gradient) takes the exchange sized by the routing: the same outputs.
        with torch.no_grad():
            torch.testing.assert_close(layer(x), ref)
        # Leave together: a gloo peer that tears down while the other still talks aborts.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_expert_parallel_fixed_slots_match_one_process_and_read_nothing_back(tmp_path):
    from tests.launch import spawn_ranks

    # A rank whose check fails raises, and spawn_ranks fails this test with its traceback.
    spawn_ranks(_ep2_worker, 2, (str(tmp_path / "store"),))
