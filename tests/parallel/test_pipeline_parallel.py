"""Pipeline parallelism (libai_lite.parallel.pipeline) against one process.

Each multi-process test launches `torchrun --nproc_per_node 2 tests/workers/pp_worker.py` (gloo, CPU) for
one schedule and checks what its phases wrote against a one-process reference computed here:
loss and every gradient of a step of 4 micro-batches, 10 AdamW steps with clipping, evaluation,
and DCP checkpoints moved between pp=2 and pp=1 with the tied embedding / LM head.
"""
import copy
from pathlib import Path

import pytest

from tests.launch import torchrun
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from libai_lite.parallel.clip_grad import clip_grad_norm_
from libai_lite.parallel.pipeline import check_schedule
from libai_lite.parallel.pipeline_split import (
    alias_state_dict_keys,
    build_stage_modules,
    local_stage_ids,
    materialize_stage,
    pipeline_model_view,
    split_pipeline_stage,
    tied_checkpoint_aliases,
    tied_weight_copies,
)
from libai_lite.utils.parallel_dims import layer_stages
from libai_lite.utils.errors import UsageError
from projects.GPT.modeling.gpt_model import GPTForPreTraining, GPTModel

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "pp_worker.py"
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
EMB = "GPT_model.embeddings.token_embeddings.weight"
HEAD = "GPT_model.lm_head.weight"

CFG = dict(
    hidden_layers=4, vocab_size=128, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2,
    max_seq_length=16, embedding_dropout_prob=0.0, attention_dropout_prob=0.0, output_dropout_prob=0.0,
)
SEED, ACC, LR, WD, MAX_NORM, STEPS, RESUME_AT, FSDP_STEPS = 1234, 4, 1e-2, 0.01, 0.05, 10, 3, 3


def _batch(rows=2 * ACC, seed=7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG["vocab_size"], (rows, 16), generator=g)
    labels = torch.randint(0, CFG["vocab_size"], (rows, 16), generator=g)
    # Unequal numbers of ignored labels per micro-batch: the step loss is the mean of
    # micro-batch means, which then differs from the token mean of the whole batch.
    labels[0, :9] = -100
    labels[5, 3:5] = -100
    return ids, labels


def _model():
    torch.manual_seed(SEED)
    return GPTForPreTraining(CFG)


