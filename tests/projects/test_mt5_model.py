"""MT5/T5 model tests: Hugging Face parity (T5 v1.0 and mT5), masks, loss bookkeeping, token accuracy,
published sizes, FLOPs, training, pipeline-style stages, initialisation, cfg handling and tensor-parallel intent."""
import copy
import math
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

from libai_lite.layers import Linear1D, VocabEmbedding
from libai_lite.lm.seq2seq import Seq2SeqLMLoss
from libai_lite.utils.errors import UsageError
from projects.MT5 import MT5ForPreTraining, MT5Model
from projects.MT5.modeling.hf_mapping import state_dict_from_hf
from projects.MT5.modeling.relative_position import RelativePositionBias, relative_position_bucket

from tests.launch import spawn_ranks

VOCAB, HIDDEN, LAYERS, HEADS, HEAD_SIZE, FFN = 128, 48, 2, 4, 8, 96  # heads * head_size (32) != hidden (48)


def tiny(model_type="mt5", **overrides):
    """A tiny cfg in LiBai's key names; dropout off unless overridden."""
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        head_size=HEAD_SIZE,
        intermediate_size=FFN,
        embedding_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        model_type=model_type,
    )
    cfg.update(overrides)
    return cfg


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _padded_batch(batch=3, enc_len=20, dec_len=12):
    """Ids plus right-padded 0/1 masks with padding in both the encoder and the decoder."""
    enc = torch.randint(0, VOCAB, (batch, enc_len))
    dec = torch.randint(0, VOCAB, (batch, dec_len))
    enc_mask = torch.ones(batch, enc_len, dtype=torch.long)
    enc_mask[0, 15:] = 0
    enc_mask[2, 9:] = 0
    dec_mask = torch.ones(batch, dec_len, dtype=torch.long)
    dec_mask[1, 7:] = 0
    dec_mask[2, 10:] = 0
    return enc, dec, enc_mask, dec_mask


# ------------------------------------------------------------------ Hugging Face weights -> ours


def _hf_model(model_type, **sizes):
    from transformers import MT5Config, MT5ForConditionalGeneration, T5Config, T5ForConditionalGeneration

    kw = dict(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HEAD_SIZE, d_ff=FFN, num_layers=LAYERS, num_heads=HEADS, dropout_rate=0.0
    )
    kw.update(sizes)
    if model_type == "t5":
        hf = T5ForConditionalGeneration(T5Config(feed_forward_proj="relu", **kw))
    else:
        hf = MT5ForConditionalGeneration(MT5Config(feed_forward_proj="gated-gelu", **kw))
        # This transformers version ties mT5's head to the embedding; real mT5 checkpoints
        # do not, and a distinct head shows whether ours really uses its own.
        hf.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.2)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "layer_norm" in name:  # HF starts these at 1; random scales expose a swapped norm
                p.normal_(1.0, 0.3)
    return hf.eval()


@pytest.mark.parametrize("model_type", ["t5", "mt5"])
def test_logits_match_hugging_face_with_padding_in_encoder_and_decoder(model_type):
    hf = _hf_model(model_type)
    if model_type == "t5":
        assert hf.config.feed_forward_proj == "relu" and hf.lm_head.weight is hf.shared.weight
    ours = MT5Model(tiny(model_type)).eval()
    # The library mapping (projects/MT5/modeling/hf_mapping.py): fused head-major qkv / kv, stacked layer indices.
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), tiny(model_type)), strict=True)
    if model_type == "t5":
        assert ours.lm_head.weight is ours.embedding.weight
    else:
        assert not torch.equal(ours.lm_head.weight, ours.embedding.weight)
    enc, dec, enc_mask, dec_mask = _padded_batch()
    with torch.no_grad():
        expected = hf(
            input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask
        ).logits
        got = ours(enc, dec, enc_mask, dec_mask)
        unmasked = ours(enc, dec)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # The batch's padding matters, so the masks above were really exercised.
    assert (unmasked - expected).abs().max() > 1e-2


