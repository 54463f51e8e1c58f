"""GPT model tests: Hugging Face parity, masking, loss bookkeeping, training, stage composition, sizes, and TP intent."""
import copy
import os
import tempfile

import pytest
import torch

from libai_lite.layers import Linear1D, VocabEmbedding
from projects.GPT.modeling import GPTForPreTraining, GPTModel
from projects.GPT.modeling.hf_mapping import config_from_hf, state_dict_from_hf

from tests.launch import spawn_ranks

TINY = dict(
    hidden_layers=2,
    vocab_size=100,
    hidden_size=64,
    ffn_hidden_size=256,
    num_attention_heads=4,
    max_seq_length=32,
    embedding_dropout_prob=0.0,
    attention_dropout_prob=0.0,
    output_dropout_prob=0.0,
)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_logits_match_hugging_face_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=100,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        activation_function="gelu_new",
    )
    hf = GPT2LMHeadModel(config).eval()
    # HF's default init leaves biases and LN affine at 0/1; randomise them so a
    # mis-ordered bias or a swapped LN would show.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.normal_(0.0, 0.1 if name.endswith("bias") else 1.0)
    ours = GPTModel(**TINY, activation="gelu_tanh").eval()
    assert config_from_hf(config.to_dict()) == {**TINY, "activation": "gelu_tanh", "ffn_hidden_size": 256,
                                                "layernorm_epsilon": 1e-5, "initializer_range": 0.02}
    # The library mapping (projects/GPT/modeling/hf_mapping.py): transposed Conv1D, head-major qkv.
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), TINY), strict=True)
    ids = torch.randint(0, 100, (3, 32))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # HF ties its head to wte, as we do.
    assert ours.lm_head.weight is ours.embeddings.token_embeddings.weight


def test_intent_and_tying():
    model = GPTModel(**TINY)
    assert model.embeddings.token_embeddings.parallel == "vocab"
    assert model.embeddings.position_embeddings.parallel == "data"
    assert model.lm_head.parallel == "vocab"
    assert model.lm_head.weight is model.embeddings.token_embeddings.weight
    assert list(model.layers.keys()) == ["0", "1"]
    assert [layer.layer_idx for layer in model.layers.values()] == [0, 1]
    assert model.final_layernorm.layer_idx == model.lm_head.layer_idx == 1
    clone = copy.deepcopy(model)
    assert clone.lm_head.weight is clone.embeddings.token_embeddings.weight


def test_scaled_init_for_output_projections():
    model = GPTModel(**{**TINY, "hidden_size": 256, "ffn_hidden_size": 1024, "hidden_layers": 8})
    std = lambda lin: lin.weight.std().item()  # noqa: E731
    layer = model.layers["0"]
    assert abs(std(layer.self_attention.query_key_value) - 0.02) < 2e-3
    assert abs(std(layer.mlp.dense_4h_to_h) - 0.02 / 4) < 5e-4
    assert abs(std(layer.self_attention.dense) - 0.02 / 4) < 5e-4
    assert abs(model.embeddings.token_embeddings.weight.std().item() - 0.02) < 2e-3


def test_meta_build_then_materialise():
    with torch.device("meta"):
        model = GPTModel(**TINY)
    model.to_empty(device="cpu")
    model.tie_weights()
    for mod in model.modules():
        if hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
    assert model.lm_head.weight is model.embeddings.token_embeddings.weight
    assert abs(model.lm_head.weight.std().item() - 0.02) < 2e-3
    assert torch.isfinite(model(torch.randint(0, 100, (1, 8)))).all()


def test_causal_future_tokens_do_not_change_past_logits():
    model = GPTModel(**TINY).eval()
    ids = torch.randint(0, 100, (2, 16))
    changed = ids.clone()
    changed[:, 10:] = torch.randint(0, 100, (2, 6))
    torch.testing.assert_close(model(ids)[:, :10], model(changed)[:, :10])
    assert not torch.allclose(model(ids)[:, 10:], model(changed)[:, 10:])


