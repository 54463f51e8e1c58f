"""optim.params.decoupled_lr / decoupled_min_lr: the embedding and output layer on their own peak and floor."""
import math

import pytest
import torch
from torch import nn

from libai_lite.optim import get_default_optimizer_params
from libai_lite.scheduler import MegatronLR, WarmupCosineLR, WarmupExponentialLR, WarmupLinearLR
from libai_lite.utils.errors import UsageError
from tests.launch import losses, tiny, train_net, train_sh


class _TinyLM(nn.Module):
    def __init__(self, tied=False):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def embedding_parameters(self):
        return [self.embed.weight, self.head.weight]


def _groups(model=None, **kw):
    model = model or _TinyLM()
    return model, get_default_optimizer_params(model, **kw)


def _run(sched, n):
    """Per iteration, the lr of every param group."""
    out = []
    for _ in range(n):
        out.append([g["lr"] for g in sched.optimizer.param_groups])
        sched.optimizer.step()
        sched.step()
    return out


def test_embedding_and_output_layer_get_groups_of_their_own_last():
    model, groups = _groups(decoupled_lr=0.5, decoupled_min_lr=0.05)
    special = [g for g in groups if g.get("decoupled")]
    assert groups[-1] is special[0] and len(special) == 1
    assert {id(p) for p in special[0]["params"]} == {id(model.embed.weight), id(model.head.weight)}
    assert special[0]["lr"] == 0.5 and special[0]["min_lr"] == 0.05
    assert all("lr" not in g for g in groups[:-1])
    # Every parameter exactly once; a tied head is the embedding, once.
    assert sorted(id(p) for g in groups for p in g["params"]) == sorted(id(p) for p in model.parameters())
    tied, groups = _groups(_TinyLM(tied=True), decoupled_lr=0.5)
    assert [len(g["params"]) for g in groups if g.get("decoupled")] == [1]
    assert "min_lr" not in groups[-1]


def test_off_by_default_the_groups_are_unchanged():
    _, groups = _groups()
    assert not any(g.get("decoupled") or "lr" in g for g in groups)


@pytest.mark.parametrize("make,floor", [
    (lambda o: WarmupCosineLR(o, 110, warmup_factor=0.0, warmup_iter=10, alpha=0.1), 0.1),
    (lambda o: WarmupLinearLR(o, 110, warmup_factor=0.0, warmup_iter=10, min_lr_ratio=0.1), 0.1),
    (lambda o: WarmupExponentialLR(o, 110, gamma=0.5, warmup_factor=0.0, warmup_iter=10, min_lr_ratio=0.1), 0.1),
    (lambda o: MegatronLR(o, 110, decay="cosine", min_lr_ratio=0.1, warmup_iters=10), 0.1),
])
def test_decoupled_groups_peak_at_their_lr_and_decay_to_their_floor(make, floor):
    _, groups = _groups(decoupled_lr=0.5, decoupled_min_lr=0.02)
    lrs = _run(make(torch.optim.SGD(groups, lr=1.0)), 111)
    rest, special = [row[0] for row in lrs], [row[-1] for row in lrs]
    assert rest[10] == pytest.approx(1.0) and special[10] == pytest.approx(0.5)
    assert rest[110] == pytest.approx(floor) and special[110] == pytest.approx(0.02)
    assert special[5] == pytest.approx(0.25)  # the same warmup shape
    assert all(a >= b - 1e-12 for a, b in zip(special[10:], special[11:]))


def test_without_a_min_lr_the_decoupled_floor_is_the_schedules_ratio():
    _, groups = _groups(decoupled_lr=0.5)
    lrs = _run(WarmupCosineLR(torch.optim.SGD(groups, lr=1.0), 20, warmup_iter=0, alpha=0.1), 21)
    assert lrs[20][0] == pytest.approx(0.1) and lrs[20][-1] == pytest.approx(0.05)


def test_a_resumed_scheduler_takes_this_runs_floor():
    _, groups = _groups(decoupled_lr=0.5, decoupled_min_lr=0.02)
    old = WarmupCosineLR(torch.optim.SGD(groups, lr=1.0), 20, warmup_iter=0)
    _run(old, 10)
    from libai_lite.scheduler.lr_scheduler import restore_scheduler

    _, groups = _groups(decoupled_lr=0.5, decoupled_min_lr=0.1)
    new = WarmupCosineLR(torch.optim.SGD(groups, lr=1.0), 20, warmup_iter=0)
    assert "min_lrs" in restore_scheduler(new, old.state_dict())
    assert new.optimizer.param_groups[-1]["lr"] == pytest.approx(0.1 + 0.4 * 0.5 * (1 + math.cos(math.pi / 2)))


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(UsageError, match="does not name its embedding"):
        get_default_optimizer_params(nn.Linear(2, 2), decoupled_lr=0.1)
    with pytest.raises(UsageError, match="without optim.params.decoupled_lr"):
        get_default_optimizer_params(_TinyLM(), decoupled_min_lr=0.1)
    with pytest.raises(UsageError, match="above optim.params.decoupled_lr"):
        get_default_optimizer_params(_TinyLM(), decoupled_lr=0.1, decoupled_min_lr=0.2)


