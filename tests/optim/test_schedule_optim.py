"""Learning-rate schedules, optimizer parameter groups and batch-size reconciliation."""

import pytest
import torch
from omegaconf import OmegaConf

from libai_lite.run_spec import batch_sizes
from libai_lite.optim import get_default_optimizer_params
from libai_lite.scheduler import (
    WarmupConstantLR,
    WarmupCosineLR,
    WarmupExponentialLR,
    WarmupLinearLR,
    WarmupPolynomialLR,
)
from libai_lite.utils.errors import UsageError


def _opt(lr=1.0):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _lrs(sched, n):
    out = []
    for _ in range(n):
        out.append(sched.optimizer.param_groups[0]["lr"])
        sched.optimizer.step()
        sched.step()
    return out


def test_cosine_warmup_then_decay_to_floor():
    lrs = _lrs(WarmupCosineLR(_opt(), max_iter=110, warmup_factor=0.0, warmup_iter=10, alpha=0.1), 111)
    assert lrs[0] == pytest.approx(0.0)
    assert lrs[5] == pytest.approx(0.5)
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5)
    assert lrs[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


@pytest.mark.parametrize(
    "make,end",
    [
        (lambda o: WarmupLinearLR(o, 100, warmup_iter=0, min_lr_ratio=0.2), 0.2),
        (lambda o: WarmupPolynomialLR(o, 100, warmup_iter=0, end_learning_rate=0.05, power=2.0), 0.05),
        (lambda o: WarmupExponentialLR(o, 100, gamma=0.5, warmup_iter=0, min_lr_ratio=0.01), 0.01),
        (lambda o: WarmupConstantLR(o, 100, warmup_iter=0), 1.0),
    ],
)
def test_decays_reach_their_floor(make, end):
    lrs = _lrs(make(_opt()), 101)
    assert lrs[0] == pytest.approx(1.0)
    assert lrs[100] == pytest.approx(end)
    assert min(lrs) >= end - 1e-12


def test_scheduler_state_resumes_exactly():
    a = WarmupCosineLR(_opt(), 50, warmup_iter=5, alpha=0.0)
    full = _lrs(a, 30)
    b = WarmupCosineLR(_opt(), 50, warmup_iter=5, alpha=0.0)
    _lrs(b, 12)
    state = b.state_dict()
    c = WarmupCosineLR(_opt(), 50, warmup_iter=5, alpha=0.0)
    c.load_state_dict(state)
    for g in c.optimizer.param_groups:
        g["lr"] = c.get_last_lr()[0]
    assert _lrs(c, 18) == pytest.approx(full[12:])


def test_a_resumed_schedule_takes_this_runs_lr_length_and_floor_and_the_checkpoints_position():
    """`--resume optim.lr=... train.train_iter=...`: the lr at k is a fresh run of the new config's lr at k."""
    from libai_lite.scheduler.lr_scheduler import restore_scheduler

    old = WarmupLinearLR(_opt(1.0), 40, warmup_iter=4, min_lr_ratio=0.1)
    _lrs(old, 12)
    fresh = WarmupLinearLR(_opt(0.5), 60, warmup_iter=4, min_lr_ratio=0.2)
    expected = _lrs(fresh, 30)[12:]
    resumed = WarmupLinearLR(_opt(0.5), 60, warmup_iter=4, min_lr_ratio=0.2)
    changed = restore_scheduler(resumed, old.state_dict())
    assert changed["base_lrs"] == ([1.0], [0.5]) and changed["max_iter"] == (40, 60)
    assert resumed.last_epoch == 12
    assert _lrs(resumed, 18) == pytest.approx(expected)
    # The same config: nothing changes and the position is the checkpoint's.
    same = WarmupLinearLR(_opt(1.0), 40, warmup_iter=4, min_lr_ratio=0.1)
    assert restore_scheduler(same, old.state_dict()) == {}
    assert same.last_epoch == 12


def test_no_weight_decay_on_bias_and_norm_and_shared_params_once():
    emb = torch.nn.Embedding(10, 4)
    model = torch.nn.Sequential(emb, torch.nn.LayerNorm(4), torch.nn.Linear(4, 10))
    model[2].weight = emb.weight  # tied
    groups = get_default_optimizer_params(model, weight_decay_norm=0.0, weight_decay_bias=0.0)
    by_id = {id(p): g for g in groups for p in g["params"]}
    assert len(by_id) == sum(len(g["params"]) for g in groups) == 4
    assert "weight_decay" not in by_id[id(emb.weight)]
    assert by_id[id(model[1].weight)]["weight_decay"] == 0.0
    assert by_id[id(model[1].bias)]["weight_decay"] == 0.0
    assert by_id[id(model[2].bias)]["weight_decay"] == 0.0


@pytest.mark.parametrize(
    "given,dp,expect",
    [
        (dict(train_micro_batch_size=4, global_batch_size=None, num_accumulation_steps=None), 2, (4, 8, 1)),
        (dict(train_micro_batch_size=4, global_batch_size=32, num_accumulation_steps=None), 2, (4, 32, 4)),
        (dict(train_micro_batch_size=None, global_batch_size=32, num_accumulation_steps=2), 4, (4, 32, 2)),
        (dict(train_micro_batch_size=2, global_batch_size=None, num_accumulation_steps=3), 1, (2, 6, 3)),
    ],
)
def test_batch_sizes_any_two_determine_the_third(given, dp, expect):
    assert batch_sizes(OmegaConf.create(given), dp) == expect


@pytest.mark.parametrize(
    "given,dp,needle",
    [
        (dict(train_micro_batch_size=4, global_batch_size=30, num_accumulation_steps=None), 2, "not divisible"),
        (dict(train_micro_batch_size=4, global_batch_size=32, num_accumulation_steps=3), 2, "!="),
        (dict(train_micro_batch_size=None, global_batch_size=30, num_accumulation_steps=4), 2, "not divisible"),
    ],
)
def test_inconsistent_batch_sizes_are_refused(given, dp, needle):
    with pytest.raises(UsageError, match=needle):
        batch_sizes(OmegaConf.create(given), dp)
