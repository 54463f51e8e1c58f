"""Zero-bubble pipeline schedules (interleaved zero bubble, ZBV, DualPipeV) against 1F1B.

One `torchrun --nproc_per_node 2 tests/workers/pp_worker.py` launch (gloo, CPU) runs the tiny GPT's
step under 1F1B and under each new schedule; each must give 1F1B's loss and every gradient (and,
with a GradScaler, the scaled ones), the tied embedding / LM head included: under ZBV and DualPipeV
both copies sit on rank 0 (a V: rank r holds stages r and 2*pp-1-r).
"""
from pathlib import Path

import pytest
import torch

from libai_lite.parallel.pipeline import check_schedule
from libai_lite.parallel.pipeline_split import local_stage_ids, stage_ranks
from libai_lite.utils.parallel_dims import layer_stages
from libai_lite.utils.errors import UsageError
from tests.launch import torchrun

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "pp_worker.py"
EMB = "GPT_model.embeddings.token_embeddings.weight"
HEAD = "GPT_model.lm_head.weight"

CFG = dict(
    hidden_layers=4, vocab_size=128, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2,
    max_seq_length=16, embedding_dropout_prob=0.0, attention_dropout_prob=0.0, output_dropout_prob=0.0,
)
# 4 micro-batches: DualPipeV needs at least as many as its 2 * pp = 4 stages.
ACC = 4
SEED, LR, WD, MAX_NORM = 1234, 1e-2, 0.01, 0.05
# An initial loss scale so large that the first fp16 steps overflow and are skipped.
FP16_STEPS, FP16_SCALE = 6, 2.0 ** 20
# (schedule, virtual stages per rank, the layers each of the 2 ranks holds)
NEW = [
    ("interleaved_zero_bubble", 1, [[0, 1], [2, 3]]),
    ("interleaved_zero_bubble", 2, [[0, 2], [1, 3]]),
    ("zbv_zero_bubble", 2, [[0, 3], [1, 2]]),
    ("dualpipev", 2, [[0, 3], [1, 2]]),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """What each rank wrote for 1F1B and every new schedule, all from one launch."""
    work = tmp_path_factory.mktemp("pp_schedules")
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, CFG["vocab_size"], (2 * ACC, 16), generator=g)
    labels = torch.randint(0, CFG["vocab_size"], (2 * ACC, 16), generator=g)
    labels[0, :9] = -100  # unequal micro-batch token counts: the mean of means is not the token mean
    torch.save({"cfg": CFG, "seed": SEED, "input_ids": ids, "labels": labels, "n_microbatches": ACC, "lr": LR,
                "weight_decay": WD, "max_norm": MAX_NORM, "fp16_steps": FP16_STEPS, "fp16_init_scale": FP16_SCALE},
               work / "data.pt")
    schedules = [("1f1b", 1)] + [(s, v) for s, v, _ in NEW]
    torchrun(2, WORKER, work, ",".join(s for s, _ in schedules), ",".join(str(v) for _, v in schedules),
             "grads,fp16", timeout=180)
    out = {"data": (ids, labels)}
    for s, v in schedules:
        for phase in ("grads", "fp16"):
            out[(s, v, phase)] = [torch.load(work / f"{s}_v{v}_{phase}_rank{r}.pt", weights_only=True)
                                  for r in range(2)]
    return out


def _by_name(ranks, key):
    out = {}
    for res in ranks:
        out.update(res[key])
    return out


@pytest.mark.parametrize("schedule,virtual,layers", NEW, ids=[f"{s}_v{v}" for s, v, _ in NEW])
def test_zero_bubble_schedule_matches_1f1b(runs, schedule, virtual, layers):
    base, got = runs[("1f1b", 1, "grads")], runs[(schedule, virtual, "grads")]
    assert [r["layers"] for r in got] == layers
    # The same micro-batch losses, averaged alike; every rank reports the last stage's number.
    assert got[0]["loss"] == got[1]["loss"] == base[0]["loss"]
    # Zero-bubble schedules split each backward into an input-gradient and a weight-gradient pass; in
    # fp32 the weight gradient of a micro-batch is the same sum of products either way, so what
    # can differ is the order in which micro-batch contributions (and, for the tied weight, its two
    # copies) are added: at most ACC + 1 roundings of eps32 relative to the summed magnitude.
    tol = (ACC + 1) * torch.finfo(torch.float32).eps
    for key in ("grads", "scaled_grads"):
        want, have = _by_name(base, key), _by_name(got, key)
        assert set(have) == set(want), set(have) ^ set(want)
        for name, g in have.items():
            err = float((g - want[name]).abs().max())
            assert err <= tol * float(want[name].abs().max()), (key, name, err)
    assert got[0]["norm"] == pytest.approx(base[0]["norm"], rel=tol) and got[1]["norm"] == got[0]["norm"]
    # Both tied copies hold the whole tied gradient (on one rank under a V, on two otherwise).
    owners = [next(r for r, res in enumerate(got) if name in res["grads"]) for name in (EMB, HEAD)]
    assert owners == ([0, 0] if schedule in ("zbv_zero_bubble", "dualpipev") else [0, 1])
    torch.testing.assert_close(got[owners[0]]["grads"][EMB], got[owners[1]]["grads"][HEAD], rtol=0, atol=0)