DECOUPLED = ["optim.lr=1e-3", "optim.params.decoupled_lr=4e-3", "optim.params.decoupled_min_lr=2e-4",
             "train.warmup_ratio=0.5", "train.scheduler.alpha=0.1"]


def test_a_run_trains_the_embedding_and_head_at_decoupled_lr_and_resume_keeps_it(tmp_path):
    cache = tmp_path / "cache"
    full, part = tmp_path / "full", tmp_path / "part"
    r = train_net(tiny(full, cache, "train.train_iter=6", *DECOUPLED))
    assert r.returncode == 0, r.stderr[-3000:]
    lr, decoupled = losses(full, "lr"), losses(full, "decoupled_lr")
    # Rows count from 1. Warmup of 3 iterations: the peak at row 4, then cosine to each group's floor.
    assert lr[4] == pytest.approx(1e-3) and decoupled[4] == pytest.approx(4e-3)
    for it in (5, 6):
        assert decoupled[it] != pytest.approx(4 * lr[it])  # its own floor, not a multiple of lr
    assert decoupled[6] == pytest.approx(2e-4 + (4e-3 - 2e-4) * 0.5 * (1 + math.cos(math.pi * 2 / 3)))
    r = train_net(tiny(part, cache, "train.train_iter=3", *DECOUPLED))
    assert r.returncode == 0, r.stderr[-3000:]
    r = train_net(tiny(part, cache, "train.train_iter=6", *DECOUPLED) + ["--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = losses(part, "decoupled_lr")
    assert [resumed[it] for it in (4, 5, 6)] == pytest.approx([decoupled[it] for it in (4, 5, 6)])



def test_zero1_over_two_ranks_keeps_the_decoupled_groups_through_a_resume(tmp_path):
    """ZeRO-1 rebuilds the optimizer from the groups and compares them on resume."""
    cache, zero = tmp_path / "cache", ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=1"]
    r = train_sh(2, tiny(tmp_path / "a", cache, "train.train_iter=3", *DECOUPLED, *zero))
    assert r.returncode == 0, r.stderr[-3000:]
    r = train_sh(2, tiny(tmp_path / "a", cache, "train.train_iter=6", *DECOUPLED, *zero) + ["--resume"])
    assert r.returncode == 0, r.stderr[-3000:]
    lr, decoupled = losses(tmp_path / "a", "lr"), losses(tmp_path / "a", "decoupled_lr")
    assert lr[4] == pytest.approx(1e-3) and decoupled[4] == pytest.approx(4e-3)
    assert decoupled[6] == pytest.approx(2e-4 + (4e-3 - 2e-4) * 0.5 * (1 + math.cos(math.pi * 2 / 3)))


def test_the_projects_name_their_word_embedding_and_output_layer():
    from projects.GPT.modeling import GPTForPreTraining
    from projects.Llama.modeling import LlamaForPreTraining
    from projects.MT5.modeling import MT5ForPreTraining

    tiny = dict(hidden_layers=2, vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                max_seq_length=16)
    gpt = GPTForPreTraining(tiny)
    # Tied: the head is the token embedding; the position embeddings are not among them (as in Megatron).
    assert [id(p) for p in gpt.embedding_parameters()] == [id(gpt.GPT_model.embeddings.token_embeddings.weight)]
    llama = LlamaForPreTraining(tiny).llama
    assert [id(p) for p in llama.embedding_parameters()] == [id(llama.embeddings.weight), id(llama.lm_head.weight)]
    mt5 = MT5ForPreTraining(dict(vocab_size=64, hidden_size=32, hidden_layers=2, num_attention_heads=4, head_size=8,
                                 intermediate_size=48, tie_word_embeddings=False))
    inner = mt5.inner
    assert [id(p) for p in mt5.embedding_parameters()] == [id(inner.embedding.weight), id(inner.lm_head.weight)]
    groups = get_default_optimizer_params(mt5, decoupled_lr=1e-3)
    assert [len(g["params"]) for g in groups if g.get("decoupled")] == [2]


def test_a_schedule_that_ignores_a_groups_floor_is_refused():
    from libai_lite.scheduler.lr_scheduler import check_group_floors

    _, groups = _groups(decoupled_lr=0.5, decoupled_min_lr=0.02)
    opt = torch.optim.SGD(groups, lr=1.0)
    with pytest.raises(UsageError, match="decoupled_min_lr needs a libai_lite.scheduler schedule, not StepLR"):
        check_group_floors(torch.optim.lr_scheduler.StepLR(opt, 10))
    check_group_floors(WarmupCosineLR(torch.optim.SGD(_groups(decoupled_lr=0.5)[1], lr=1.0), 10))
