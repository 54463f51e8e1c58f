"""Several ranks on one GPU (pytest -m gpu; skipped without CUDA): two processes launched by
tools/train.sh with train.dist.backend=gloo share cuda:0, so the multi-rank code paths run with CUDA
tensors on a machine that has one GPU (NCCL refuses two ranks on one device).

gloo carries allreduce, broadcast and allgather of CUDA tensors by staging them through pinned host
memory, and reduce-scatter as an allreduce: tensor parallelism, DDP and ZeRO-1/2/3 run. Its send/recv
hands gloo the tensor's memory as it is (host memory only), so a pipeline over gloo on CUDA is
refused at start-up in one line (libai_lite.utils.distributed.check_backend_layout).
"""
import shutil

import pytest
import torch

from tests.launch import losses, one_error_line, tiny, train_sh
from tests.gpu.test_cuda import NO_DROPOUT, RTOL_LATER, run

pytestmark = [
    pytest.mark.gpu,
    # Two-rank launches, several each: bench/gpu.sh runs them after the quick GPU suite (gpu_tests_slow).
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m gpu on a GPU machine)"),
]

GLOO = "train.dist.backend=gloo"
COMMON = ["train.evaluation.enabled=False", *NO_DROPOUT]
LAYOUTS = {
    "tp2": ["train.dist.tensor_parallel_size=2"],
    "dp2": [],
    "dp2_zero1": ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=1"],
    "dp2_zero3": ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=3"],
}


def _two_ranks(args, timeout=600):
    r = train_sh(2, args + [GLOO], timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same 6 steps in one process on the GPU: the losses every layout must give."""
    tmp = tmp_path_factory.mktemp("one")
    run(tiny(tmp / "out", tmp / "cache", "train.train_iter=6", *COMMON))
    return losses(tmp / "out")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_on_one_gpu_match_one_process(tmp_path, layout, one_process):
    out = tmp_path / "out"
    _two_ranks(tiny(out, tmp_path / "cache", "train.train_iter=6", *COMMON, *LAYOUTS[layout]))
    # Both ranks on the one device (local rank 1 modulo one GPU).
    assert "Rank 0 of 2" in (out / "log.txt").read_text() and "on cuda:0" in (out / "log.txt").read_text()
    assert "on cuda:0" in (out / "log.txt.rank1").read_text()
    got = losses(out)
    for i in range(1, 7):
        assert got[i] == pytest.approx(one_process[i], rel=RTOL_LATER), (layout, i, got, one_process)


def test_checkpoint_saved_under_tp2_resumes_under_zero3(tmp_path):
    """Resharding with CUDA tensors: 4 steps under tp=2, steps 5-6 under dp=2 with ZeRO-3 agree with the
    same steps resumed in one process."""
    base = tmp_path / "base"
    _two_ranks(tiny(base, tmp_path / "cache", "train.train_iter=4", *COMMON, *LAYOUTS["tp2"]))
    one, zero3 = tmp_path / "one", tmp_path / "zero3"
    shutil.copytree(base, one)
    shutil.copytree(base, zero3)
    run(tiny(one, tmp_path / "cache", "train.train_iter=6", *COMMON), resume=True)
    _two_ranks(tiny(zero3, tmp_path / "cache", "train.train_iter=6", *COMMON, *LAYOUTS["dp2_zero3"]) + ["--resume"])
    assert "Starting training from iteration 4 to 6" in (zero3 / "log.txt").read_text()
    ref, got = losses(one), losses(zero3)
    for i in (5, 6):
        assert got[i] == pytest.approx(ref[i], rel=RTOL_LATER), (i, ref, got)


def test_pipeline_over_gloo_on_cuda_is_refused_in_one_line(tmp_path):
    out = tmp_path / "out"
    r = train_sh(2, tiny(out, tmp_path / "cache", "train.train_iter=2", "train.dist.pipeline_parallel_size=2", GLOO),
                 timeout=300)
    assert r.returncode == 1
    assert one_error_line(r).startswith("error: train.dist.backend='gloo' cannot carry the pipeline's send/recv")