def _ref_step(model, ids, labels):
    """The eager trainer's step: each micro-batch's mean loss / ACC, backward, accumulate."""
    total = 0.0
    for mb_ids, mb_labels in zip(ids.chunk(ACC), labels.chunk(ACC)):
        loss = model(mb_ids, labels=mb_labels)["lm_loss"]
        (loss / ACC).backward()
        total += float(loss.detach()) / ACC
    return total


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """Reference numbers, the worker's data file and a one-process checkpoint after RESUME_AT steps."""
    work = tmp_path_factory.mktemp("pp")
    ids, labels = _batch()
    out = {"work": work}

    model = _model()
    out["loss"] = _ref_step(model, ids, labels)
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    out["norm"] = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(_ref_step(model, ids, labels))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step + 1 == RESUME_AT:
            msd, osd = get_state_dict(model, opt, options=FLAT)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(work / "ckpt_pp1"))
            out["params_at_resume"] = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    out["losses"], out["norms"] = losses, norms
    with torch.no_grad():
        ev = model(ids, labels=labels)
    out["eval"] = {"lm_loss": float(ev["nll_sum"] / ev["num_tokens"]), "nll_sum": float(ev["nll_sum"]),
                   "num_tokens": float(ev["num_tokens"])}
    out["final"] = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}

    # pp=2 x dp=2: each data-parallel rank takes half of a batch of 2 x ACC micro-batches.
    dp_ids, dp_labels = _batch(4 * ACC, seed=11)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    out["fsdp_losses"], out["fsdp_norms"] = [], []
    for _ in range(FSDP_STEPS):
        halves = zip(dp_ids.chunk(2), dp_labels.chunk(2))
        loss = 0.0
        for half_ids, half_labels in halves:
            for mb_ids, mb_labels in zip(half_ids.chunk(ACC), half_labels.chunk(ACC)):
                mb_loss = model(mb_ids, labels=mb_labels)["lm_loss"]
                (mb_loss / (2 * ACC)).backward()
                loss += float(mb_loss.detach()) / (2 * ACC)
        out["fsdp_norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["fsdp_losses"].append(loss)
    out["fsdp_tied"] = model.GPT_model.lm_head.weight.detach().clone()

    torch.save({
        "cfg": CFG, "seed": SEED, "input_ids": ids, "labels": labels, "n_microbatches": ACC, "lr": LR,
        "weight_decay": WD, "max_norm": MAX_NORM, "steps": STEPS, "resume_steps": 2,
        "custom_stage_ids": [0, 0, 0, 1], "dp_input_ids": dp_ids, "dp_labels": dp_labels, "fsdp_steps": FSDP_STEPS,
    }, work / "data.pt")
    return out



def _launch(work, schedule, virtual, phases, nproc=2):
    torchrun(nproc, WORKER, work, schedule, virtual, ",".join(phases))


def _load(work, name, nproc=2):
    return [torch.load(work / f"{name}_rank{r}.pt", weights_only=True) for r in range(nproc)]


def _check_grads(ref, ranks, expect_layers):
    """Every FQN is owned by exactly one rank and its gradient matches; both tied copies carry
    the full tied gradient (the sum of the embedding and LM-head uses)."""
    assert ranks[1]["loss"] == pytest.approx(ranks[0]["loss"], rel=1e-12), "loss broadcast to every pp rank"
    assert ranks[0]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    owner = {}
    for r, res in enumerate(ranks):
        assert res["layers"] == expect_layers[r]
        for name, grad in res["grads"].items():
            assert name not in owner, f"{name} on ranks {owner.get(name)} and {r}"
            owner[name] = r
            assert _rel(grad, ref["grads"][name]) < 1e-5, (name, _rel(grad, ref["grads"][name]))
    assert set(owner) == set(ref["grads"]), set(ref["grads"]) ^ set(owner)
    assert owner[EMB] == 0 and owner[HEAD] == 1
    torch.testing.assert_close(ranks[0]["grads"][EMB], ranks[1]["grads"][HEAD], rtol=0, atol=0)
    # The total norm counts the tied weight once, like the one-process model where it is one Parameter.
    for res in ranks:
        assert res["norm"] == pytest.approx(ref["norm"], rel=1e-5)
        assert res["scaled_loss"] == pytest.approx(res["loss"], rel=1e-6)
        for name, grad in res["scaled_grads"].items():
            torch.testing.assert_close(grad, 256.0 * res["grads"][name], rtol=1e-5, atol=1e-8, msg=name)


def _check_train(ref, ranks):
    for res in ranks:
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=0)
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(ref["norms"]), rtol=1e-4, atol=0)
        for key in ("lm_loss", "nll_sum", "num_tokens"):
            assert res["eval"][key] == pytest.approx(ref["eval"][key], rel=1e-4), key
    assert ref["norms"][0] > MAX_NORM, "the clipping threshold must bite for the test to mean something"
    assert ref["losses"][-1] < ref["losses"][0] - 0.1
    # Identical gradients and AdamW states keep the two tied copies identical.
    torch.testing.assert_close(ranks[0]["params"][EMB], ranks[1]["params"][HEAD], rtol=0, atol=0)


# ------------------------------------------------------------------------ multi-process


def test_gpipe_pp2_grads_custom_split_and_training(ref):
    work = ref["work"]
    _launch(work, "gpipe", 1, ["grads", "grads_custom", "train"])
    _check_grads(ref, _load(work, "gpipe_grads"), [[0, 1], [2, 3]])
    _check_grads(ref, _load(work, "gpipe_grads_custom"), [[0, 1, 2], [3]])
    _check_train(ref, _load(work, "gpipe_train"))