def test_too_long_sequence_is_refused():
    with pytest.raises(ValueError, match="max_seq_length"):
        GPTModel(**TINY)(torch.zeros(1, 33, dtype=torch.long))


def test_without_labels_returns_logits():
    out = GPTForPreTraining(TINY)(torch.randint(0, 100, (2, 8)))
    assert set(out) == {"logits"} and out["logits"].shape == (2, 8, 100)


def test_ignored_labels_do_not_count():
    model = GPTForPreTraining(TINY).eval()
    ids = torch.randint(0, 100, (2, 8))
    labels = torch.randint(0, 100, (2, 8))
    labels[0, :3] = -100
    out = model(ids, labels=labels)
    logits = model(ids)["logits"]
    keep = labels != -100
    nll = torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="none")
    assert out["num_tokens"].dtype == torch.long and out["num_tokens"].item() == 13
    torch.testing.assert_close(out["lm_loss"], nll.mean())
    torch.testing.assert_close(out["nll_sum"], nll.sum())
    assert out["lm_loss"].requires_grad and not out["nll_sum"].requires_grad


def test_loss_mask_multiplies():
    model = GPTForPreTraining(TINY).eval()
    ids = torch.randint(0, 100, (2, 8))
    labels = torch.randint(0, 100, (2, 8))
    labels[1, 0] = -100
    loss_mask = torch.ones(2, 8)
    loss_mask[0, 5:] = 0
    out = model(ids, labels=labels, loss_mask=loss_mask)
    keep = (labels != -100) & loss_mask.bool()
    nll = torch.nn.functional.cross_entropy(model(ids)["logits"][keep], labels[keep], reduction="none")
    assert out["num_tokens"].item() == keep.sum().item() == 12
    torch.testing.assert_close(out["lm_loss"], nll.mean())
    torch.testing.assert_close(out["nll_sum"], nll.sum())


def test_fused_head_loss_equals_logits_path_with_ignored_and_masked_tokens():
    fused = GPTForPreTraining(TINY)
    unfused = GPTForPreTraining({**TINY, "fused_cross_entropy": False})
    unfused.load_state_dict(fused.state_dict())
    assert fused.GPT_model.fuses_cross_entropy() and not unfused.GPT_model.fuses_cross_entropy()
    ids = torch.randint(0, 100, (2, 8))
    labels = torch.randint(0, 100, (2, 8))
    labels[1, :2] = -100
    loss_mask = torch.ones(2, 8)
    loss_mask[0, 6:] = 0
    outs = [model(ids, labels=labels, loss_mask=loss_mask) for model in (fused, unfused)]
    for key in ("lm_loss", "nll_sum", "num_tokens"):
        torch.testing.assert_close(outs[0][key], outs[1][key], atol=1e-6, rtol=1e-6)
    for out in outs:
        out["lm_loss"].backward()
    grads = [dict((n, p.grad) for n, p in model.named_parameters()) for model in (fused, unfused)]
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5, msg=name)