def test_logits_match_hugging_face_at_mt5_attention_shapes_through_flex_and_dense():
    """mT5's 12 heads of 64, an encoder past max_distance 128 and the recipe's ragged 114-token decoder:
    FlexAttention (eager here, as the GPU's compiled kernel computes it) and the dense path give Hugging
    Face's logits."""
    from libai_lite.layers.flex_attention import attention_backend

    hf = _hf_model("mt5", d_kv=64, num_heads=12, num_layers=1)
    cfg = tiny("mt5", head_size=64, num_attention_heads=12, hidden_layers=1)
    ours = MT5Model(cfg).eval()
    ours.load_state_dict(state_dict_from_hf(hf.state_dict(), cfg), strict=True)
    with torch.no_grad():  # a bias large enough to matter at every distance
        for name, p in hf.named_parameters():
            if "relative_attention_bias" in name:
                p.normal_(0.0, 2.0)
        ours.load_state_dict(state_dict_from_hf(hf.state_dict(), cfg), strict=True)
    enc, dec, enc_mask, dec_mask = _padded_batch(batch=3, enc_len=200, dec_len=114)
    with torch.no_grad():
        expected = hf(input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec,
                      decoder_attention_mask=dec_mask).logits
        for backend in ("flex", "dense"):
            with attention_backend(backend):
                torch.testing.assert_close(ours(enc, dec, enc_mask, dec_mask), expected, atol=1e-5, rtol=1e-5,
                                           msg=backend)


def test_relative_position_buckets_match_hugging_face():
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = torch.arange(-400, 401)[None, :] - torch.arange(0, 5)[:, None]
    for bidirectional in (True, False):
        for buckets, distance in ((32, 128), (16, 64)):
            expected = T5Attention._relative_position_bucket(relative, bidirectional, buckets, distance)
            got = relative_position_bucket(relative, bidirectional, buckets, distance)
            assert torch.equal(got, expected), (bidirectional, buckets, distance)
            assert got.min() >= 0 and got.max() == buckets - 1


def test_decoder_is_causal_and_encoder_padding_is_invisible():
    model = MT5Model(tiny()).eval()
    enc, dec, enc_mask, _ = _padded_batch()
    with torch.no_grad():
        base = model(enc, dec, enc_mask)
        future = dec.clone()
        future[:, 8:] = torch.randint(0, VOCAB, (3, 4))
        changed = model(enc, future, enc_mask)
        torch.testing.assert_close(changed[:, :8], base[:, :8])
        assert not torch.allclose(changed[:, 8:], base[:, 8:])
        # Padded encoder ids are masked out of encoder self-attention and (by default) cross-attention.
        junk = enc.clone()
        junk[enc_mask == 0] = torch.randint(0, VOCAB, (int((enc_mask == 0).sum()),))
        torch.testing.assert_close(model(junk, dec, enc_mask), base)


def test_libai_three_dim_masks_agree_with_padding_masks_on_real_positions():
    model = MT5Model(tiny()).eval()
    enc, dec, enc_mask, dec_mask = _padded_batch()
    e, d = enc_mask.bool(), dec_mask.bool()
    with torch.no_grad():
        two_d = model(enc, dec, enc_mask, dec_mask, enc_mask)
        # LiBai's make_attention_mask(query_valid, key_valid): padded query rows see nothing.
        three_d = model(
            enc, dec, e[:, :, None] & e[:, None, :], d[:, :, None] & d[:, None, :], d[:, :, None] & e[:, None, :]
        )
    assert torch.isfinite(three_d).all()
    torch.testing.assert_close(three_d[d], two_d[d])


# ------------------------------------------------------------------ loss and accuracy


def test_without_labels_returns_logits():
    out = MT5ForPreTraining(tiny())(torch.randint(0, VOCAB, (2, 10)), torch.randint(0, VOCAB, (2, 6)))
    assert set(out) == {"logits"} and out["logits"].shape == (2, 6, VOCAB)


