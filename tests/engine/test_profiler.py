"""train.profile: torch.profiler Chrome traces of the chosen steps under OUTPUT_DIR/profile/ (issue 25)."""
import json

import pytest
import torch

from tests.launch import one_error_line, tiny, train_net


def _step_labels(path) -> list:
    """The ProfilerStep#N names in a Chrome trace file, sorted by N."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    steps = {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
    return sorted(steps, key=lambda s: int(s.split("#")[1]))


def _loop(tmp_path, start: int, end: int, device: str = "cpu", **profile):
    """A trainer whose step is one small matmul, with only the profiler hook; returns the hook."""
    from libai_lite.engine.profiler import ProfilerHook
    from libai_lite.engine.trainer import TrainerBase
    from libai_lite.run_sections import ProfileSettings

    class Loop(TrainerBase):
        def run_step(self):
            torch.mm(torch.ones(8, 8, device=device), torch.ones(8, 8, device=device))

    hook = ProfilerHook(str(tmp_path), torch.device(device), ProfileSettings(**profile))
    loop = Loop()
    loop.register_hooks([hook])
    loop.train(start, end)
    return hook


def test_the_chosen_steps_are_traced_with_the_run_iteration_numbers_once_per_cycle(tmp_path):
    # A resumed run (from iteration 100): wait 2, warm up 1, trace 2, twice.
    hook = _loop(tmp_path, 100, 115, wait=2, warmup=1, active=2, repeat=2)
    files = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert files == ["trace_iter0000104_rank0.json", "trace_iter0000109_rank0.json"]
    assert _step_labels(tmp_path / "profile" / files[0]) == ["ProfilerStep#103", "ProfilerStep#104"]
    assert _step_labels(tmp_path / "profile" / files[1]) == ["ProfilerStep#108", "ProfilerStep#109"]
    # Both cycles written: the profiler is stopped for the rest of the run.
    assert hook._profiler is None and hook.done == 2


def test_a_run_ending_inside_the_window_writes_what_it_traced(tmp_path):
    _loop(tmp_path, 0, 3, wait=1, warmup=0, active=5)
    [trace] = (tmp_path / "profile").iterdir()
    assert trace.name == "trace_iter0000002_rank0.json"
    assert _step_labels(trace) == ["ProfilerStep#1", "ProfilerStep#2"]


def test_a_memory_snapshot_on_the_cpu_is_refused_in_one_line(tmp_path):
    from libai_lite.engine.profiler import ProfilerHook
    from libai_lite.run_sections import ProfileSettings
    from libai_lite.utils.errors import UsageError

    with pytest.raises(UsageError, match=r"^train\.profile\.memory_snapshot=True records the CUDA allocator, and "
                                         r"this run trains on cpu: set train\.profile\.memory_snapshot=False"):
        ProfilerHook(str(tmp_path), torch.device("cpu"), ProfileSettings(memory_snapshot=True))


@pytest.mark.parametrize("key, value", [("active", 0), ("wait", -1), ("repeat", 0)])
def test_schedule_keys_out_of_range_are_refused(key, value):
    from omegaconf import OmegaConf

    from libai_lite.run_sections import check_settings
    from libai_lite.utils.errors import UsageError

    with pytest.raises(UsageError, match=rf"^train\.profile\.{key}={value} is out of range"):
        check_settings(OmegaConf.create({"train": {"profile": {key: value}}}))


def test_training_with_train_profile_writes_a_trace_of_the_chosen_steps_and_without_it_none(tmp_path):
    args = ["train.evaluation.enabled=False", "train.checkpointer.period=0", "train.train_iter=4"]
    r = train_net(tiny(tmp_path / "off", tmp_path / "cache", *args))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (tmp_path / "off" / "profile").exists()

    r = train_net(tiny(tmp_path / "on", tmp_path / "cache", *args, "train.profile.enabled=True",
                       "train.profile.wait=1", "train.profile.warmup=1", "train.profile.active=2"))
    assert r.returncode == 0, r.stderr[-3000:]
    [trace] = (tmp_path / "on" / "profile").iterdir()
    assert trace.name == "trace_iter0000003_rank0.json"
    assert _step_labels(trace) == ["ProfilerStep#2", "ProfilerStep#3"]
    with open(trace) as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    # The model's own work is in it: a traced training step, not an empty window.
    assert {"aten::mm", "aten::addmm"} & names and any("Optimizer.step" in str(n) for n in names)


@pytest.mark.slow
def test_a_memory_snapshot_requested_on_the_cpu_stops_the_run_in_one_line(tmp_path):
    r = train_net(tiny(tmp_path / "run", tmp_path / "cache", "train.evaluation.enabled=False", "train.train_iter=2",
                       "train.profile.enabled=True", "train.profile.memory_snapshot=True"))
    assert r.returncode != 0
    assert one_error_line(r).startswith("error: train.profile.memory_snapshot=True records the CUDA allocator")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_allocator_history_of_the_traced_steps_is_dumped_beside_the_trace(tmp_path):
    import pickle

    _loop(tmp_path, 0, 4, device="cuda", wait=1, warmup=0, active=2, memory_snapshot=True)
    files = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert files == ["memory_snapshot_iter0000002_rank0.pickle", "trace_iter0000002_rank0.json"]
    with open(tmp_path / "profile" / files[0], "rb") as f:
        snapshot = pickle.load(f)
    # The steps' allocations are in the history, and recording stopped with the window.
    assert any(e.get("action") == "alloc" for trace in snapshot["device_traces"] for e in trace)
    assert not torch.cuda.memory._snapshot()["device_traces"] or not any(torch.cuda.memory._snapshot()["device_traces"])
