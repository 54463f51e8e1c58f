"""train.fp8: torchao's float8 linears where FP8 GEMMs run (a GPU of compute capability 8.9+), refused elsewhere.

On the CPU the conversion itself is checked (which layers, names and checkpoints unchanged, the loss
close to the high-precision one: torch's CPU float8 GEMM computes what the tensor cores do, slowly);
the training run against bf16 needs a device and is skipped without one.
"""
import json

import pytest
import torch

from libai_lite.parallel.float8 import Float8Options, apply_float8, check_float8, float8_options
from libai_lite.utils.errors import UsageError
from tests.launch import tiny, train_net, tree_snapshot

torchao = pytest.importorskip("torchao", reason="train.fp8 needs torchao: pip install -e .[fp8]")

TINY = dict(hidden_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, max_seq_length=32,
            vocab_size=512, embedding_dropout_prob=0.0, attention_dropout_prob=0.0, output_dropout_prob=0.0)


def _gpt():
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    torch.manual_seed(0)
    return GPTForPreTraining(TINY)


def test_the_linears_of_every_layer_but_the_head_become_float8_with_their_names():
    from torchao.float8.float8_linear import Float8Linear

    model = _gpt()
    names = set(model.state_dict())
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert apply_float8(model, Float8Options(enabled=True)) == len(linears) - 1
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {n for n in linears if "lm_head" not in n}
    # Parameter names stay: checkpoints move between FP8 and bf16 runs.
    assert set(model.state_dict()) == names


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_loss_and_gradients_stay_close_to_high_precision(recipe):
    ref, fp8 = _gpt(), _gpt()
    apply_float8(fp8, Float8Options(enabled=True, recipe=recipe))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (4, 33), generator=g)
    batch = dict(input_ids=ids[:, :-1], labels=ids[:, 1:])
    losses = []
    for model in (ref, fp8):
        loss = model(**batch)["lm_loss"]
        loss.backward()
        losses.append(loss.item())
    # e4m3 keeps 3 mantissa bits (a 2^-4 relative step) for activations and weights; over a
    # 2-layer model the per-token losses average that out to well under 1%.
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    w_ref = dict(ref.named_parameters())
    for name, p in fp8.named_parameters():
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), w_ref[name].grad.flatten(), dim=0)
        assert cos > 0.95, (name, float(cos))  # e5m2 gradients: 2 mantissa bits


def test_options_are_checked():
    assert float8_options(None) == Float8Options()
    assert float8_options({"enabled": True, "skip": "head"}).skip == ("head",)
    with pytest.raises(UsageError, match="train.fp8.recipe='mxfp4' is not a float8 recipe; use one of "
                                         "tensorwise, rowwise"):
        float8_options({"recipe": "mxfp4"})
    with pytest.raises(UsageError, match="train.fp8 has no key 'scaling'"):
        float8_options({"scaling": "rowwise"})
    check_float8(Float8Options(), torch.device("cpu"), 2)  # off: nothing to check


def test_fp8_on_a_cpu_is_refused_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    before = tree_snapshot(tmp_path)
    r = train_net(tiny(out, tmp_path / "cache", "train.train_iter=2", "train.fp8.enabled=True"))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "error: train.fp8.enabled=True needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9 or newer: "
        "Ada, Hopper, Blackwell); this run is on cpu: turn train.fp8 off"), r.stderr[-2000:]
    assert not out.exists() and tree_snapshot(tmp_path) == before


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 training needs an NVIDIA GPU of compute capability 8.9+ (H100)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_training_on_a_gpu_follows_the_bf16_curve(tmp_path, recipe):
    runs = {}
    for name, extra in {"bf16": [], "fp8": ["train.fp8.enabled=True", f"train.fp8.recipe={recipe}"]}.items():
        out = tmp_path / name
        r = train_net(tiny(out, tmp_path / "cache", "train.train_iter=20", "train.amp.enabled=True",
                           "train.amp.dtype=bf16", "model.cfg.hidden_size=128", "model.cfg.ffn_hidden_size=512",
                           "train.evaluation.enabled=False", *extra))
        assert r.returncode == 0, r.stderr[-3000:]
        rows = [json.loads(line) for line in (out / "metrics.json").read_text().splitlines()]
        runs[name] = [row["total_loss"] for row in rows if "total_loss" in row]
    assert len(runs["fp8"]) == len(runs["bf16"]) > 10
    for a, b in zip(runs["fp8"], runs["bf16"]):
        assert a == pytest.approx(b, rel=3e-2)
