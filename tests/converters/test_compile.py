"""train.compile: torch.compile per transformer layer trains the eager loss curve, without recompiling.

The default test trains a tiny GPT in this process, compiled (inductor: C++ built with the machine's
compiler) and eager, and compares the losses step for step. The layout tests launch this file as a
torchrun worker (``python -m torch.distributed.run ... tests/converters/test_compile.py OUT LAYOUT``):
the compiled layers under tp=2, pp=2, ZeRO-3 and activation checkpointing give the one-process eager
losses. Both check that nothing compiles after the first step (``error_on_recompile`` from step 2 on,
and dynamo's graph count unchanged). Inductor's cache (``TORCHINDUCTOR_CACHE_DIR``, under the temporary
directory by default) makes every run after the first start in seconds.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile

import pytest
import torch

from libai_lite.converters.compile import CompileOptions, apply_compile, compile_options, compiled_modules_eager
from libai_lite.utils.errors import UsageError
from tests.launch import ROOT

# The GPU paths a CPU can run: CI runs them under the lowest torch setup.py admits too.
pytestmark = pytest.mark.gpu_path

# A fresh inductor cache for each test run (a user's TORCHINDUCTOR_CACHE_DIR is kept): kernels cached
# by earlier runs gave NaN losses when reused, first across ATEN_CPU_CAPABILITY (not part of inductor's
# key), then once more in a cache kept per ISA. A cold compile of these tiny models takes seconds.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import atexit
    import shutil

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchinductor_libai_lite_")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)

CFG = dict(hidden_layers=2, vocab_size=128, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
           max_seq_length=16, embedding_dropout_prob=0.0, attention_dropout_prob=0.0, output_dropout_prob=0.0)
GLOBAL_BATCH, SEQ, STEPS, LR = 4, 16, 4, 0.5
# Inductor fuses and reorders the reductions (layer norm over `hidden`, softmax over keys, the cross
# entropy over `vocab`): each result may move by ~n ulp for a sum of n terms. The widest sum is the
# vocabulary's, and each SGD step carries the difference forward, so STEPS x vocab ulp of the loss.
RTOL = STEPS * CFG["vocab_size"] * torch.finfo(torch.float32).eps

# name -> (processes, train.dist, zero stage, activation checkpointing mode or None[, model cfg changes])
LAYOUTS = {
    "tp2": (2, dict(tensor_parallel_size=2), 0, None),
    "pp2": (2, dict(pipeline_parallel_size=2, pipeline_schedule="gpipe"), 0, None),
    "dp2_zero3_selective_ac": (2, dict(), 3, "selective"),
    "tp2_full_ac": (2, dict(tensor_parallel_size=2), 0, "full"),
    "tp2_selective_ac": (2, dict(tensor_parallel_size=2), 0, "selective"),
    # The unfused head with train.compile.loss: vocab-parallel logits under loss_parallel, into a cross
    # entropy left eager (compiled, it computes losses several percent off).
    "tp2_compiled_loss": (2, dict(tensor_parallel_size=2), 0, None, dict(fused_cross_entropy=False)),
}


def build_model(**cfg):
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    torch.manual_seed(0)
    return GPTForPreTraining({**CFG, **cfg})


def batches():
    """STEPS fixed global batches of (input_ids, labels)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG["vocab_size"], (STEPS, GLOBAL_BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def compile_counts() -> tuple[int, int]:
    """(graphs dynamo built, frames it compiled) so far in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], counters["frames"]["ok"]


def train(step_fn, params, steps=STEPS) -> tuple[list[float], list[tuple[int, int]]]:
    """SGD on the fixed batches; the losses and the compile counts after each step. As in the trainer, the
    first step runs compiled modules eager and the second compiles, so from the third step on a
    recompilation raises (``error_on_recompile``)."""
    import torch._dynamo

    opt = torch.optim.SGD(params, lr=LR)
    curve, counts = [], []
    try:
        for i, (x, y) in enumerate(batches()[:steps]):
            torch._dynamo.config.error_on_recompile = i > 1
            with compiled_modules_eager() if i == 0 else contextlib.nullcontext():
                curve.append(float(step_fn(x, y)))
            opt.step()
            opt.zero_grad()
            counts.append(compile_counts())
    finally:
        torch._dynamo.config.error_on_recompile = False
    return curve, counts


def eager_step(model):
    def step(x, y):
        loss = model(x, labels=y)["lm_loss"]
        loss.backward()
        return loss.detach()
    return step


def test_compiled_layers_train_the_eager_losses_and_compile_once():
    eager = build_model()
    reference, _ = train(eager_step(eager), eager.parameters())
    model = build_model()
    apply_compile(model, CompileOptions(enabled=True))
    curve, counts = train(eager_step(model), model.parameters())
    assert curve == pytest.approx(reference, rel=RTOL, abs=0)
    assert counts[1][0] > counts[0][0], f"not compiled at the second step: {counts}"  # the counters are per process
    assert len(set(counts[1:])) == 1, f"compiled again after step 2: {counts}"
    # Compiled in place: the parameter names and checkpoint keys stay the eager model's.
    assert list(model.state_dict()) == list(eager.state_dict())


def build_llama():
    from projects.Llama.configs.model import cfg
    from projects.Llama.modeling.llama_model import LlamaForPreTraining

    torch.manual_seed(0)
    return LlamaForPreTraining({**cfg, **dict(hidden_layers=2, vocab_size=CFG["vocab_size"], hidden_size=32,
                                              ffn_hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                              max_seq_length=SEQ)})


def build_mt5():
    from projects.MT5 import MT5ForPreTraining

    torch.manual_seed(0)
    return MT5ForPreTraining(dict(vocab_size=CFG["vocab_size"], hidden_size=32, hidden_layers=2,
                                  num_attention_heads=4, head_size=8, intermediate_size=64, embedding_dropout_prob=0.0,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def seq2seq_step(model):
    """MT5: the batch's first half of positions as the decoder's input and labels."""
    def step(x, y):
        loss = model(x, x[:, : SEQ // 2].contiguous(), labels=y[:, : SEQ // 2].contiguous())["lm_loss"]
        loss.backward()
        return loss.detach()
    return step


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "mt5"])
def test_other_models_compile_once_and_train_the_eager_losses(name):
    build, step = {"llama": (build_llama, eager_step), "mt5": (build_mt5, seq2seq_step)}[name]
    eager = build()
    reference, _ = train(step(eager), eager.parameters())
    model = build()
    apply_compile(model, CompileOptions(enabled=True))
    curve, counts = train(step(model), model.parameters())
    assert curve == pytest.approx(reference, rel=RTOL, abs=0)
    assert len(set(counts[1:])) == 1, f"compiled again after step 2: {counts}"


@pytest.mark.slow
def test_compiled_loss_trains_the_eager_losses():
    """``loss=True`` compiles the cross entropy over the logits (the unfused head)."""
    eager = build_model(fused_cross_entropy=False)
    reference, _ = train(eager_step(eager), eager.parameters())
    model = build_model(fused_cross_entropy=False)
    apply_compile(model, CompileOptions(enabled=True, loss=True))
    curve, counts = train(eager_step(model), model.parameters())
    assert curve == pytest.approx(reference, rel=RTOL, abs=0)
    assert len(set(counts[1:])) == 1, f"compiled again after step 2: {counts}"


def test_whole_model_is_compiled_where_nothing_needs_the_layers_apart():
    model = build_model()
    assert apply_compile(model, CompileOptions(enabled=True), whole_model_ok=True) == "model"
    assert model._compiled_call_impl is not None
    assert all(layer._compiled_call_impl is None for layer in model.GPT_model.layers.values())
    model = build_model()
    assert apply_compile(model, CompileOptions(enabled=True, scope="layers"), whole_model_ok=True) == "layers"
    assert model._compiled_call_impl is None
    assert apply_compile(build_model(), CompileOptions(enabled=True)) == "layers"  # e.g. under a pipeline
    with pytest.raises(UsageError, match="train.compile.scope=model needs one data-parallel replica"):
        apply_compile(build_model(), CompileOptions(enabled=True, scope="model"))
    assert apply_compile(build_model(), CompileOptions()) is None


@pytest.mark.parametrize("layout,whole", [
    (dict(), True),
    (dict(pipeline_parallel_size=2), False),
])
def test_parallelize_compiles_the_whole_model_only_where_nothing_needs_the_layers_apart(layout, whole):
    """``parallelize_part``'s choice for train.compile.scope=auto, on a one-rank layout (the others need
    processes: their condition is the same expression)."""
    from types import SimpleNamespace

    from libai_lite.parallel.parallelize import parallelize_part

    stub = SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1, context_parallel_size=1, replica_size=1,
                           offload=False, zero_stage=0, sequence_parallel=False,
                           replica_mesh=SimpleNamespace(size=lambda: 1))
    stub.__dict__.update(layout)
    model = build_model()
    parallelize_part(model, stub, compile=CompileOptions(enabled=True))
    assert (model._compiled_call_impl is not None) == whole
    assert all((layer._compiled_call_impl is not None) != whole for layer in model.GPT_model.layers.values())


def _fullgraph_train(build, whole_model):
    """Three SGD steps of ``build()`` compiled with fullgraph=True (a graph break raises) by aot_eager (the
    traced forward and backward graphs, without inductor's build time); the losses and compile counts."""
    import torch._dynamo

    torch._dynamo.reset()
    model = build()
    apply_compile(model, CompileOptions(enabled=True, backend="aot_eager", fullgraph=True), whole_model_ok=whole_model)
    graphs, frames = compile_counts()  # dynamo's counters are per process
    curve, counts = train(eager_step(model), model.parameters())
    return curve, [(g - graphs, f - frames) for g, f in counts]


@pytest.mark.parametrize("whole_model", [False, True], ids=["layers", "model"])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_dense_models_compile_with_fullgraph_and_never_recompile(name, whole_model):
    build = {"gpt": build_model, "llama": build_llama}[name]
    eager = build()
    reference, _ = train(eager_step(eager), eager.parameters())
    curve, counts = _fullgraph_train(build, whole_model)
    # One graph for the whole model, or one shared by every layer (the same code, the same shapes).
    assert counts[0][0] == 0 and counts[1][0] == 1, counts
    assert len(set(counts[1:])) == 1, f"compiled again after step 2: {counts}"
    # aot_eager runs the eager kernels in the traced order: only the backward's summation order may differ.
    assert curve == pytest.approx(reference, rel=RTOL, abs=0)


def _dense_eager_losses_and_compiled_mt5(step, options: CompileOptions, whole_model_ok: bool) -> tuple:
    """MT5's losses under ``step`` eager on the dense attention path, and a fresh MT5 compiled with ``options``."""
    import torch._dynamo

    from libai_lite.layers.flex_attention import attention_backend

    eager = build_mt5()
    with attention_backend("dense"):
        reference, _ = train(step(eager), eager.parameters())
    torch._dynamo.reset()
    model = build_mt5()
    apply_compile(model, options, whole_model_ok=whole_model_ok)
    return reference, model


def padded_seq2seq_step(model):
    """MT5 as the span-corruption loader feeds it: the second sample's encoder and decoder padded at the end,
    its padded labels ignored."""
    dec = SEQ // 2
    enc_mask = torch.ones(GLOBAL_BATCH, SEQ, dtype=torch.bool)
    enc_mask[1, 11:] = False
    dec_mask = torch.ones(GLOBAL_BATCH, dec, dtype=torch.bool)
    dec_mask[1, 5:] = False

    def step(x, y):
        labels = y[:, :dec].masked_fill(~dec_mask, -100)
        loss = model(x, x[:, :dec].contiguous(), labels, enc_mask, dec_mask, enc_mask)["lm_loss"]
        loss.backward()
        return loss.detach()
    return step


# Torch warns that eager flex is unfused: the first step runs it eager on purpose (the fast paths probe there).
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("whole_model", [False, True], ids=["layers", "model"])
def test_mt5_on_the_flex_path_a_gpu_takes_compiles_with_fullgraph_and_never_recompiles(monkeypatch, whole_model):
    """MT5 on CUDA runs FlexAttention inside the compiled graph: padding block masks, the relative bias
    as a score_mod, the 8-position decoder padded to the 128 tile. Dynamo's ``eager`` backend traces what
    inductor would be given: torch's CPU reference for flex's backward drops the bias gradient from an AOT
    graph's saved tensors, a CPU-only limit. One graph (or one per kind of layer), no break, no recompile."""
    import torch.nn.attention.flex_attention as torch_flex

    from libai_lite.layers import flex_attention as flex_module
    from libai_lite.layers.flex_attention import attention_backend

    monkeypatch.setattr(torch_flex, "_validate_device", lambda *args: None)  # flex backward on the CPU
    # CUDA's branch calls flex through its own torch.compile (_compiled_flex), which dynamo must inline.
    monkeypatch.setattr(flex_module, "flex_attention", torch.compile(flex_module.flex_attention, dynamic=False,
                                                                     backend="eager"))
    reference, model = _dense_eager_losses_and_compiled_mt5(
        padded_seq2seq_step, CompileOptions(enabled=True, backend="eager", fullgraph=True), whole_model)
    with attention_backend("flex"):
        curve, counts = train(padded_seq2seq_step(model), model.parameters())
    # The first step's eager flex calls compile torch's own wrapper; count what the model added from step 2.
    graphs = [g - counts[0][0] for g, _ in counts[1:]]
    # The whole model, or the encoder's and decoder's first layer (they hold the bias table) and the others;
    # and, MT5 training with dropout, the dropout-free graphs its first call is compared with eager through.
    assert graphs[0] == (1 + 1 if whole_model else 4 + 2), counts
    assert len(set(graphs)) == 1, f"compiled again after step 2: {counts}"
    # Flex against SDPA: the same math, summed in another order over SEQ keys.
    assert curve == pytest.approx(reference, rel=RTOL, abs=0)


@pytest.mark.parametrize("cfg,needle", [
    (dict(enabled=True, mode="max-autotune-cudagraphs"), "train.compile.mode='max-autotune-cudagraphs' is not"),
    (dict(enabled=True, scope="stages"), "train.compile.scope='stages' is not a scope; use one of auto, model"),
    (dict(enabled=True, cuda_graphs=True), "train.compile has no key 'cuda_graphs'"),
    (dict(enabled=True, backend="nope"), "train.compile.backend='nope' is not a torch.compile backend"),
])
def test_bad_compile_config_is_one_line(cfg, needle):
    with pytest.raises(UsageError, match=needle.replace("(", r"\(")):
        compile_options(cfg)
    assert compile_options(None) == CompileOptions()
    assert compile_options(dict(enabled=True, mode="reduce-overhead")).mode == "reduce-overhead"


def test_cuda_graphs_with_accumulation_are_refused_where_the_gradients_are_not_the_trainers():
    """reduce-overhead/max-autotune with accumulation: the trainer keeps the gradients out of the graphs'
    memory (tests/parallel/test_fast_path_fallback.py), which it can only do for its own ``.grad``."""
    from libai_lite.converters.compile import check_compile

    graphs, one = CompileOptions(enabled=True, mode="reduce-overhead"), dict(replica_size=1, pipeline_parallel_size=1,
                                                                           offload=False)
    check_compile(graphs, 4, **one)
    check_compile(graphs, 1, **{**one, "replica_size": 2})
    check_compile(CompileOptions(enabled=True, mode="max-autotune-no-cudagraphs"), 4, **{**one, "replica_size": 2})
    check_compile(CompileOptions(enabled=False, mode="reduce-overhead"), 4, **{**one, "replica_size": 2})
    for key, value in (("replica_size", 2), ("pipeline_parallel_size", 2), ("offload", True)):
        with pytest.raises(UsageError, match=r"^train.compile.mode=reduce-overhead \(CUDA graphs\) with 4 accumulation "
                                             r"steps needs one data-parallel replica, no pipeline and no offload .*; "
                                             r"use train.compile.mode=null, or train.num_accumulation_steps=1$"):
            check_compile(graphs, 4, **{**one, key: value})
    with pytest.raises(UsageError, match="use train.compile.mode=max-autotune-no-cudagraphs, or"):
        check_compile(CompileOptions(enabled=True, mode="max-autotune"), 2, **{**one, "pipeline_parallel_size": 2})


# ---------------------------------------------------------------------------------------------- torchrun
def _worker(out: str, name: str) -> None:
    """One torchrun rank: the tiny GPT parallelized as LAYOUTS[name] says, compiled, trained; rank 0 writes
    the losses and compile counts to ``out``."""
    import torch.distributed as dist

    from libai_lite.parallel.parallelize import parallelize_model
    from libai_lite.parallel.tensor_parallel import loss_parallel_context
    from libai_lite.utils.distributed import setup_dist

    _, dist_cfg, zero, ac, *model_cfg = LAYOUTS[name]
    model_cfg = model_cfg[0] if model_cfg else {}
    layout = setup_dist(dist_cfg, dict(enabled=bool(zero), stage=zero))
    pm = parallelize_model(build_model(**model_cfg), layout, n_microbatches=2,
                           activation_checkpoint_every=1 if ac else 0, activation_checkpoint_mode=ac or "full",
                           compile=CompileOptions(enabled=True, loss="fused_cross_entropy" in model_cfg))
    dp, rank = layout.data_parallel_size, layout.dp_rank
    tp = layout.tensor_parallel_size > 1

    def step(x, y):
        per_rank = GLOBAL_BATCH // dp
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        if pm.pipeline is not None:
            args, kwargs, labels = pm.pipeline.split_batch({"input_ids": x, "labels": y})
            return pm.pipeline.step(args, labels, kwargs=kwargs)
        with loss_parallel_context(tp):
            loss = pm.module(x, labels=y)["lm_loss"]
            loss.backward()
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=layout.group("dp"))
        return loss / dp

    curve, counts = train(step, pm.parameters())
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"losses": curve, "counts": counts}, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_process_eager():
    model = build_model()
    return train(eager_step(model), model.parameters())[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layout_matches_one_process(tmp_path, one_process_eager, name):
    from tests.launch import torchrun

    out = tmp_path / "result.json"
    torchrun(LAYOUTS[name][0], "tests/converters/test_compile.py", out, name, timeout=600)
    result = json.loads(out.read_text())
    # The layout's own reductions (tensor-parallel partial sums, data-parallel gradient averages) add to
    # inductor's reordering; both are bounded by the same ulp count.
    assert result["losses"] == pytest.approx(one_process_eager, rel=2 * RTOL, abs=0), name
    counts = [tuple(c) for c in result["counts"]]
    assert counts[0] == (0, 0) and len(set(counts[1:])) == 1, f"{name} not compiled once at step 2: {counts}"


@pytest.mark.slow
def test_train_sh_with_compile_and_selective_ac_matches_eager_one_process(tmp_path):
    """By config alone: tools/train.sh, tp=2, train.compile and selective checkpointing, against
    tools/train_net.py eager on one process."""
    from tests.launch import losses, tiny, train_net, train_sh

    common = ["train.train_iter=3", "train.evaluation.enabled=False", "model.cfg.attention_dropout_prob=0.0",
              "model.cfg.output_dropout_prob=0.0", "tokenization.make_vocab_size_divisible_by=256"]
    r = train_net(tiny(tmp_path / "eager", tmp_path / "cache", *common))
    assert r.returncode == 0, r.stderr[-3000:]
    r = train_sh(2, tiny(tmp_path / "compiled", tmp_path / "cache", *common, "train.dist.tensor_parallel_size=2",
                         "train.compile.enabled=True", "train.activation_checkpoint.enabled=True",
                         "train.activation_checkpoint.mode=selective"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    reference, curve = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert sorted(curve) == sorted(reference) == [1, 2, 3]
    # The demo vocabulary (8192 padded ids) is the widest sum here.
    rtol = 3 * 8192 * torch.finfo(torch.float32).eps
    assert [curve[i] for i in (1, 2, 3)] == pytest.approx([reference[i] for i in (1, 2, 3)], rel=rtol, abs=0)


if __name__ == "__main__":
    from tests.workers import run_and_exit

    run_and_exit(_worker, sys.argv[1], sys.argv[2])


def test_compile_auto_is_on_with_a_gpu_and_off_on_a_cpu_or_a_split_backward_schedule():
    from libai_lite.converters.compile import compile_options

    auto = {"enabled": "auto", "scope": "auto"}
    on = compile_options(auto, cuda=True)
    assert on.enabled and on.automatic
    assert not compile_options(auto, cuda=False).enabled
    assert not compile_options(auto, cuda=True, schedule="interleaved_zero_bubble").enabled
    assert compile_options({"enabled": True}, cuda=False).enabled
    assert not compile_options({"enabled": True}).automatic
    with pytest.raises(UsageError, match=r"train.compile.enabled='yes' is not one of true, false, auto"):
        compile_options({"enabled": "yes"})
    with pytest.raises(UsageError, match="train.compile has no key 'automatic'"):
        compile_options({"automatic": True})


def test_compile_auto_leaves_a_model_without_transformer_layers_eager_and_explicit_compile_refuses_it():
    from libai_lite.converters.compile import apply_compile, compile_options

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert apply_compile(model, compile_options({"enabled": "auto", "scope": "layers"}, cuda=True)) is None
    with pytest.raises(UsageError, match="found no transformer layers"):
        apply_compile(model, compile_options({"enabled": True, "scope": "layers"}))


def test_the_resolved_config_records_what_auto_chose(tmp_path):
    """config.yaml holds true or false, never auto: on this CPU, false (the demo's config.yaml is unchanged)."""
    from libai_lite.config import LazyConfig
    from libai_lite.run_spec import resolve_run
    from libai_lite.utils.parallel_dims import ParallelDims

    cfg = LazyConfig.load(str(ROOT / "projects/GPT/configs/gpt2_pretrain.py"))
    assert cfg.train.compile.enabled == "auto"
    spec = resolve_run(cfg, ParallelDims.resolve(1, cfg.train.dist, cfg.train.get("zero_optimization")), data=False)
    assert spec.compile.enabled is False and spec.compile.automatic
    assert spec.cfg.train.compile.enabled is False


@pytest.mark.parametrize("scope", ["model", "layers"])
def test_a_compiled_mt5_falls_back_from_wrong_flex_gradients_at_its_eager_first_step(monkeypatch, scope):
    """Dynamo traces FlexAttention past its guard, so the first step runs compiled modules eager: there the
    guard compares flex with the dense path, catches a kernel whose gradients are far off (the forward right),
    and the graphs built from the next call on hold the dense path; the losses are the dense eager run's."""
    import logging

    import torch.nn.attention.flex_attention as torch_flex

    from libai_lite.layers import flex_attention as flex_module
    from libai_lite.layers.flex_attention import attention_backend

    from tests.layers.test_flex_attention import _identity_with_backward

    monkeypatch.setattr(torch_flex, "_validate_device", lambda *args: None)
    real_flex, far_off = flex_module.flex_attention, _identity_with_backward(lambda grad: grad * 1e16)
    monkeypatch.setattr(flex_module, "flex_attention", lambda *a, **k: far_off(real_flex(*a, **k)))
    reference, model = _dense_eager_losses_and_compiled_mt5(
        seq2seq_step, CompileOptions(enabled=True, backend="aot_eager", scope=scope), True)
    lines = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    flex_module._flex_or_dense.reset()
    log = logging.getLogger("libai_lite")
    log.addHandler(handler)
    try:
        with attention_backend("flex"):
            curve, counts = train(seq2seq_step(model), model.parameters())
    finally:
        log.removeHandler(handler)
        flex_module._flex_or_dense.reset()
    assert len(lines) == 1 and "FlexAttention" in lines[0] and "MismatchError" in lines[0], lines
    assert counts[1][0] > counts[0][0], f"not compiled at the second step: {counts}"
    assert curve == pytest.approx(reference, rel=RTOL, abs=0)