def test_1f1b_pp2_grads_training_and_tied_checkpoints_across_layouts(ref):
    work = ref["work"]
    _launch(work, "1f1b", 1, ["grads", "train", "resume"])
    _check_grads(ref, _load(work, "1f1b_grads"), [[0, 1], [2, 3]])
    trained = _load(work, "1f1b_train")
    _check_train(ref, trained)

    # pp=1 -> pp=2: a meta-built, per-stage initialised model whose tied copies were broadcast,
    # then the one-process checkpoint (both FQNs in the model, optimizer state under the
    # embedding's only) loaded; training continues on the one-process curve.
    resumed = _load(work, "1f1b_resume")
    assert resumed[0]["on_meta"] == [] and resumed[1]["on_meta"] == []
    torch.testing.assert_close(resumed[0]["tied_after_broadcast"][EMB], resumed[1]["tied_after_broadcast"][HEAD],
                               rtol=0, atol=0)
    assert resumed[0]["aliases"] == {} and resumed[1]["aliases"] == {HEAD: EMB}
    for res in resumed:
        for name, value in res["loaded"].items():
            torch.testing.assert_close(value, ref["params_at_resume"][name], rtol=0, atol=0, msg=name)
        expected = ref["losses"][RESUME_AT:RESUME_AT + 2]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(expected), rtol=1e-4, atol=0)

    # pp=2 -> pp=1: the checkpoint saved after training loads into the tied one-process model,
    # weights and AdamW state exactly as the pipeline ranks held them.
    model = GPTForPreTraining(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    msd, osd = get_state_dict(model, opt, options=FLAT)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(work / "ckpt_pp2_1f1b"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT)
    assert model.GPT_model.lm_head.weight is model.GPT_model.embeddings.token_embeddings.weight
    saved = {**trained[0]["params"], **trained[1]["params"]}
    for name, p in model.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(p.detach(), saved[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(p.detach(), ref["final"][name], rtol=1e-3, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    _, osd = get_state_dict(model, opt, options=FLAT)
    for key in (f"state.{EMB}.exp_avg", f"state.{EMB}.exp_avg_sq", "state.GPT_model.layers.3.mlp.dense_4h_to_h.weight.exp_avg"):
        owner = trained[0]["optim"] if key in trained[0]["optim"] else trained[1]["optim"]
        torch.testing.assert_close(osd[key], owner[key], rtol=0, atol=0, msg=key)


def test_interleaved_1f1b_pp2_two_virtual_stages(ref):
    work = ref["work"]
    _launch(work, "interleaved_1f1b", 2, ["grads", "train"])
    # Four stages over two ranks: rank 0 runs stages 0 and 2, rank 1 stages 1 and 3.
    ranks = _load(work, "interleaved_1f1b_grads")
    assert ranks[0]["stage_ids"] == [0, 2] and ranks[1]["stage_ids"] == [1, 3]
    _check_grads(ref, ranks, [[0, 2], [1, 3]])
    _check_train(ref, _load(work, "interleaved_1f1b_train"))


@pytest.mark.slow
def test_1f1b_pp2_with_fsdp2_dp2_matches_one_process(ref):
    """Stage modules under FSDP2 (DTensor parameters and gradients): the tied-gradient sum runs on
    the local shards, the norm over DTensor gradients is made full before the pipeline sum."""
    work = ref["work"]
    _launch(work, "1f1b", 1, ["fsdp"], nproc=4)
    ranks = _load(work, "1f1b_fsdp", nproc=4)
    assert [r["pp_rank"] for r in ranks] == [0, 0, 1, 1], "mesh (pp, dp, tp): global rank = pp * dp_size + dp"
    assert all(r["placements"] == ["(Shard(dim=0),)"] for r in ranks)
    dp_mean = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    torch.testing.assert_close(torch.tensor(dp_mean), torch.tensor(ref["fsdp_losses"]), rtol=1e-4, atol=0)
    for res in ranks:
        torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(ref["fsdp_norms"]), rtol=1e-4, atol=0)
        for value in res["tied"].values():
            torch.testing.assert_close(value, ref["fsdp_tied"], rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(ranks[0]["tied"][EMB], ranks[2]["tied"][HEAD], rtol=0, atol=0)


# ------------------------------------------------------------------------ one process


def test_split_keeps_owned_pieces_with_unsplit_fqns():
    stage_of_layer = layer_stages(4, 2, [0, 0, 0, 1])
    first, last = _model(), _model()
    s0 = split_pipeline_stage(first, 0, 2, stage_of_layer)
    s1 = split_pipeline_stage(last, 1, 2, stage_of_layer)
    assert s0 is first.GPT_model and list(s0.layers.keys()) == ["0", "1", "2"]
    assert s0.embeddings is not None and s0.final_layernorm is None and s0.lm_head is None
    assert s1.embeddings is None and list(s1.layers.keys()) == ["3"] and s1.lm_head is not None
    names0 = {n for n, _ in first.named_parameters()}
    names1 = {n for n, _ in last.named_parameters()}
    assert EMB in names0 and HEAD in names1 and not names0 & names1
    assert names0 | names1 == {n for n, _ in _model().named_parameters(remove_duplicate=False)}
    # Same seed, same init: the last stage's own copy starts equal to the first stage's embedding.
    torch.testing.assert_close(s1.lm_head.weight, s0.embeddings.token_embeddings.weight, rtol=0, atol=0)
    copies = tied_weight_copies([s1])
    assert len(copies) == 1 and copies[0] is s1.lm_head.weight and tied_weight_copies([s0]) == []
    assert tied_checkpoint_aliases(last, GPTModel.pipeline_tied) == {HEAD: EMB} and tied_checkpoint_aliases(first, GPTModel.pipeline_tied) == {}
    # On one stage the tie is one Parameter and nothing is a copy.
    whole = split_pipeline_stage(_model(), 0, 1, layer_stages(4, 1))
    assert whole.lm_head.weight is whole.embeddings.token_embeddings.weight and tied_weight_copies([whole]) == []


def test_virtual_stages_view_and_meta_materialisation():
    with torch.device("meta"):
        model = GPTForPreTraining(CFG)
    ids = local_stage_ids(1, 2, 2)
    stages, models = build_stage_modules(model, ids, 4, layer_stages(4, 4))
    assert ids == [1, 3] and [list(s.layers.keys()) for s in stages] == [["1"], ["3"]]
    assert stages[0].lm_head is None and stages[1].lm_head is not None and stages[1].embeddings is None
    view = pipeline_model_view(models)
    names = [n for n, _ in view.named_parameters()]
    assert HEAD in names and EMB not in names
    assert any(n.startswith("GPT_model.layers.1.") for n in names) and any(n.startswith("GPT_model.layers.3.") for n in names)
    assert not any(n.startswith(("GPT_model.layers.0.", "GPT_model.layers.2.")) for n in names)
    for stage in stages:
        materialize_stage(stage, "cpu")
    assert not any(p.is_meta for p in view.parameters())
    # The view holds the stage modules' own Parameters, so an optimizer over it steps the stages.
    assert {id(p) for p in view.parameters()} == {id(p) for s in stages for p in s.parameters()}
    assert tied_checkpoint_aliases(view, GPTModel.pipeline_tied) == {HEAD: EMB}
    assert 0.01 < float(stages[1].lm_head.weight.detach().std()) < 0.03


def test_alias_state_dict_keys_renames_model_and_flat_optimizer_entries():
    t = torch.zeros(1)
    state = {"model": {HEAD: t, "x": t}, "optim": {f"state.{HEAD}.exp_avg": t, f"param_groups.{HEAD}.lr": 0.1,
                                                   f"state.{HEAD}x.step": t}}
    out = alias_state_dict_keys(state, {HEAD: EMB})
    assert set(out["model"]) == {EMB, "x"} and out["model"][EMB] is t
    assert set(out["optim"]) == {f"state.{EMB}.exp_avg", f"param_groups.{EMB}.lr", f"state.{HEAD}x.step"}
    assert alias_state_dict_keys(out, {EMB: HEAD}) == state


def test_clip_counts_excluded_copies_once_and_scales_them():
    a = torch.nn.Parameter(torch.zeros(3))
    copy_of_a = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(4))
    a.grad, copy_of_a.grad, b.grad = torch.full((3,), 2.0), torch.full((3,), 2.0), torch.full((4,), 1.0)
    norm = clip_grad_norm_([a, copy_of_a, b], 1.0, 2.0, exclude_from_norm=[copy_of_a])
    assert float(norm) == pytest.approx((3 * 4 + 4) ** 0.5)
    torch.testing.assert_close(a.grad, copy_of_a.grad)
    assert float(a.grad[0]) == pytest.approx(2.0 / 4.0, rel=1e-5)
    assert float(clip_grad_norm_([b], float("inf"), float("inf"))) == pytest.approx(0.25, rel=1e-5)


@pytest.mark.parametrize(
    "schedule,num_stages,pp,n_mb,match",
    [
        ("zero_bubble", 2, 2, 4, "unknown pipeline schedule 'zero_bubble'; use one of"),
        ("1f1b", 4, 4, 2, r"'1f1b' needs n_microbatches \(2\) >= the number of stages \(4\)"),
        ("gpipe", 4, 2, 4, "one stage per pipeline rank, got 2; use 'interleaved_1f1b'"),
        ("interleaved_1f1b", 2, 2, 4, "at least 2 virtual stages per pipeline rank, got 1"),
        ("interleaved_1f1b", 8, 4, 9, r"multiple of max\(1, n_microbatches // pp\) = 2"),
        ("1f1b", 3, 2, 4, "3 pipeline stages do not divide over 2 pipeline ranks"),
    ],
)
def test_bad_schedule_settings_are_usage_errors(schedule, num_stages, pp, n_mb, match):
    with pytest.raises(UsageError, match=match):
        check_schedule(schedule, num_stages, pp, n_mb)


def test_good_schedule_settings_pass():
    assert check_schedule("GPipe", 2, 2, 1) == "gpipe"
    assert check_schedule("1f1b", 2, 2, 2) == "1f1b"
    assert check_schedule("interleaved_1f1b", 4, 2, 4) == "interleaved_1f1b"
    assert check_schedule("interleaved_1f1b", 8, 4, 3) == "interleaved_1f1b"


def test_more_stages_than_layers_is_a_usage_error():
    with pytest.raises(UsageError, match="the pipeline's 8 stages .* are more stages than the model's 4 layers"):
        layer_stages(4, 8)
    with pytest.raises(UsageError, match="stage_of_layer has 3 entries but the model has layer 3"):
        split_pipeline_stage(_model(), 0, 2, [0, 0, 1])
    with pytest.raises(UsageError, match="stage id 2 is outside 0..1"):
        split_pipeline_stage(_model(), 2, 2, [0, 0, 1, 1])


# ------------------------------------------------------------------ T5: two stacks, carried state


@pytest.mark.parametrize("model_type", ["t5", "mt5"])
def test_mt5_stages_compose_to_the_whole_model_with_the_carried_state(model_type):
    """Stages cut by the generic splitter by the layer_idx of T5's pieces, run through pipeline_forward with
    what each stage returns handed to the next, give the whole model's logits and gradients."""
    from libai_lite.parallel.pipeline_split import PipelineForward, pipeline_tied
    from projects.MT5 import MT5ForPreTraining

    cfg = dict(vocab_size=64, hidden_size=32, hidden_layers=3, num_attention_heads=2, head_size=8,
               intermediate_size=48, embedding_dropout_prob=0.0, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, model_type=model_type)
    torch.manual_seed(0)
    whole = MT5ForPreTraining(cfg)
    g = torch.Generator().manual_seed(1)
    enc, dec = torch.randint(0, 64, (3, 10), generator=g), torch.randint(0, 64, (3, 6), generator=g)
    enc_mask = torch.ones(3, 10, dtype=torch.long)
    enc_mask[0, 7:] = 0
    dec_mask = torch.ones(3, 6, dtype=torch.long)
    dec_mask[2, 4:] = 0
    labels = torch.randint(0, 64, (3, 6), generator=g)
    labels[2, 4:] = -100
    batch = dict(encoder_input_ids=enc, decoder_input_ids=dec, encoder_attn_mask=enc_mask,
                 decoder_attn_mask=dec_mask, encoder_decoder_attn_mask=enc_mask, labels=labels)
    # A few labels set to the argmax so token_acc is neither 0 nor 1.
    with torch.no_grad():
        top = whole(**{k: v for k, v in batch.items() if k != "labels"})["logits"].argmax(-1)
    labels[0, :4] = top[0, :4]
    acc = whole(**batch)["token_acc"]
    assert 0 < acc.item() < 1

    expected = whole(**batch)["lm_loss"]
    expected.backward()
    want = {n: p.grad.clone() for n, p in whole.named_parameters()}

    # 6 pipeline layers over 4 stages: [0 1] [2] [3 4] [5] puts a cut inside the encoder, one at
    # the encoder/decoder boundary (layer 2 with the encoder's final norm) and one in the decoder.
    stage_of_layer = [0, 0, 1, 2, 2, 3]
    model = copy.deepcopy(whole)
    model.zero_grad()
    stages, models = build_stage_modules(model, [0, 1, 2, 3], 4, stage_of_layer)
    assert all(isinstance(s, PipelineForward) for s in stages)
    assert stages[1].module.encoder_final_layernorm is not None and stages[2].module.encoder_final_layernorm is None
    assert pipeline_tied(stages[3]) == (("embedding.weight", "lm_head.weight") if model_type == "t5" else None)

    args, kwargs, target = whole.pipeline_batch(batch)
    out = stages[0](*args, **kwargs)
    assert len(out) == 3 and out[2].shape == (32, 2)  # mid-encoder: the encoder's bias table [buckets, heads] travels
    out = stages[1](*out, **kwargs)
    assert len(out) == 2  # encoder done, decoder not started: no bias
    out = stages[2](*out, **kwargs)
    assert len(out) == 3 and out[2].shape == (32, 2)  # the decoder's bias table
    per_token = stages[3](*out, **kwargs)
    # The last stage's fused head returns per-token losses and top-1 hits.
    assert per_token.shape == (*target.shape, 2)
    loss = whole.pipeline_loss_fn(per_token, target)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(whole.pipeline_metrics(per_token, target)["token_acc"], acc)
    loss.backward()

    got = {}
    for m in models:
        for n, p in m.named_parameters(remove_duplicate=False):
            if p.grad is not None:
                got[n] = got.get(n, 0) + p.grad
    if model_type == "t5":
        # The LM-head copy on the last stage and the embedding on the first: their sum is the tied gradient.
        head = "mt5_model.lm_head.weight"
        got["mt5_model.embedding.weight"] = got["mt5_model.embedding.weight"] + got.pop(head)
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)
