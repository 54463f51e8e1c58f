"""The GPU-facing settings that the CPU can check: train.dist.backend and MFU's peak (issue 24)."""
import pytest
import torch
import torch.distributed as dist

from libai_lite.config import LazyConfig
from libai_lite.run_sections import check_settings
from libai_lite.utils import distributed
from libai_lite.utils.errors import UsageError
from libai_lite.utils.flops import device_peak_flops, gpu_peak_tflops
from tests.launch import CONFIG, ROOT, one_error_line, tiny, train_net


def _cfg(*overrides):
    cfg = LazyConfig.load(str(ROOT / CONFIG))
    LazyConfig.apply_overrides(cfg, list(overrides))
    check_settings(cfg)
    return cfg


def test_gloo_backend_is_accepted_and_used(monkeypatch):
    """backend="gloo" passes the range check and is the backend of the world setup_dist builds."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    cfg = _cfg("train.dist.backend=gloo")
    assert not dist.is_initialized()
    try:
        layout = distributed.setup_dist(cfg.train.dist)
        assert dist.get_backend() == "gloo"
        assert layout.device == torch.device("cpu")
    finally:
        distributed.destroy()


def test_default_backend():
    assert distributed.default_backend(None) == ("nccl" if torch.cuda.is_available() else "gloo")
    assert distributed.default_backend("gloo") == "gloo"
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="train.dist.backend='nccl' needs a CUDA device"):
            distributed.default_backend("nccl")


@pytest.mark.parametrize("name", ["mpi", "bogus", "NCCL"])
def test_unknown_backend_is_refused_in_one_line(name):
    """The range table refuses it where the config enters; default_backend refuses it where it is used."""
    with pytest.raises(UsageError, match=rf"train.dist.backend='{name}' is not allowed: it must be one of None, "
                                         r"'nccl', 'gloo'"):
        _cfg(f"train.dist.backend={name}")
    with pytest.raises(UsageError, match=rf"train.dist.backend='{name}' is not supported: use 'nccl'"):
        distributed.default_backend(name)


def test_bogus_backend_through_train_net_is_one_error_line(tmp_path):
    r = train_net(tiny(tmp_path / "out", tmp_path / "cache", "train.train_iter=1", "train.dist.backend=bogus"),
                  timeout=120)
    assert r.returncode != 0
    assert one_error_line(r).startswith("error: train.dist.backend='bogus' is not allowed"), r.stderr[-2000:]
    assert not (tmp_path / "out").exists()


# torch.cuda.get_device_name strings as the cards report them -> (bf16, tf32, fp32) TFLOP/s.
NAMES = {
    "NVIDIA H100 80GB HBM3": (989.4, 494.7, 67.0),
    "NVIDIA H100 PCIe": (756.0, 378.0, 51.0),
    "NVIDIA H100 NVL": (835.5, 417.5, 60.0),
    "NVIDIA H200": (989.4, 494.7, 67.0),
    "NVIDIA H200 NVL": (835.5, 417.5, 60.0),
    "NVIDIA GH200 480GB": (989.4, 494.7, 67.0),
    "NVIDIA B200": (2250.0, 1125.0, 75.0),
    "NVIDIA A100-SXM4-80GB": (312.0, 156.0, 19.5),
    "NVIDIA A100 80GB PCIe": (312.0, 156.0, 19.5),
    "NVIDIA A10": (125.0, 62.5, 31.2),
    "NVIDIA L40S": (362.05, 183.0, 91.6),
    "NVIDIA L40": (181.05, 90.5, 90.5),
    "NVIDIA L4": (121.0, 60.0, 30.3),
    "NVIDIA GeForce RTX 4090": (165.2, 82.6, 82.6),
    "NVIDIA RTX 6000 Ada Generation": (364.25, 182.1, 91.1),
    "Tesla V100-SXM2-32GB": (125.0, 15.7, 15.7),
}


@pytest.mark.parametrize("name", list(NAMES))
def test_peak_from_device_name(name):
    """A variant is not read as its family (H100 PCIe is not the SXM part, L4 is not L40, A10 not A100)."""
    assert tuple(gpu_peak_tflops(name, p) for p in ("bf16", "tf32", "fp32")) == NAMES[name]


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA GeForce GTX 1080", "AMD Radeon", ""])
def test_unlisted_gpu_has_no_peak(name):
    assert gpu_peak_tflops(name, "bf16") is None


def test_peak_tflops_override_and_range():
    """train.peak_tflops wins over the table (and gives the CPU an MFU); zero or negative is refused."""
    assert device_peak_flops(torch.device("cpu"), True) is None
    assert device_peak_flops(torch.device("cpu"), True, 100) == 100e12
    assert _cfg("train.peak_tflops=400").train.peak_tflops == 400
    with pytest.raises(UsageError, match=r"train.peak_tflops=0 is out of range: it must be a finite number > 0, or null"):
        _cfg("train.peak_tflops=0")


def test_trainer_logs_mfu_against_peak_tflops(tmp_path):
    """On the CPU (no table entry) the override alone makes the log line carry MFU."""
    out = tmp_path / "out"
    r = train_net(tiny(out, tmp_path / "cache", "train.train_iter=2", "train.evaluation.enabled=False",
                       "train.peak_tflops=0.5"), timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (out / "log.txt").read_text()
    assert "MFU: " in log, log[-2000:]


def test_pipeline_over_gloo_is_refused_only_on_cuda(monkeypatch):
    """gloo's send/recv takes host memory: pp > 1 with gloo is refused where ranks hold CUDA tensors and
    allowed on the CPU (where the pipeline tests run over gloo)."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    distributed.check_backend_layout(2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    distributed.check_backend_layout(1)
    with pytest.raises(UsageError, match=r"train.dist.backend='gloo' cannot carry the pipeline's send/recv of CUDA "
                                         r"tensors \(pipeline_parallel_size=2\): use backend nccl"):
        distributed.check_backend_layout(2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    distributed.check_backend_layout(2)


def test_more_ranks_than_gpus_under_nccl_is_refused_before_init(monkeypatch):
    """Two local ranks on one GPU with NCCL would fail at the first collective (duplicate GPU); the
    launch is refused in one line that names gloo, before any process group exists."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for key, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)
    with pytest.raises(UsageError, match=r"^2 processes per node but 1 visible GPU\(s\): NCCL needs a GPU per rank; "
                                         r".* train.dist.backend=gloo"):
        distributed._init_process_group(60, "nccl")
    assert not dist.is_initialized()
