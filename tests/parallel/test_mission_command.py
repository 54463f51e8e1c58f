"""The mission's own command, as LiBai's guide writes it: one MT5 recipe on 1, 4 or 8 processes.

``bash tools/train.sh tools/train_net.py projects/MT5/configs/mt5_pretrain.py N`` with no ``train.dist``
override: the data-parallel size follows the launch and a world smaller than the recipe's tensor
parallelism caps it (LiBai's ``_init_parallel_size``). Only model sizes, batch and length keys shrink the
run for a CPU.
"""
import pytest

from tests.launch import losses, one_error_line, train_sh
from libai_lite.utils.parallel_dims import capped_sizes, describe_capping, layout_sizes
from libai_lite.utils.errors import UsageError

RECIPE = "projects/MT5/configs/mt5_pretrain.py"
STEPS = 6
# Model, batch and length only: nothing of train.dist, ZeRO or precision is touched.
SMALL = [
    "model.cfg.hidden_layers=2", "model.cfg.hidden_size=64", "model.cfg.num_attention_heads=4",
    "model.cfg.head_size=16", "model.cfg.intermediate_size=128", "dataloader.train.max_seq_length=64",
    "dataloader.train.num_workers=0", "train.train_micro_batch_size=2", "train.num_accumulation_steps=1",
    "train.train_epoch=0", f"train.train_iter={STEPS}", "train.log_period=1", "train.evaluation.enabled=False",
    "train.checkpointer.period=1000", "optim.lr=1e-3",
]


def dist(**kw) -> dict:
    return {"data_parallel_size": None, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
            "context_parallel_size": 1, **kw}


@pytest.mark.parametrize("world,cfg,expected", [
    # The recipe (tp 2, dp left to the launch) on 1, 2, 4 and 8 processes: (pp, dp, cp, tp).
    (1, dist(tensor_parallel_size=2), (1, 1, 1, 1)),
    (2, dist(tensor_parallel_size=2), (1, 1, 1, 2)),
    (4, dist(tensor_parallel_size=2), (1, 2, 1, 2)),
    (8, dist(tensor_parallel_size=2), (1, 4, 1, 2)),
    # Tensor first, then pipeline takes what remains.
    (4, dist(tensor_parallel_size=2, pipeline_parallel_size=4), (2, 1, 1, 2)),
    (2, dist(tensor_parallel_size=4, pipeline_parallel_size=2), (1, 1, 1, 2)),
    (8, dist(tensor_parallel_size=2, pipeline_parallel_size=4), (4, 1, 1, 2)),
    # Context parallelism is never capped (it is chosen for a sequence length): it must fit as given.
    (8, dist(tensor_parallel_size=2, context_parallel_size=2), (1, 2, 2, 2)),
])
def test_layout_follows_the_launch(world, cfg, expected):
    assert layout_sizes(world, cfg) == expected


def test_capping_is_announced_with_both_sizes():
    assert describe_capping(4, dist(tensor_parallel_size=2)) is None
    line = describe_capping(1, dist(tensor_parallel_size=2, pipeline_parallel_size=2))
    assert "tensor_parallel_size 2 -> 1" in line and "pipeline_parallel_size 2 -> 1" in line
    assert "1 launched process" in line and "strict_layout" in line
    assert capped_sizes(8, {"tensor_parallel_size": 2, "pipeline_parallel_size": 8}) == \
        {"tensor_parallel_size": 2, "pipeline_parallel_size": 4}