def test_loss_ignores_minus_100_labels():
    model = MT5ForPreTraining(tiny()).eval()
    enc, dec, enc_mask, dec_mask = _padded_batch()
    labels = torch.roll(dec, -1, dims=1)
    labels[dec_mask == 0] = -100
    out = model(
        encoder_input_ids=enc, decoder_input_ids=dec, labels=labels, encoder_attn_mask=enc_mask,
        decoder_attn_mask=dec_mask, encoder_decoder_attn_mask=enc_mask,
    )
    assert set(out) == {"lm_loss", "num_tokens", "nll_sum", "token_acc"}
    assert not any("loss" in k for k in out if k != "lm_loss")
    logits = model(enc, dec, encoder_attn_mask=enc_mask, decoder_attn_mask=dec_mask)["logits"]
    keep = labels != -100
    nll = F.cross_entropy(logits[keep], labels[keep], reduction="none")
    assert out["num_tokens"].dtype == torch.long and out["num_tokens"].item() == keep.sum().item() == 36 - 5 - 2
    torch.testing.assert_close(out["lm_loss"], nll.mean())
    torch.testing.assert_close(out["nll_sum"], nll.sum())
    acc = (logits[keep].argmax(-1) == labels[keep]).float().mean()
    torch.testing.assert_close(out["token_acc"], acc)
    assert out["lm_loss"].requires_grad and not out["nll_sum"].requires_grad and not out["token_acc"].requires_grad


def test_token_acc_on_a_hand_made_example():
    logits = torch.full((2, 3, 5), -1.0)
    logits[0, 0, 2] = 4.0  # predicts 2, label 2: right
    logits[0, 1, 1] = 4.0  # predicts 1, label 3: wrong
    logits[0, 2, 4] = 4.0  # predicts 4, label 4: right
    logits[1, 0, 0] = 4.0  # predicts 0, label 0: right
    logits[1, 1, 3] = 4.0  # predicts 3, label -100: not scored
    logits[1, 2, 2] = 4.0  # predicts 2, label 1: wrong
    labels = torch.tensor([[2, 3, 4], [0, -100, 1]])
    out = Seq2SeqLMLoss()(logits, labels)
    assert out["num_tokens"].item() == 5
    assert out["token_acc"].item() == pytest.approx(3 / 5)
    # Ignored positions count neither as right nor as wrong, whatever their logits.
    labels[1, 1] = 3
    assert Seq2SeqLMLoss()(logits, labels)["token_acc"].item() == pytest.approx(4 / 6)


@pytest.mark.parametrize("model_type", ["t5", "mt5"])
def test_fused_head_loss_equals_logits_path(model_type):
    """The tied-and-scaled (T5) and untied (mT5) heads through linear_cross_entropy: same loss dict and grads."""
    fused = MT5ForPreTraining(tiny(model_type))
    unfused = MT5ForPreTraining(tiny(model_type, fused_cross_entropy=False))
    unfused.load_state_dict(fused.state_dict())
    assert fused.mt5_model.fuses_cross_entropy() and not unfused.mt5_model.fuses_cross_entropy()
    enc, dec, enc_mask, dec_mask = _padded_batch()
    labels = torch.roll(dec, -1, dims=1)
    labels[dec_mask == 0] = -100
    # A few labels set to the argmax so token_acc is neither 0 nor 1.
    with torch.no_grad():
        top = unfused(enc, dec, encoder_attn_mask=enc_mask, decoder_attn_mask=dec_mask)["logits"].argmax(-1)
    labels[0, :4] = top[0, :4]
    outs = [m(encoder_input_ids=enc, decoder_input_ids=dec, labels=labels, encoder_attn_mask=enc_mask,
              decoder_attn_mask=dec_mask) for m in (fused, unfused)]
    assert 0 < outs[1]["token_acc"].item() < 1
    for key in ("lm_loss", "nll_sum", "num_tokens", "token_acc"):
        torch.testing.assert_close(outs[0][key], outs[1][key], atol=1e-6, rtol=1e-6, msg=key)
    for out in outs:
        out["lm_loss"].backward()
    grads = [dict((n, p.grad) for n, p in m.named_parameters()) for m in (fused, unfused)]
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5, msg=name)