# ------------------------------------------------------------------------ one process


def test_v_shape_placement_is_torchs():
    assert [local_stage_ids(r, 4, 2, "zbv_zero_bubble") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [local_stage_ids(r, 4, 2, "DualPipeV") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [local_stage_ids(r, 4, 2, "interleaved_zero_bubble") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert stage_ranks(2, 4, "zbv_zero_bubble") == [0, 1, 1, 0] and stage_ranks(2, 4) == [0, 1, 0, 1]


@pytest.mark.parametrize(
    "schedule,num_stages,pp,n_mb,match",
    [
        ("zbv_zero_bubble", 2, 2, 4, r"'zbv_zero_bubble' runs exactly 2 stages per pipeline rank .*got 1; "
                                     r"set train.dist.virtual_pipeline_size=2"),
        ("dualpipev", 12, 4, 8, "got 3; set train.dist.virtual_pipeline_size=2"),
        ("dualpipev", 8, 4, 7, r"'dualpipev' needs n_microbatches \(7\) >= the number of stages \(8\)"),
        ("interleaved_zero_bubble", 8, 4, 9, r"'interleaved_zero_bubble' needs n_microbatches \(9\) to be a multiple"),
        ("1f1b", 4, 2, 4, "use 'interleaved_1f1b' or 'interleaved_zero_bubble' for virtual stages"),
    ],
)
def test_bad_zero_bubble_settings_are_usage_errors(schedule, num_stages, pp, n_mb, match):
    with pytest.raises(UsageError, match=match):
        check_schedule(schedule, num_stages, pp, n_mb)


def test_zbv_with_too_few_layers_for_2pp_stages_is_a_usage_error():
    # pp=4 under ZBV is 8 stages: a 6-layer model cannot fill them.
    assert check_schedule("ZBV_zero_bubble", 8, 4, 8) == "zbv_zero_bubble"
    with pytest.raises(UsageError, match="more stages than the model's 6 layers; use at most 6 pipeline stages"):
        layer_stages(6, 8)


def test_good_zero_bubble_settings_pass():
    assert check_schedule("interleaved_zero_bubble", 2, 2, 4) == "interleaved_zero_bubble"
    assert check_schedule("interleaved_zero_bubble", 8, 4, 8) == "interleaved_zero_bubble"
    assert check_schedule("zbv_zero_bubble", 4, 2, 1) == "zbv_zero_bubble"
    assert check_schedule("dualpipev", 8, 4, 8) == "dualpipev"


def _fp16_one_process(ids, labels):
    """The eager trainer's fp16 steps on one process: autocast, scaled micro-batch losses / ACC,
    unscale, clip, scaler step and update."""
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    torch.manual_seed(SEED)
    model = GPTForPreTraining(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    scaler = torch.amp.GradScaler("cpu", init_scale=FP16_SCALE, growth_interval=1000)
    losses, norms, scales = [], [], []
    for _ in range(FP16_STEPS):
        total = 0.0
        for mb_ids, mb_labels in zip(ids.chunk(ACC), labels.chunk(ACC)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(mb_ids, labels=mb_labels)["lm_loss"]
            scaler.scale(loss / ACC).backward()
            total += float(loss.detach()) / ACC
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        scales.append(float(scaler.get_scale()))
    return losses, norms, scales


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1)] + [(s, v) for s, v, _ in NEW],
                         ids=["1f1b_v1"] + [f"{s}_v{v}" for s, v, _ in NEW])
def test_fp16_loss_scaling_under_pp2_matches_one_process(runs, schedule, virtual):
    """fp16 with dynamic loss scaling through the pipeline: the same overflow-skipped steps and loss
    scales as one process, then the same losses within fp16 rounding."""
    losses, norms, scales = _fp16_one_process(*runs["data"])
    skipped = [i for i in range(1, FP16_STEPS) if scales[i] < scales[i - 1]] + ([0] if scales[0] < FP16_SCALE else [])
    assert skipped and len(skipped) < FP16_STEPS - 2, f"the test needs skipped and taken steps: scales {scales}"
    for res in runs[(schedule, virtual, "fp16")]:
        assert res["scales"] == scales
        # Each layer computes in fp16 either way; what differs is fp32 summation order, carried
        # through a few AdamW steps: well inside one fp16 rounding (2**-11 relative).
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(losses), rtol=2.0 ** -11, atol=0)
        taken = [i for i in range(FP16_STEPS) if i not in skipped]
        torch.testing.assert_close(torch.tensor(res["norms"])[taken], torch.tensor(norms)[taken], rtol=2.0 ** -11,
                                   atol=0)


# ------------------------------------------------------------------ through tools/train_net.py and train.sh

FP16 = ["train.amp.enabled=True", "train.amp.dtype=fp16"]


def _metrics(out) -> dict:
    import json

    rows = {}
    with open(out / "metrics.json") as f:
        for line in f:
            row = json.loads(line)
            if "total_loss" in row:
                rows[row["iteration"]] = row
    return rows


@pytest.mark.slow
def test_trainer_fp16_zbv_pp2_matches_one_process_fp16(tmp_path):
    """The lifted refusal end to end: fp16 loss scaling under pp=2 with the ZBV schedule (a V of 4 stages,
    both tied copies on rank 0) logs the one-process fp16 run's losses and loss scales."""
    from tests.launch import tiny, train_net, train_sh
    from tests.parallel.test_parallel_e2e import COMMON

    ref = train_net(tiny(tmp_path / "ref", tmp_path / "cache", *COMMON, *FP16))
    assert ref.returncode == 0, ref.stderr[-3000:]
    r = train_sh(2, tiny(tmp_path / "pp", tmp_path / "cache", *COMMON, *FP16, "train.dist.pipeline_parallel_size=2",
                         "train.dist.pipeline_schedule=zbv_zero_bubble", "train.dist.virtual_pipeline_size=2"))
    assert r.returncode == 0, r.stderr[-4000:]
    want, got = _metrics(tmp_path / "ref"), _metrics(tmp_path / "pp")
    assert sorted(got) == sorted(want) and len(want) >= 10
    for it, row in want.items():
        assert got[it]["loss_scale"] == row["loss_scale"] and got[it]["skipped"] == row["skipped"], it
        # fp16 layers either way; fp32 summation order differs: well inside one fp16 rounding.
        assert got[it]["total_loss"] == pytest.approx(row["total_loss"], rel=2.0 ** -11), it


# With -m slow: two runs; the tied copies' checkpoint entries are checked by default in
# tests/checkpoint/test_checkpoint_integrity.py (a pipelined tied head resuming at its own layout).
@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_under_zbv_with_the_one_process_losses(tmp_path):
    """One process holds the tied embedding / LM head as one parameter and saves its optimizer state once;
    under ZBV rank 0 holds both copies, and the copy's state is filled from the embedding's at load."""
    import shutil

    from tests.launch import tiny, train_net, train_sh
    from tests.parallel.test_parallel_e2e import COMMON

    common = [*COMMON, "train.train_iter=4", "train.checkpointer.period=2"]
    ref = train_net(tiny(tmp_path / "one", tmp_path / "cache", *common))
    assert ref.returncode == 0, ref.stderr[-3000:]
    shutil.copytree(tmp_path / "one", tmp_path / "zbv")
    (tmp_path / "zbv" / "last_checkpoint").write_text("model_0000001\n")
    (tmp_path / "zbv" / "metrics.json").unlink()
    r = train_sh(2, tiny(tmp_path / "zbv", tmp_path / "cache", *common, "--resume",
                         "train.dist.pipeline_parallel_size=2", "train.dist.pipeline_schedule=zbv_zero_bubble",
                         "train.dist.virtual_pipeline_size=2"))
    assert r.returncode == 0, r.stderr[-4000:]
    want, got = _metrics(tmp_path / "one"), _metrics(tmp_path / "zbv")
    assert sorted(got) == [3, 4]
    for it in got:
        assert got[it]["total_loss"] == pytest.approx(want[it]["total_loss"], rel=2e-5), it


@pytest.mark.slow
def test_trainer_zero1_dp2_pp2_matches_dp2_pp2_without_zero(tmp_path):
    """The lifted ZeRO-1 refusal: optimizer state sharded over dp under pp=2 (stages under FSDP2 replicate,
    DTensor parameters broadcast by their local tensors) trains the unsharded run's curve."""
    from tests.launch import tiny, train_sh
    from tests.parallel.test_parallel_e2e import COMMON

    curves = {}
    for name, extra in (("zero0", []), ("zero1", ["train.zero_optimization.enabled=True",
                                                  "train.zero_optimization.stage=1"])):
        r = train_sh(4, tiny(tmp_path / name, tmp_path / "cache", *COMMON, "train.dist.pipeline_parallel_size=2",
                             *extra))
        assert r.returncode == 0, r.stderr[-4000:]
        curves[name] = {it: row["total_loss"] for it, row in _metrics(tmp_path / name).items()}
    assert sorted(curves["zero1"]) == sorted(curves["zero0"]) and len(curves["zero0"]) >= 10
    # The same AdamW arithmetic per element; only which dp rank does it differs.
    for it, loss in curves["zero0"].items():
        assert curves["zero1"][it] == pytest.approx(loss, rel=1e-6), it


def test_config_validation_accepts_every_schedule():
    from libai_lite.run_sections import RANGES
    from libai_lite.parallel.pipeline import SCHEDULES

    assert set(RANGES["train.dist.pipeline_schedule"].values) == set(SCHEDULES)


def test_zero_bubble_over_compiled_layers_is_a_usage_error():
    from libai_lite.parallel.pipeline import check_split_backward

    in_place = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    in_place[1].compile(backend="eager")  # how libai_lite.converters.compile compiles a layer
    wrapped = torch.nn.Sequential(torch.compile(torch.nn.Linear(2, 2), backend="eager"))
    for schedule in ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"):
        for stage in (in_place, wrapped):
            with pytest.raises(UsageError, match=f"schedule '{schedule}' splits each backward .* torch.compile'd "
                                                 f"layers cannot run; set train.compile.enabled=False"):
                check_split_backward(schedule, [torch.nn.Linear(2, 2), stage])
        check_split_backward(schedule, [torch.nn.Linear(2, 2)])
    check_split_backward("1f1b", [in_place])
    check_split_backward("interleaved_1f1b", [wrapped])


@pytest.mark.slow
def test_trainer_moe_gpt_under_zbv_logs_the_one_process_curve(tmp_path):
    """MoE layers back-propagate their auxiliary loss themselves; through ZBV's split backward (and the
    V, two stages per rank) the losses, MoE statistics and gradient norm stay the one-process ones."""
    from tests.launch import train_net, train_sh
    from tests.layers.test_moe import GPT_MOE, PIPELINE_KEYS, _metrics as moe_metrics, _tiny_gpt_moe

    common = ["train.train_iter=3", "model.cfg.moe.every_n_layers=1", "model.cfg.attention_dropout_prob=0.0",
              "model.cfg.output_dropout_prob=0.0", "model.cfg.hidden_layers=4", "train.num_accumulation_steps=4",
              "train.global_batch_size=32"]
    r = train_net(_tiny_gpt_moe(tmp_path / "one", tmp_path / "cache", *common), config=GPT_MOE)
    assert r.returncode == 0, r.stderr[-4000:]
    r = train_sh(2, _tiny_gpt_moe(tmp_path / "zbv", tmp_path / "cache", *common, "train.dist.pipeline_parallel_size=2",
                                  "train.dist.pipeline_schedule=zbv_zero_bubble", "train.dist.virtual_pipeline_size=2"),
                 config=GPT_MOE)
    assert r.returncode == 0, r.stderr[-4000:]
    got, want = moe_metrics(tmp_path / "zbv"), moe_metrics(tmp_path / "one")
    assert len(got) == len(want) == 3
    for step, (g, w) in enumerate(zip(got, want)):
        for key in PIPELINE_KEYS:
            # fp32; the same per-micro-batch arithmetic, summed in another order (as test_moe's pipeline test).
            assert g[key] == pytest.approx(w[key], rel=2e-5, abs=2e-5), (step, key)
