"""fairseq-train's language-model line (examples/language_model) through ``tools/train_net.py --fairseq-args``.

The data-bin is written as fairseq-preprocess writes it; the lr of each step is checked against fairseq's
schedulers written out from their definitions (fairseq/optim/lr_scheduler/*.py), as functions of
``num_updates``, the updates done before the step.
"""
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from compat.fairseq import FairseqLR, translate_fairseq_args
from libai_lite.scheduler import WarmupDecayLR
from libai_lite.utils.errors import UsageError
from tests.data.test_corpus_formats import _documents, _write_fairseq_data_bin
from tests.launch import ROOT, env, free_port, losses, one_error_line, python_tool, tree_hashes


def polynomial_decay(n, lr, warmup, total, end=0.0, power=1.0):
    if warmup > 0 and n == 0:
        return lr / warmup  # set at construction
    if warmup > 0 and n <= warmup:
        return lr * n / warmup
    if n >= total:
        return end
    return (lr - end) * (1 - (n - warmup) / (total - warmup)) ** power + end


def inverse_sqrt(n, lr, warmup, init=-1.0):
    init = 0.0 if init < 0 else init
    if n < warmup:
        return init + n * (lr - init) / warmup
    return lr * warmup ** 0.5 * n ** -0.5


def cosine(n, lr, warmup, max_update, min_lr=0.0, init=-1.0):
    init = min_lr if init < 0 else init
    if n < warmup:
        return init + n * (lr - init) / warmup
    period = max_update - warmup
    t = (n - warmup) % period
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * t / period))


def fixed(n, lr, warmup):
    if warmup > 0 and n < warmup:
        return lr * (n + 1) / warmup
    return lr


def _lrs(max_iter, **kwargs):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=kwargs["lr"])
    sched = FairseqLR(opt, max_iter, **kwargs)
    return [kwargs["lr"] * sched.factor(k) for k in range(max_iter)]


def test_each_schedule_is_fairseqs_formula():
    lr = 5e-4
    ours = _lrs(40, kind="inverse_sqrt", lr=lr, warmup_updates=8, warmup_init_lr=1e-7)
    assert ours == pytest.approx([inverse_sqrt(n, lr, 8, 1e-7) for n in range(40)], rel=1e-9)
    ours = _lrs(30, kind="cosine", lr=lr, warmup_updates=5, min_lr=1e-5)
    assert ours == pytest.approx([cosine(n, lr, 5, 30, 1e-5) for n in range(30)], rel=1e-9)
    ours = _lrs(20, kind="fixed", lr=lr, warmup_updates=4)
    assert ours == pytest.approx([fixed(n, lr, 4) for n in range(20)], rel=1e-9)
    ours = _lrs(20, kind="polynomial_decay", lr=lr, warmup_updates=5, total_num_update=15, end_learning_rate=1e-5,
                power=2.0)
    # The one step said at start-up: fairseq's first update runs at lr / warmup, ours at 0.
    assert ours[0] == 0.0
    assert ours[1:] == pytest.approx([polynomial_decay(n, lr, 5, 15, 1e-5, 2.0) for n in range(1, 20)], rel=1e-9)


def test_inverse_sqrt_decay_kind_needs_a_warmup():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s = WarmupDecayLR(opt, 100, warmup_iter=16, warmup_factor=0.0, decay="inverse_sqrt")
    assert [s.factor(k) for k in (16, 64, 100)] == pytest.approx([1.0, 0.5, 0.4])
    with pytest.raises(UsageError, match="inverse_sqrt .* needs a warmup"):
        WarmupDecayLR(opt, 100, warmup_iter=0, decay="inverse_sqrt")


def user_line(data, save, **size) -> str:
    """examples/language_model's fairseq-train line; ``size`` shrinks it (sizes, paths, iterations)."""
    s = dict(seq=1024, batch=8, updates=10, warmup=5, total=10, sched="polynomial_decay", precision="--fp16",
             ddp="fully_sharded", arch="")
    s.update(size)
    return (f"{data} --ddp-backend {s['ddp']} {s['precision']} --task language_modeling --tokens-per-sample "
            f"{s['seq']} --arch transformer_lm --share-decoder-input-output-embed --dropout 0.1 --optimizer adam "
            f"--adam-betas \"(0.9,0.98)\" --weight-decay 0.01 --clip-norm 0.0 --lr 0.0001 --lr-scheduler {s['sched']} "
            f"--warmup-updates {s['warmup']} --total-num-update {s['total']} --max-update {s['updates']} --batch-size "
            f"{s['batch']} --update-freq 1 --save-dir {save} --log-interval 1 {s['arch']}")