@pytest.mark.parametrize("world,cfg,needle", [
    # Asking for a refusal instead of capping.
    (1, dist(tensor_parallel_size=2, strict_layout=True),
     "asks for tensor_parallel_size(2) = 2 processes but 1 were launched"),
    # An explicit data-parallel size must still fit the world.
    (8, dist(tensor_parallel_size=2, data_parallel_size=2), "launch 4 processes or set train.dist.data_parallel_size=4"),
    (1, dist(tensor_parallel_size=2, data_parallel_size=2), "does not match the world size 1"),
    # Context parallelism larger than the world is refused, not capped.
    (1, dist(context_parallel_size=2), "world size 1 is not divisible by pipeline_parallel_size(1) x "
                                       "context_parallel_size(2) x tensor_parallel_size(1)"),
    # A tensor size that fits but does not divide the world.
    (6, dist(tensor_parallel_size=4), "world size 6 is not divisible by pipeline_parallel_size(1) x tensor_parallel_size(4)"),
])
def test_layouts_that_cannot_fit_are_refused(world, cfg, needle):
    with pytest.raises(UsageError) as e:
        layout_sizes(world, cfg)
    assert needle in str(e.value)


def run_recipe(tmp_path, nproc, *extra):
    out = tmp_path / f"out{nproc}"
    r = train_sh(nproc, [f"train.output_dir={out}", f"dataloader.train.cache_dir={tmp_path / 'cache'}", *SMALL, *extra],
                 config=RECIPE, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    # Nothing from torch's internals a user cannot act on (DTensor's per-dimension reductions, FSDP2's views).
    assert "sequential all_reduce" not in r.stderr and "returned a view tensor" not in r.stderr, r.stderr[-4000:]
    return out, (out / "log.txt").read_text()


def assert_trains(out):
    curve = losses(out)
    assert sorted(curve) == list(range(1, STEPS + 1))
    assert curve[STEPS] < curve[1], curve


def test_mission_command_on_one_process(tmp_path):
    out, log = run_recipe(tmp_path, 1)
    assert "train.dist: tensor_parallel_size 2 -> 1 to fit the 1 launched process(es)" in log
    assert "layout pp=1 dp=1 tp=1" in log and "global batch 2 = micro 2 x dp 1 x accumulation 1" in log
    # The start-up memory estimate traces the model with fake tensors first: nothing of it may stay behind.
    assert "Memory estimate per rank" in log
    assert_trains(out)
    # config.yaml records what ran in its header, and keeps the layout asked for (a rerun derives its own).
    text = (out / "config.yaml").read_text()
    assert text.startswith("# Launched on 1 process(es): layout pp=1 dp=1 tp=1") and "tensor_parallel_size: 2" in text


# Eight processes on a 2-core machine with -m slow; four take the same launch-derived dp x tp path by default.
@pytest.mark.slow
def test_mission_command_on_eight_processes(tmp_path):
    out, log = run_recipe(tmp_path, 8)
    assert "layout pp=1 dp=4 tp=2" in log and "global batch 8 = micro 2 x dp 4 x accumulation 1" in log
    assert "train.dist:" not in log
    assert_trains(out)


def test_mission_command_on_four_processes_keeps_dp2_tp2(tmp_path):
    out, log = run_recipe(tmp_path, 4)
    assert "layout pp=1 dp=2 tp=2" in log and "train.dist:" not in log
    assert_trains(out)


@pytest.mark.slow
def test_four_processes_train_the_curve_of_the_explicit_dp2_config(tmp_path):
    """The recipe before this change said data_parallel_size=2; the launch-derived layout is the same run."""
    out, _ = run_recipe(tmp_path, 4)
    explicit = tmp_path / "explicit"
    explicit.mkdir()
    before, _ = run_recipe(explicit, 4, "train.dist.data_parallel_size=2")
    assert losses(out) == losses(before)


def test_strict_layout_refuses_in_one_line(tmp_path):
    out = tmp_path / "out"
    r = train_sh(1, [f"train.output_dir={out}", f"dataloader.train.cache_dir={tmp_path / 'cache'}", *SMALL,
                     "train.dist.strict_layout=True"], config=RECIPE, timeout=300)
    assert r.returncode != 0
    assert "train.dist.strict_layout=True" in one_error_line(r)
    assert not out.exists()
