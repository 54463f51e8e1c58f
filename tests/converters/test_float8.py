"""train.fp8: torchao's float8 linears where FP8 GEMMs run (a GPU of compute capability 8.9+), refused elsewhere.

On the CPU the conversion itself is checked (which layers, the size filter, compilation, the float8
all-gather config, names and checkpoints unchanged) and the loss is compared with the high-precision
one on the CUDA device when there is one, else on the CPU (torch's CPU float8 GEMM computes what the
tensor cores do, slowly). The training runs need a device and carry the ``gpu`` marker.
"""
import json
import subprocess

import pytest
import torch

from libai_lite.converters.float8 import (
    Float8Options,
    apply_float8,
    check_float8,
    float8_after_optimizer_step,
    float8_options,
    fp8_eligible,
    large_enough,
)
from libai_lite.utils.errors import UsageError
from tests.launch import ROOT, env, tiny, train_cmd, train_net, tree_snapshot

# The GPU paths a CPU can run: CI runs them under the lowest torch setup.py admits too.
pytestmark = pytest.mark.gpu_path

torchao = pytest.importorskip("torchao", reason="train.fp8 needs torchao: pip install -e .[fp8]")

# The FP8 GEMM on a GPU when there is one: a CPU-built model on a GPU machine ran torch's CPU float8
# GEMM, which the device's torch (2.11) lacks for rowwise scales.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALL = dict(enabled=True, filter="all")  # the tiny model's linears are far below FP8's break-even size
TINY = dict(hidden_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, max_seq_length=32,
            vocab_size=512, embedding_dropout_prob=0.0, attention_dropout_prob=0.0, output_dropout_prob=0.0)


def _gpt(device="cpu"):
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    torch.manual_seed(0)
    return GPTForPreTraining(TINY).to(device)


def test_the_linears_of_every_layer_but_the_head_become_float8_with_their_names():
    from torchao.float8.float8_linear import Float8Linear

    model = _gpt()
    names = set(model.state_dict())
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert apply_float8(model, Float8Options(**ALL), compile_backend=None) == len(linears) - 1
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {n for n in linears if "lm_head" not in n}
    # Parameter names stay: checkpoints move between FP8 and bf16 runs.
    assert set(model.state_dict()) == names


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_loss_and_gradients_stay_close_to_high_precision(recipe):
    ref, fp8 = _gpt(DEVICE), _gpt(DEVICE)
    apply_float8(fp8, Float8Options(**ALL, recipe=recipe), compile_backend=None)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (4, 33), generator=g).to(DEVICE)
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
    with pytest.raises(UsageError, match="train.fp8.filter='big' is not a filter; use auto"):
        float8_options({"filter": "big"})
    with pytest.raises(UsageError, match="train.fp8 has no key 'scaling'"):
        float8_options({"scaling": "rowwise"})
    check_float8(Float8Options(), torch.device("cpu"), 2)  # off: nothing to check


def test_fp8_on_a_cpu_is_refused_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    before = tree_snapshot(tmp_path)
    # No GPU visible, also on a GPU machine (where the run would otherwise train on it).
    r = subprocess.run(train_cmd(tiny(out, tmp_path / "cache", "train.train_iter=2", "train.fp8.enabled=True")),
                       cwd=ROOT, env=env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "error: train.fp8.enabled=True needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9 or newer: "
        "Ada, Hopper, Blackwell); this run is on cpu: turn train.fp8 off"), r.stderr[-2000:]
    assert not out.exists() and tree_snapshot(tmp_path) == before


def test_only_linears_large_enough_to_gain_are_converted():
    # torchao's H100 table: 1024 x 2048 x 1024 (K=2048 -> N=1024) is slower in float8; GPT-2 345M's
    # attention output (1024 -> 1024) and MLP output (4096 -> 1024) too; its QKV and MLP input gain.
    assert not large_enough("tensorwise", 2048, 1024)
    assert not large_enough("tensorwise", 1024, 1024) and not large_enough("tensorwise", 4096, 1024)
    assert large_enough("tensorwise", 1024, 3072) and large_enough("tensorwise", 1024, 4096)
    assert large_enough("tensorwise", 8192, 2048)  # GPT 1.3B's MLP output
    assert not large_enough("rowwise", 1024, 4096) and large_enough("rowwise", 4096, 8192)
    with torch.device("meta"):
        model = torch.nn.ModuleDict({"small": torch.nn.Linear(2048, 1024), "big": torch.nn.Linear(1024, 4096),
                                     "odd": torch.nn.Linear(1000, 4096), "lm_head": torch.nn.Linear(4096, 8192)})
    auto, every = Float8Options(enabled=True), Float8Options(**ALL)
    assert [n for n, m in model.items() if fp8_eligible(n, m, auto)] == ["big"]
    assert [n for n, m in model.items() if fp8_eligible(n, m, every)] == ["small", "big"]
    assert apply_float8(model, auto, compile_backend=None) == 1
    assert type(model["big"]).__name__ == "Float8Linear" and type(model["small"]) is torch.nn.Linear


def test_converted_linears_are_compiled_unless_their_layers_are():
    """Each float8 linear is called through its fallback guard (tests/parallel/test_fast_path_fallback.py),
    which calls the linear compiled on its own, or as it is when train.compile compiles its layer."""
    model = _gpt()
    apply_float8(model, Float8Options(**ALL), compile_backend="eager")
    converted = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    assert converted and all(m._compiled_call_impl is not None and m._libai_lite_float8 is not None for m in converted)
    model = _gpt()
    apply_float8(model, Float8Options(**ALL), compile_backend=None)  # train.compile compiles their layers
    converted = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
    assert converted and all(m._compiled_call_impl is not None and m._libai_lite_float8 is None for m in converted)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_zero_shards_gather_float8_weights_for_the_tensorwise_recipe(recipe):
    model = _gpt()
    apply_float8(model, Float8Options(**ALL, recipe=recipe), compile_backend=None, fsdp=True)
    configs = {m.config.enable_fsdp_float8_all_gather for m in model.modules() if type(m).__name__ == "Float8Linear"}
    assert configs == {recipe == "tensorwise"}  # torchao's float8 all-gather is tensorwise only


def test_scales_are_precomputed_after_the_optimizer_step_under_fsdp(tmp_path):
    """One-process FSDP2 (gloo): the step hook is installed for float8-gathered weights only, and runs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        plain = _gpt()
        assert not float8_after_optimizer_step(torch.optim.SGD(plain.parameters(), lr=0.1), plain)
        model = _gpt()
        apply_float8(model, Float8Options(**ALL), compile_backend=None, fsdp=True)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        assert float8_after_optimizer_step(opt, model)
        linear = next(m for m in model.modules() if type(m).__name__ == "Float8Linear")
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        scale = linear.weight._local_tensor._precomputed_scale
        amax = linear.weight.detach().full_tensor().abs().max()
        assert scale is not None and float(scale) == pytest.approx(float(torch.finfo(torch.float8_e4m3fn).max / amax),
                                                                    rel=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 training needs an NVIDIA GPU of compute capability 8.9+ (H100)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_training_on_a_gpu_follows_the_bf16_curve(tmp_path, recipe):
    runs = {}
    for name, extra in {"bf16": [], "fp8": ["train.fp8.enabled=True", f"train.fp8.recipe={recipe}",
                                                               "train.fp8.filter=all"]}.items():
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
