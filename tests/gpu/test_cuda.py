"""One process on a CUDA GPU (pytest -m gpu; skipped without one): the demo in bf16 and in fp16 with
loss scaling, CPU and GPU losses of one tiny config, checkpoints crossing devices both ways, ZeRO-3 with
CPU offload keeping parameters and optimizer state off the device, generation and evaluation on cuda.

Every run is the tiny demo config (tests.launch.tiny) launched as a user does; a CPU run hides the GPU
with CUDA_VISIBLE_DEVICES="" (what bench/gpu.sh's resume step does too).
"""
import math
import re
import shutil
import subprocess
import sys

import pytest
import torch

from tests.launch import CONFIG, ROOT, env, losses, tiny, train_cmd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m gpu on a GPU machine)"),
]

# Dropout off: CPU and CUDA draw different masks from their own generators, and the comparisons
# below are about arithmetic, not sampling.
NO_DROPOUT = ["model.cfg.attention_dropout_prob=0.0", "model.cfg.output_dropout_prob=0.0",
              "model.cfg.embedding_dropout_prob=0.0"]
# fp32 on both devices (TF32 is off for matmuls by default): one forward over identical weights and
# data differs only by reduction order, ~1e-6 relative on a mean of a few hundred log-probabilities;
# after optimizer steps the differences grow through Adam's normalised updates (a gradient component
# near zero can change sign), so later steps get 1e-3.
RTOL_FIRST, RTOL_LATER = 1e-5, 1e-3