def test_batch_with_nothing_to_predict_gives_zero_loss():
    model = GPTForPreTraining(TINY)
    out = model(torch.randint(0, 100, (1, 4)), labels=torch.full((1, 4), -100))
    assert out["lm_loss"].item() == 0 and out["num_tokens"].item() == 0
    out["lm_loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_loss_decreases_on_a_repeated_batch():
    model = GPTForPreTraining({**TINY, "embedding_dropout_prob": 0.1, "output_dropout_prob": 0.1})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 100, (4, 16))
    labels = torch.roll(ids, -1, dims=1)
    losses = []
    for _ in range(30):
        loss = model(ids, labels=labels)["lm_loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_pipeline_style_stages_compose_to_full_forward():
    model = GPTModel(**{**TINY, "hidden_layers": 4}).eval()
    ids = torch.randint(0, 100, (2, 12))
    first, middle, last = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    first.final_layernorm = first.lm_head = None
    for i in ("2", "3"):
        del first.layers[i]
    middle.embeddings = middle.final_layernorm = middle.lm_head = None
    for i in ("0", "1", "3"):
        del middle.layers[i]
    last.embeddings = None
    for i in ("0", "1", "2"):
        del last.layers[i]
    with torch.no_grad():
        hidden = first(ids)
        assert hidden.shape == (2, 12, 64)
        torch.testing.assert_close(last(middle(hidden)), model(ids))
    # The last stage still owns the tied head weight once the embeddings are gone.
    assert "lm_head.weight" in dict(last.named_parameters())


def test_from_config_accepts_dictconfig_and_libai_flags_and_refuses_typos():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({**TINY, "bias_gelu_fusion": True, "scale_mask_softmax_fusion": False, "amp_enabled": False})
    model = GPTForPreTraining(cfg)
    assert model.GPT_model.vocab_size == 100
    with pytest.raises(TypeError, match="hiden_size"):
        GPTForPreTraining({**TINY, "hiden_size": 64})


@pytest.mark.parametrize(
    "layers,hidden,heads,expected",
    [(12, 768, 12, 124_439_808), (24, 1024, 16, 354_823_168)],
    ids=["gpt2-117M", "gpt2-345M"],
)
def test_real_sizes_on_meta_match_published_and_hugging_face(layers, hidden, heads, expected):
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPTModel(layers, 50257, hidden, 4 * hidden, heads, max_seq_length=1024)
        hf = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads))
    assert model.lm_head.weight.is_meta
    assert model.num_parameters() == expected == sum(p.numel() for p in hf.parameters())
    n = expected - 1024 * hidden
    assert model.num_parameters(non_embedding=True) == n
    assert model.flops_per_token(1024) == 6 * n + 12 * layers * hidden * 1024


# ---------------------------------------------------------------- tensor-parallel intent, for real


def _tp_worker(rank, world_size, init_file, result_file):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        reference = GPTForPreTraining({**TINY, "vocab_size": 128})
        model = copy.deepcopy(reference)
        gpt = model.GPT_model
        # Translate the layers' declared intent into a plan; nothing GPT-specific.
        plan = {}
        for name, mod in gpt.named_modules():
            if isinstance(mod, VocabEmbedding):
                plan[name] = RowwiseParallel(input_layouts=Replicate())
            elif isinstance(mod, Linear1D) and mod.parallel == "vocab":  # keep vocab-sharded logits for loss_parallel
                plan[name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
            elif isinstance(mod, Linear1D) and mod.parallel == "col":
                plan[name] = ColwiseParallel()
            elif isinstance(mod, Linear1D) and mod.parallel == "row":
                plan[name] = RowwiseParallel()
        parallelize_module(gpt, init_device_mesh("cpu", (world_size,)), plan)
        # parallelize_module distributes the two tied uses separately; both are
        # split(0), so re-pointing the head at the embedding's DTensor restores the tie.
        assert gpt.lm_head.weight is not gpt.embeddings.token_embeddings.weight
        gpt.tie_weights()

        ids = torch.randint(0, 128, (2, 16))
        labels = torch.randint(0, 128, (2, 16))
        labels[0, :5] = -100
        expected = reference(ids, labels=labels)
        expected["lm_loss"].backward()
        with loss_parallel():
            got = model(ids, labels=labels)
            got["lm_loss"].backward()
        assert type(got["lm_loss"]) is torch.Tensor
        torch.testing.assert_close(got["lm_loss"], expected["lm_loss"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["nll_sum"], expected["nll_sum"], atol=1e-4, rtol=1e-5)
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
        if rank == 0:
            with open(result_file, "w") as f:
                f.write("ok")
        # Leave together: a gloo peer that tears down while the other still talks aborts.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_declared_intent_gives_single_process_loss_and_grads_under_tp2():
    """parallelize_module driven only by the layers' intent attributes, with the fused
    head-major qkv and loss_parallel, must reproduce the one-process loss and gradients."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result")
        spawn_ranks(_tp_worker, 2, (2, os.path.join(tmp, "store"), result))
        assert open(result).read() == "ok"