def test_batch_with_nothing_to_predict_gives_zero_loss_and_accuracy():
    model = MT5ForPreTraining(tiny())
    out = model(torch.randint(0, VOCAB, (1, 6)), torch.randint(0, VOCAB, (1, 4)), labels=torch.full((1, 4), -100))
    assert out["lm_loss"].item() == 0 and out["num_tokens"].item() == 0 and out["token_acc"].item() == 0
    out["lm_loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("model_type", ["t5", "mt5"])
def test_fresh_model_starts_near_log_vocab_and_a_repeated_batch_is_learned(model_type):
    model = MT5ForPreTraining(tiny(model_type, hidden_dropout_prob=0.1, embedding_dropout_prob=0.1))
    enc, dec, enc_mask, dec_mask = _padded_batch(batch=4, enc_len=16, dec_len=8)
    labels = torch.roll(dec, -1, dims=1)
    labels[dec_mask == 0] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        out = model(enc, dec, labels, enc_mask, dec_mask)
        opt.zero_grad()
        out["lm_loss"].backward()
        opt.step()
        losses.append(out["lm_loss"].item())
    assert abs(losses[0] - math.log(VOCAB)) < 1.5, losses[0]
    assert losses[-1] < 0.5 * losses[0], losses
    assert out["token_acc"].item() > 0.5


# ------------------------------------------------------------------ sizes and FLOPs


@pytest.mark.parametrize(
    "hidden,layers,heads,ffn,expected",
    [(512, 8, 6, 1024, 300_176_768), (768, 12, 12, 2048, 582_401_280), (1024, 24, 16, 2816, 1_229_581_312)],
    ids=["mt5-small", "mt5-base", "mt5-large"],
)
def test_real_mt5_sizes_on_meta_match_published_and_hugging_face(hidden, layers, heads, ffn, expected):
    from transformers import MT5Config, MT5ForConditionalGeneration

    cfg = dict(
        vocab_size=250112, hidden_size=hidden, hidden_layers=layers, num_attention_heads=heads,
        head_size=64, intermediate_size=ffn,
    )
    with torch.device("meta"):
        model = MT5Model(cfg)
        hf = MT5ForConditionalGeneration(
            MT5Config(d_model=hidden, d_ff=ffn, num_layers=layers, num_heads=heads, d_kv=64)
        )
        if hf.lm_head.weight is hf.shared.weight:  # real checkpoints have their own head
            hf.lm_head.weight = torch.nn.Parameter(torch.empty(250112, hidden))
    assert model.embedding.weight.is_meta
    assert model.num_parameters() == expected == sum(p.numel() for p in hf.parameters())
    buckets = 2 * 32 * heads
    assert model.num_parameters(non_embedding=True) == expected - 250112 * hidden - buckets
    assert model.pipeline_num_layers == 2 * layers


def test_t5_small_v1_0_size_matches_hugging_face():
    from transformers import T5Config, T5ForConditionalGeneration

    with torch.device("meta"):
        model = MT5Model(
            dict(
                vocab_size=32128, hidden_size=512, hidden_layers=6, num_attention_heads=8,
                intermediate_size=2048, model_type="t5",
            )
        )
        hf = T5ForConditionalGeneration(T5Config())
    assert model.lm_head.weight is model.embedding.weight
    assert model.num_parameters() == 60_506_624 == sum(p.numel() for p in hf.parameters())
    # The tied matrix is also the LM head, so it stays in the compute-bearing count.
    assert model.num_parameters(non_embedding=True) == 60_506_624 - 2 * 32 * 8


@pytest.mark.parametrize("model_type", ["t5", "mt5"])
def test_flops_per_token_equals_counted_forward_and_backward_flops(model_type):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = MT5ForPreTraining(tiny(model_type))
    batch, enc_len, dec_len = 3, 20, 7
    enc, dec = torch.randint(0, VOCAB, (batch, enc_len)), torch.randint(0, VOCAB, (batch, dec_len))
    # The math backend runs attention as counted bmm's (the fused CPU kernel has no FLOP formula).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(enc, dec, labels=dec, encoder_attn_mask=torch.ones(batch, enc_len))["lm_loss"].backward()
    expected = model.flops_per_token(enc_len, dec_len) * batch * enc_len
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-12)
    assert model.flops_per_token(enc_len) == model.mt5_model.flops_per_token(enc_len, enc_len)


# ------------------------------------------------------------------ structure, stages, init