def run(args, cpu: bool = False, timeout: int = 600, resume: bool = False) -> subprocess.CompletedProcess:
    """tools/train_net.py with ``args`` on the GPU, or on the CPU with the GPU hidden."""
    extra = {"CUDA_VISIBLE_DEVICES": ""} if cpu else {}
    r = subprocess.run(train_cmd(args + (["--resume"] if resume else [])), cwd=ROOT, env=env(**extra),
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


def _log(out) -> str:
    return (out / "log.txt").read_text()


@pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp16", marks=pytest.mark.slow)])
def test_demo_trains_on_cuda(tmp_path, dtype):
    """30 steps of the tiny demo under autocast on cuda:0: the loss falls; fp16 carries a loss scale."""
    out = tmp_path / "out"
    run(tiny(out, tmp_path / "cache", "train.train_iter=30", "train.evaluation.enabled=False",
             "train.amp.enabled=True", f"train.amp.dtype={dtype}"))
    assert "on cuda:0" in _log(out)
    curve = losses(out)
    assert len(curve) == 30 and all(math.isfinite(v) for v in curve.values()), curve
    # On the CPU the same 30 steps go from 8.98 to 7.6-7.8 (fp16 autocast, measured): a drop of 0.5 is
    # far outside what a run that does not learn shows.
    last = sum(curve[i] for i in range(26, 31)) / 5
    assert last < curve[1] - 0.5, curve
    scales = losses(out, "loss_scale") if dtype == "fp16" else {}
    if dtype == "fp16":
        assert scales and all(v > 0 and math.isfinite(v) for v in scales.values()), scales


@pytest.mark.slow  # two runs; the quick GPU suite is tests/gpu/test_recipes.py and the kernels' tests
def test_cpu_and_gpu_losses_agree(tmp_path):
    """Same weights (built on the CPU from the seed, then moved), same data: fp32 losses within tolerance."""
    args = ["train.train_iter=5", "train.evaluation.enabled=False", *NO_DROPOUT]
    run(tiny(tmp_path / "gpu", tmp_path / "cache_gpu", *args))
    run(tiny(tmp_path / "cpu", tmp_path / "cache_cpu", *args), cpu=True)
    gpu, cpu = losses(tmp_path / "gpu"), losses(tmp_path / "cpu")
    assert "on cpu" in _log(tmp_path / "cpu") and "on cuda:0" in _log(tmp_path / "gpu")
    assert gpu[1] == pytest.approx(cpu[1], rel=RTOL_FIRST)
    for i in range(2, 6):
        assert gpu[i] == pytest.approx(cpu[i], rel=RTOL_LATER), (i, gpu, cpu)


@pytest.mark.slow  # four runs; bench/gpu.sh's demo_gpu and resume_cpu steps cross devices one way
@pytest.mark.parametrize("first", ["gpu", "cpu"])
def test_checkpoint_resumes_on_the_other_device(tmp_path, first):
    """4 steps on one device, then steps 5-6 resumed on the same device (reference) and on the other:
    the resumed losses agree, so weights, Adam's moments, the step count and the data position crossed."""
    args = ["train.evaluation.enabled=False", "train.checkpointer.period=2", *NO_DROPOUT]
    base = tmp_path / "base"
    run(tiny(base, tmp_path / "cache", "train.train_iter=4", *args), cpu=first == "cpu")
    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(base, same)
    shutil.copytree(base, other)
    run(tiny(same, tmp_path / "cache", "train.train_iter=6", *args), cpu=first == "cpu", resume=True)
    run(tiny(other, tmp_path / "cache", "train.train_iter=6", *args), cpu=first != "cpu", resume=True)
    # Resumed, not started afresh (a missing checkpoint only warns): the trainer starts after step 4.
    assert "Starting training from iteration 4 to 6" in _log(other), _log(other)[-2000:]
    ref, got = losses(same), losses(other)
    for i in (5, 6):
        assert got[i] == pytest.approx(ref[i], rel=RTOL_LATER), (i, ref, got)


def test_zero3_offload_keeps_parameters_and_optimizer_state_off_the_device():
    """FSDP2 with CPUOffloadPolicy at dp=1: after a step the sharded parameters, their gradients and
    AdamW's moments live on the CPU; what stays allocated on the GPU is far below one copy of the
    parameters (without offload it is at least parameters + two moments)."""
    from libai_lite.parallel.data_parallel import apply_data_parallel
    from libai_lite.utils import distributed
    from projects.GPT.modeling.gpt_model import GPTForPreTraining
    from tests.workers.dp_worker import CFG, OPTIM, batches

    cfg = {"backend": None, "timeout": 60}
    layout = distributed.setup_dist(cfg)
    try:
        assert layout.device.type == "cuda"
        # cuBLAS's workspace (up to 32 MiB on Hopper) goes through the caching allocator and stays: made
        # here, before the baseline, so only what the model leaves on the device is compared.
        warm = torch.ones(256, 256, device=layout.device, requires_grad=True)
        (warm @ warm).sum().backward()
        del warm
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        # Large enough (3.7M parameters, 15 MB) that FSDP's few small resident buffers are not mistaken
        # for parameters left on the device.
        torch.manual_seed(0)
        model = GPTForPreTraining({**CFG, "vocab_size": 8192, "hidden_size": 256, "ffn_hidden_size": 1024})
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model = apply_data_parallel(model, layout.mesh["dp"], 3, offload=True)
        opt = torch.optim.AdamW(model.parameters(), **OPTIM)
        for x, y in batches(2):
            model(x.to(layout.device), y.to(layout.device))["lm_loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        for p in model.parameters():
            assert p.to_local().device.type == "cpu", p.device
        states = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        assert states and all((t.to_local() if hasattr(t, "to_local") else t).device.type == "cpu" for t in states)
        left = torch.cuda.memory_allocated() - baseline
        assert left < param_bytes / 4, (left, param_bytes)
    finally:
        distributed.destroy()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny demo checkpoint trained on the GPU (6 steps), for generation and evaluation."""
    tmp = tmp_path_factory.mktemp("trained")
    out = tmp / "out"
    run(tiny(out, tmp / "cache", "train.train_iter=6", "train.evaluation.enabled=False", *NO_DROPOUT))
    return out


MODEL_SHAPE = [a for a in tiny("x", "y") if a.startswith("model.cfg.")]


def test_generation_on_cuda_matches_the_cpu(trained):
    """Greedy continuations of one prompt from the GPU checkpoint: the same ids on cuda and on the CPU."""
    tool = [sys.executable, "tools/generate.py", "--config-file", CONFIG, "--checkpoint", str(trained / "model_final"),
            "--prompt-ids", "464 318", "--max-new-tokens", "8", "--show-ids", *MODEL_SHAPE]
    runs = {}
    for device in ("cuda", "cpu"):
        r = subprocess.run(tool + ["--device", device], cwd=ROOT, env=env(), capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[device] = [line for line in r.stdout.splitlines() if re.match(r"ids \d+:", line)]
    assert runs["cuda"] and runs["cuda"] == runs["cpu"], runs


def test_evaluation_on_cuda_matches_the_cpu(trained, tmp_path):
    """--eval-only of the GPU checkpoint on cuda and on the CPU: the same perplexities (fp32)."""
    numbers = {}
    for device in ("gpu", "cpu"):
        r = run(tiny(tmp_path / device, tmp_path / "cache", f"train.load_weight={trained / 'model_final'}",
                     *NO_DROPOUT) + ["--eval-only"], cpu=device == "cpu")
        line = next(line for line in (r.stdout + r.stderr).splitlines() if "Evaluation results" in line)
        numbers[device] = [float(v) for v in re.findall(r"\d+\.\d+(?:e[-+]?\d+)?", line.split("Evaluation results")[1])]
    assert numbers["gpu"], numbers
    assert numbers["gpu"] == pytest.approx(numbers["cpu"], rel=RTOL_LATER)