def train_net(flags: str, tmp_path):
    return python_tool([sys.executable, "tools/train_net.py", "--fairseq-args", flags, "dataloader.train.num_workers=0",
                        "train.log_memory_estimate=False", f"dataloader.train.cache_dir={tmp_path / 'cache'}"],
                       timeout=600)


TINY = "--decoder-layers 2 --decoder-embed-dim 64 --decoder-ffn-embed-dim 128 --decoder-attention-heads 2"


def _data_bin(tmp_path) -> Path:
    folder = tmp_path / "data-bin"
    _write_fairseq_data_bin(folder, [d.split() for d in _documents()] * 20)
    return folder


def test_user_line_shrunk_trains_on_the_data_bin_with_what_it_asks(tmp_path):
    data, out = _data_bin(tmp_path), tmp_path / "checkpoints"
    before = tree_hashes(data)
    flags = user_line(data, out, seq=32, batch=4, arch=TINY)
    r = train_net(flags, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert tree_hashes(data) == before  # read in place: nothing written into the data-bin
    cfg = OmegaConf.load(out / "config.yaml")
    assert cfg.optim.lr == 1e-4 and list(cfg.optim.betas) == [0.9, 0.98] and cfg.optim.weight_decay == 0.01
    assert cfg.optim.params.weight_decay_bias == 0.01 and cfg.optim.params.clip_grad_max_norm is None
    assert cfg.train.train_iter == 10 and cfg.train.train_micro_batch_size == 4
    assert cfg.train.global_batch_size == 4  # --batch-size x one rank x --update-freq
    assert cfg.model.cfg.max_seq_length == 32 and cfg.model.cfg.hidden_layers == 2
    assert cfg.model.cfg.activation == "relu"  # transformer_lm's
    assert cfg.train.zero_optimization.enabled and cfg.train.zero_optimization.stage == 3
    assert cfg.train.amp.enabled and cfg.train.amp.dtype == "fp16" and cfg.train.amp.initial_scale == 128
    sched = cfg.train.scheduler
    assert (sched.kind, sched.warmup_updates, sched.total_num_update) == ("polynomial_decay", 5, 10)
    # The ids are dict.txt's: the model's vocabulary is the dictionary's 4 specials and symbols.
    symbols = len((data / "dict.txt").read_text().splitlines())
    assert cfg.model.cfg.vocab_size == -(-(4 + symbols) // 8) * 8
    log = (out / "log.txt").read_text()
    assert "differs from fairseq: --lr-scheduler polynomial_decay's first update" in log
    assert "positions are learned here, sinusoidal in fairseq" in log
    lrs = losses(out, "lr")
    assert sorted(lrs) == list(range(1, 11)) and all(math.isfinite(v) for v in losses(out).values())
    # metrics.json's iteration k trains at the lr of k - 1 updates done.
    assert lrs[1] == 0.0
    for k in range(2, 11):
        assert lrs[k] == pytest.approx(polynomial_decay(k - 1, 1e-4, 5, 10), rel=1e-6), k


def test_inverse_sqrt_line_steps_at_fairseqs_lr(tmp_path):
    data, out = _data_bin(tmp_path), tmp_path / "ckpt"
    flags = user_line(data, out, seq=32, batch=2, updates=8, warmup=3, sched="inverse_sqrt", precision="",
                      ddp="c10d", arch=TINY + " --warmup-init-lr 1e-07").replace("--total-num-update 10 ", "")
    r = train_net(flags, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--ddp-backend c10d (data parallelism is PyTorch's DDP here)" in (out / "log.txt").read_text()
    cfg = OmegaConf.load(out / "config.yaml")
    assert not cfg.train.zero_optimization.enabled and not cfg.train.amp.enabled
    lrs = losses(out, "lr")
    for k in range(1, 9):
        assert lrs[k] == pytest.approx(inverse_sqrt(k - 1, 1e-4, 3, 1e-7), rel=1e-6), k
    # As fairseq-train, the same line with a later --max-update goes on from --save-dir's last checkpoint.
    r = train_net(flags.replace("--max-update 8", "--max-update 10"), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Resum" in (out / "log.txt").read_text() and sorted(losses(out)) == list(range(1, 11))
    lrs = losses(out, "lr")
    assert [lrs[k] for k in (9, 10)] == pytest.approx([inverse_sqrt(k - 1, 1e-4, 3, 1e-7) for k in (9, 10)])


def test_user_line_on_two_ranks_shards_with_zero3(tmp_path):
    data, out = _data_bin(tmp_path), tmp_path / "checkpoints"
    flags = user_line(data, out, seq=32, batch=2, updates=3, warmup=1, total=3, arch=TINY)  # --fp16, as written
    r = subprocess.run(["bash", "tools/train.sh", "tools/train_net.py", "--fairseq-args", flags, "2",
                        "dataloader.train.num_workers=0", "train.log_memory_estimate=False",
                        f"dataloader.train.cache_dir={tmp_path / 'cache'}"],
                       cwd=ROOT, env=env(PORT=str(free_port())), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (out / "log.txt").read_text()
    assert "dp=2" in log and "global batch 4 = micro 2 x dp 2" in log and sorted(losses(out)) == [1, 2, 3]
    assert "nothing to shard" not in log  # ZeRO-3 shards over the two ranks
    cfg = OmegaConf.load(out / "config.yaml")
    assert cfg.train.zero_optimization.stage == 3 and cfg.train.amp.enabled and cfg.train.amp.dtype == "fp16"
    assert all(math.isfinite(v) for v in losses(out).values())


def test_what_is_not_taken_is_refused_in_one_line_and_nothing_is_written(tmp_path):
    data, out = _data_bin(tmp_path), tmp_path / "checkpoints"
    flags = (user_line(data, out, seq=32, sched="tri_stage").replace("--share-decoder-input-output-embed ", "")
             .replace("--optimizer adam", "--optimizer adafactor") + " --max-epoch 3 --sample-break-mode eos "
             "--frobnicate 1 --arch transformer_lm_wiki103")
    r = python_tool([sys.executable, "tools/train_net.py", "--fairseq-args", flags])
    assert r.returncode == 1
    line = one_error_line(r)
    for part in ("--optimizer adafactor (", "--lr-scheduler tri_stage (not built here", "--max-epoch (",
                 "--sample-break-mode eos (", "--frobnicate (not known here)", "--arch transformer_lm_wiki103 ("):
        assert part in line, part
    assert not out.exists() and not (data / "libai_lite").exists()
    # Untied embeddings are refused with the flag that ties them, and the nearest architecture is named.
    with pytest.raises(UsageError, match=r"--share-decoder-input-output-embed \(missing: projects/GPT ties"):
        translate_fairseq_args(user_line(data, out).replace("--share-decoder-input-output-embed ", ""))
    with pytest.raises(UsageError, match=r"2 problems.*missing \(has no dict.txt: pass fairseq-preprocess's "
                                         r"--destdir\); --arch transformer_lm_gpt3 \(not built here.*"
                                         r"nearest: transformer_lm_gpt"):
        os.makedirs(tmp_path / "missing")
        translate_fairseq_args(user_line(tmp_path / "missing", out).replace("--arch transformer_lm ",
                                                                             "--arch transformer_lm_gpt3 "))
    with pytest.raises(UsageError, match=r"--adam-betas \('0.9' is not a \(beta1, beta2\) pair"):
        translate_fairseq_args(user_line(data, out).replace('"(0.9,0.98)"', "0.9"))


def test_from_fairseq_prints_the_config_and_compat_fairseq_stands_alone(tmp_path):
    data = _data_bin(tmp_path)
    (data / "valid.idx").write_bytes((data / "train.idx").read_bytes())
    line = shlex.split(user_line(data, tmp_path / "ck", arch=TINY))
    r = python_tool([sys.executable, "tools/from_fairseq.py", *line])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train.scheduler = LazyCall(FairseqLR)(kind='polynomial_decay'" in r.stdout
    assert "tokenization.tokenizer = LazyCall(FairseqDictionary)" in r.stdout
    differs = [line for line in r.stderr.splitlines() if line.startswith("differs from fairseq: ")]
    assert len(differs) == 1 and "valid is not evaluated during training here" in differs[0]
    code = "import sys, compat.fairseq; sys.exit('compat.megatron' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env()).returncode == 0