def test_structure_names_and_declared_intent():
    model = MT5Model(tiny())
    L = LAYERS
    assert list(model.encoder_layers) == [str(i) for i in range(L)]
    assert list(model.decoder_layers) == [str(i) for i in range(L, 2 * L)]
    stacks = [*model.encoder_layers.values(), *model.decoder_layers.values()]
    assert [m.layer_idx for m in stacks] == list(range(2 * L))
    assert model.embedding.parallel == "vocab" and model.lm_head.parallel == "vocab"
    assert model.encoder_final_layernorm.layer_idx == L - 1
    assert model.decoder_final_layernorm.layer_idx == model.lm_head.layer_idx == 2 * L - 1
    tables = {n: m for n, m in model.named_modules() if isinstance(m, RelativePositionBias)}
    assert sorted(tables) == ["decoder_layers.2.relative_attention_bias", "encoder_layers.0.relative_attention_bias"]
    assert tables["encoder_layers.0.relative_attention_bias"].bidirectional
    assert not tables["decoder_layers.2.relative_attention_bias"].bidirectional
    assert all(t.parallel == "col" and t.weight.shape == (32, HEADS) for t in tables.values())
    attn = model.decoder_layers["2"].self_attention
    assert attn.softmax_scale == 1.0 and attn.attn_mask_type == "causal" and attn.query_key_value.bias is None
    assert model.encoder_layers["0"].self_attention.attn_mask_type == "padding"
    assert model.decoder_layers["3"].cross_attention.is_cross_attention
    assert model.encoder_layers["0"].mlp.gated  # gate and up in one dense_h_to_4h for mT5
    t5 = MT5Model(tiny("t5"))
    assert not t5.encoder_layers["0"].mlp.gated and t5.encoder_layers["0"].mlp.activation == "relu"
    clone = copy.deepcopy(t5)
    assert clone.lm_head.weight is clone.embedding.weight


def test_the_wrapper_is_the_cores_and_keeps_its_checkpoint_prefix():
    """MT5 keeps its architecture only: the protocol, loss, forward and generation are the core's seq2seq base."""
    from libai_lite.lm.seq2seq import Seq2SeqLM, Seq2SeqLMForPreTraining

    protocol = ("forward", "output_metrics", "tokens_per_sample", "flops_per_sample", "pipeline_num_layers",
                "pipeline_module", "pipeline_batch", "pipeline_loss_fn", "pipeline_metrics", "num_parameters",
                "flops_per_token", "generate")
    assert issubclass(MT5ForPreTraining, Seq2SeqLMForPreTraining) and issubclass(MT5Model, Seq2SeqLM)
    assert not set(protocol) & set(vars(MT5ForPreTraining)), "the project repeats protocol code the core holds"
    for name in ("forward", "generate", "fuses_cross_entropy", "head"):
        assert name not in vars(MT5Model), name
    model = MT5ForPreTraining(tiny())
    assert model.inner is model.mt5_model and isinstance(model.loss_func, Seq2SeqLMLoss)
    assert {k.split(".")[0] for k in model.state_dict()} == {"mt5_model"}


def test_meta_build_then_materialise_draws_t5_init():
    with torch.device("meta"):
        model = MT5Model(tiny("t5", hidden_size=256, head_size=64, intermediate_size=1024, vocab_size=512))
    model.to_empty(device="cpu")
    model.tie_weights()
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert model.lm_head.weight is model.embedding.weight
    qkv = model.encoder_layers["0"].self_attention.query_key_value.weight.view(HEADS, 3, 64, 256)
    assert abs(qkv[:, 0].std().item() - (256 * 64) ** -0.5) < 0.1 * (256 * 64) ** -0.5
    assert abs(qkv[:, 1:].std().item() - 256**-0.5) < 0.05 * 256**-0.5
    assert abs(model.embedding.weight.std().item() - 1.0) < 0.05
    assert abs(model.encoder_layers["1"].mlp.dense_4h_to_h.weight.std().item() - 1024**-0.5) < 0.05 * 1024**-0.5
    assert torch.equal(model.decoder_final_layernorm.weight, torch.ones(256))
    out = model(torch.randint(0, 512, (1, 8)), torch.randint(0, 512, (1, 4)))
    assert torch.isfinite(out).all()


def test_cfg_accepts_libai_keys_and_dictconfig_and_refuses_bad_input():
    from omegaconf import OmegaConf

    libai_extras = dict(amp_enabled=False, padding_idx=0, eos_token_id=1, is_encoder_decoder=True)
    model = MT5ForPreTraining(OmegaConf.create({**tiny(), **libai_extras}))
    assert model.mt5_model.cfg.tie_word_embeddings is False
    assert MT5Model({**tiny(), "head_size": None, "hidden_size": 64}).cfg.head_size == 16
    with pytest.raises(UsageError, match="'hiden_size' \\(did you mean 'hidden_size'\\?\\)"):
        MT5Model({**tiny(), "hiden_size": 48})
    with pytest.raises(UsageError, match="model_type='bert'"):
        MT5Model(tiny("bert"))
    with pytest.raises(UsageError, match="missing intermediate_size"):
        MT5Model({k: v for k, v in tiny().items() if k != "intermediate_size"})
    with pytest.raises(UsageError, match="head_size"):
        MT5Model({**tiny(), "head_size": None, "hidden_size": 50})
    # tie_word_embeddings follows Hugging Face: True ties (and scales) even a gated-GELU model.
    tied = MT5Model(tiny("mt5", tie_word_embeddings=True))
    assert tied.lm_head.weight is tied.embedding.weight


def test_common_config_builds_mt5_base():
    from libai_lite.config import LazyConfig, instantiate

    cfg = LazyConfig.load("projects/MT5/configs/model.py")
    assert cfg.pretrain_model.cfg.model_type == "mt5" and cfg.pretrain_model.cfg.vocab_size == 250112
    with torch.device("meta"):
        model = instantiate(cfg.pretrain_model)
    assert isinstance(model, MT5ForPreTraining)
    assert model.num_parameters() == 582_401_280


# ------------------------------------------------------------------ tensor-parallel intent, for real


def _tp_worker(rank, world_size, init_file, result_file):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        for model_type in ("mt5", "t5"):
            torch.manual_seed(0)
            reference = MT5ForPreTraining(tiny(model_type))
            model = copy.deepcopy(reference)
            mt5 = model.mt5_model
            # Translate the layers' declared intent into a plan; nothing T5-specific.
            plan = {}
            for name, mod in mt5.named_modules():
                parallel = getattr(mod, "parallel", None)
                if isinstance(mod, VocabEmbedding):
                    plan[name] = RowwiseParallel(input_layouts=Replicate())
                elif isinstance(mod, Linear1D) and parallel == "vocab":
                    plan[name] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
                elif parallel == "col":  # column-parallel Linear1D and the head-split relative bias table
                    plan[name] = ColwiseParallel()
                elif isinstance(mod, Linear1D) and parallel == "row":
                    plan[name] = RowwiseParallel()
            parallelize_module(mt5, init_device_mesh("cpu", (world_size,)), plan)
            mt5.tie_weights()

            enc, dec, enc_mask, dec_mask = _padded_batch()
            labels = torch.roll(dec, -1, dims=1)
            labels[dec_mask == 0] = -100
            expected = reference(enc, dec, labels, enc_mask, dec_mask)
            expected["lm_loss"].backward()
            with loss_parallel():
                got = model(enc, dec, labels, enc_mask, dec_mask)
                got["lm_loss"].backward()
            for key in ("lm_loss", "nll_sum", "token_acc"):
                assert type(got[key]) is torch.Tensor, key
                torch.testing.assert_close(got[key], expected[key], atol=1e-5, rtol=1e-5, msg=f"{model_type} {key}")
            assert got["num_tokens"].item() == expected["num_tokens"].item()
            for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                torch.testing.assert_close(grad, q.grad, atol=1e-5, rtol=1e-4, msg=f"{model_type} {name}")
        if rank == 0:
            with open(result_file, "w") as f:
                f.write("ok")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_declared_intent_gives_single_process_loss_accuracy_and_grads_under_tp2():
    """parallelize_module driven by the layers' intent (vocab-parallel embedding and mT5 head,
    head-split relative bias, head-major fused qkv/kv with d_kv != hidden/heads) and loss_parallel
    must reproduce the one-process loss, token accuracy and gradients, for mT5 and tied T5."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result")
        spawn_ranks(_tp_worker, 2, (2, os.path.join(tmp, "store"), result))
        assert open(result).read() == "ok"
