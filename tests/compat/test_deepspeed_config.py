"""DeepSpeed ``ds_config.json`` files through ``tools/train_net.py --deepspeed_config`` and Megatron-DeepSpeed's
``--deepspeed_config``: the configurations of DeepSpeed's T5 guide (fp16 + ZeRO-1, ZeRO-1 + CPU offload, ZeRO-2
with MoE layers, ZeRO-2 + CPU offload, bf16 + ZeRO-3), written out here, each trained a few iterations on the
tiny GPT with the run's config.yaml checked for what the file asked; refusals are one line.
"""
import json

import pytest
import torch
from omegaconf import OmegaConf

from compat.deepspeed import read_ds_config
from compat.megatron import MEGATRON_MODELS, translate_megatron_args
from libai_lite.config.instantiate import instantiate_with
from libai_lite.config import LazyConfig
from libai_lite.utils.errors import UsageError
from tests.compat.test_megatron_scripts import gpt3_175b
from tests.launch import losses, one_error_line, tiny, train_net, train_sh

MOE_CONFIG = "projects/GPT/configs/gpt2_moe.py"
# The file's batch sizes and log period are what these runs check: tiny()'s own are left out.
_FROM_FILE = ("train.train_micro_batch_size", "train.global_batch_size", "train.test_micro_batch_size",
              "train.log_period")

FP16_ZERO1 = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
    "steps_per_print": 1, "gradient_clipping": 0.5, "wall_clock_breakdown": False,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
             "hysteresis": 2, "min_loss_scale": 2},
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 500000000, "allgather_bucket_size": 500000000},
    "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 2,
                                                 "warmup_type": "linear"}},
}
ZERO2_MOE = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1,
    "zero_allow_untested_optimizer": True, "communication_data_type": "fp32", "prescale_gradients": False,
    "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True, "reduce_scatter": True,
                          "reduce_bucket_size": 50000000, "allgather_bucket_size": 50000000},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.95], "weight_decay": 0.05}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2,
                                                      "warmup_min_lr": 1e-5, "warmup_max_lr": 2e-4}},
}
ZERO2_OFFLOAD = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 2, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "contiguous_gradients": True, "overlap_comm": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-8}},
}
# The T5 guide's ZeRO-1 + offload: the optimizer state and step on the CPU, parameters and gradients on the GPU.
ZERO1_OFFLOAD = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1, "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
    "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
}
BF16_ZERO3 = {
    "train_batch_size": 8, "gradient_accumulation_steps": 2, "steps_per_print": 1,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "none"}, "overlap_comm": True,
                          "stage3_max_live_parameters": 1000000000, "stage3_prefetch_bucket_size": 50000000,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "optimizer": {"type": "Adam", "params": {"lr": 5e-4, "adam_w_mode": False, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2,
                                                       "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}},
}


def ds_file(tmp_path, config, name="ds_config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config, indent=2))
    return str(path)


def overrides(tmp_path, *extra):
    return [o for o in tiny(tmp_path / "out", tmp_path / "cache", "train.train_iter=4",
                            "train.evaluation.enabled=False", *extra) if not o.startswith(_FROM_FILE)]


def recorded(tmp_path):
    return OmegaConf.load(tmp_path / "out" / "config.yaml")


def check_run(r, tmp_path, iters=4):
    assert r.returncode == 0, r.stderr[-4000:]
    assert max(losses(tmp_path / "out")) == iters
    return recorded(tmp_path)


def test_fp16_zero1_file_trains_with_its_settings(tmp_path):
    r = train_net(["--deepspeed", "--deepspeed_config", ds_file(tmp_path, FP16_ZERO1), *overrides(tmp_path)])
    cfg = check_run(r, tmp_path)
    t = cfg.train
    assert (t.global_batch_size, t.train_micro_batch_size) == (8, 2)
    # config.yaml keeps the global batch and derives the accumulation again; its header records this run's.
    assert "global batch 8 = micro 2 x dp 1 x accumulation 4." in (tmp_path / "out" / "config.yaml").read_text()
    assert t.log_period == 1
    assert dict(t.amp) == {"enabled": True, "dtype": "fp16", "initial_scale": 4096.0, "growth_interval": 500,
                           "min_loss_scale": 2.0}
    assert dict(t.zero_optimization) == {"enabled": True, "stage": 1, "offload": False}
    assert cfg.optim._target_ == "torch.optim.AdamW"  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
    assert (cfg.optim.lr, list(cfg.optim.betas), cfg.optim.eps, cfg.optim.weight_decay) == (3e-4, [0.9, 0.98],
                                                                                           1e-6, 0.1)
    assert cfg.optim.params.clip_grad_max_norm == 0.5
    assert t.scheduler.decay == "constant" and t.scheduler.warmup_iters == 2 and t.warmup_ratio == 0
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "fp16.hysteresis (the loss scale halves at the first overflow here)" in log
    assert "wall_clock_breakdown (" in log and "zero_optimization.reduce_bucket_size (" in log
    # Linear warmup from 0 to the peak over two steps, then the peak.
    lrs = losses(tmp_path / "out", "lr")
    assert [lrs[i] for i in (1, 2, 3, 4)] == pytest.approx([0.0, 1.5e-4, 3e-4, 3e-4])


def test_command_line_wins_over_the_file(tmp_path):
    r = train_net(["--deepspeed_config", ds_file(tmp_path, FP16_ZERO1), *overrides(tmp_path),
                   "optim.lr=1e-4", "train.amp.initial_scale=256", "train.log_period=2"])
    t = check_run(r, tmp_path)
    assert (t.optim.lr, t.train.amp.initial_scale, t.train.log_period) == (1e-4, 256.0, 2)


def test_zero2_moe_file_on_two_processes(tmp_path):
    r = train_sh(2, ["--deepspeed", f"--deepspeed_config={ds_file(tmp_path, ZERO2_MOE)}", *overrides(tmp_path)],
                 config=MOE_CONFIG, timeout=400)
    cfg = check_run(r, tmp_path)
    t = cfg.train
    # No train_batch_size in the file: global = micro x 2 ranks x accumulation, as DeepSpeed infers it.
    assert t.train_micro_batch_size == 2
    assert "global batch 8 = micro 2 x dp 2 x accumulation 2." in (tmp_path / "out" / "config.yaml").read_text()
    assert dict(t.zero_optimization) == {"enabled": True, "stage": 2, "offload": False}
    assert t.amp.enabled is False and cfg.optim.params.clip_grad_max_norm is None  # DeepSpeed's defaults
    assert cfg.model.cfg.moe.enabled is True
    assert (cfg.optim.lr, cfg.optim.eps, cfg.optim.weight_decay) == (2e-4, 1e-8, 0.05)
    s = t.scheduler
    assert (s.decay, s.warmup_iters, s.decay_iters, s.init_lr_ratio, s.min_lr_ratio) == ("linear", 2, 6, 0.05, 0.05)


def test_zero2_offload_file(tmp_path):
    r = train_net(["--deepspeed_config", ds_file(tmp_path, ZERO2_OFFLOAD), *overrides(tmp_path)])
    cfg = check_run(r, tmp_path)
    assert dict(cfg.train.zero_optimization) == {"enabled": True, "stage": 2, "offload": True}
    assert (cfg.train.global_batch_size, cfg.train.num_accumulation_steps, cfg.train.log_period) == (8, None, 2)
    assert (cfg.optim.lr, list(cfg.optim.betas), cfg.optim.weight_decay) == (1e-3, [0.9, 0.999], 0.0)
    assert "zero_optimization.offload_optimizer.pin_memory (" in (tmp_path / "out" / "log.txt").read_text()


def test_zero1_offload_file_trains_on_two_processes(tmp_path):
    r = train_sh(2, ["--deepspeed_config", ds_file(tmp_path, ZERO1_OFFLOAD), *overrides(tmp_path)])
    cfg = check_run(r, tmp_path)
    assert dict(cfg.train.zero_optimization) == {"enabled": True, "stage": 1, "offload": True}
    assert cfg.train.amp.dtype == "fp16" and cfg.optim.params.clip_grad_max_norm == 1.0
    assert "zero_optimization.offload_optimizer.pin_memory (" in (tmp_path / "out" / "log.txt").read_text()


def test_bf16_zero3_file(tmp_path):
    r = train_net(["--deepspeed_config", ds_file(tmp_path, BF16_ZERO3), *overrides(tmp_path)])
    cfg = check_run(r, tmp_path)
    assert cfg.train.amp.enabled is True and cfg.train.amp.dtype == "bf16"
    assert dict(cfg.train.zero_optimization) == {"enabled": True, "stage": 3, "offload": False}
    assert cfg.optim._target_ == "torch.optim.Adam"  # adam_w_mode false: L2 Adam
    s = cfg.train.scheduler
    assert (s.decay, s.warmup_iters, s.decay_iters, s.init_lr_ratio, s.min_lr_ratio) == ("cosine", 2, 6, 0.1, 0.01)
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "scheduler WarmupCosineLR (" in log and "rises again" in log


def deepspeed_warmup_decay(step, total, warmup, low, high):
    """DeepSpeed's WarmupDecayLR (linear warmup) at optimizer step ``step`` (0-based): its schedule is stepped
    after each optimizer step, so step k uses its iteration k - 1 and steps 0 and 1 both use warmup_min_lr."""
    it = step - 1
    if it < 0:
        return low
    warmup = max(2, warmup)
    gamma = it / warmup if it < warmup else max(0.0, (total - it) / max(1.0, total - warmup))
    return low + (high - low) * gamma


def test_warmup_decay_schedule_is_deepspeeds_one_step_later(tmp_path):
    ds = dict(ZERO2_MOE, scheduler={"type": "WarmupDecayLR", "params": {
        "total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_lr": 1e-5, "warmup_max_lr": 2e-4,
        "warmup_type": "linear"}})
    run = read_ds_config(ds)
    sched = dict(run.assignments["train.scheduler"])
    target = sched.pop("_target_")
    cfg = LazyConfig.load("projects/GPT/configs/gpt2_pretrain.py")
    cfg.train.scheduler = OmegaConf.create({"_target_": target, **sched})
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=run.assignments["optim.lr"])
    s = instantiate_with(cfg.train.scheduler, optimizer=opt, max_iter=30, warmup_iter=0)
    ours = []
    for _ in range(25):
        ours.append(opt.param_groups[0]["lr"])
        opt.step()
        s.step()
    for k in range(25):
        assert ours[k] == pytest.approx(deepspeed_warmup_decay(k + 1, 20, 5, 1e-5, 2e-4), rel=1e-9), k
    assert any("one step" in n or "step after" in n for n in run.notes)


def test_auto_values_are_inferred_or_keep_the_config():
    run = read_ds_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                          "fp16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {
                              "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}})
    a = run.assignments
    assert (a["train.global_batch_size"], a["train.train_micro_batch_size"], a["train.num_accumulation_steps"]) \
        == (None, 4, None)
    assert not any(k.startswith(("train.amp", "optim.lr", "optim.betas", "optim.params")) for k in a)
    assert any('"auto"' in n for n in run.notes)


def test_inconsistent_batch_sizes_are_one_error_line(tmp_path):
    bad = dict(FP16_ZERO1, train_batch_size=10)
    r = train_net(["--deepspeed_config", ds_file(tmp_path, bad), *overrides(tmp_path)])
    line = one_error_line(r)
    assert r.returncode == 1 and "train_batch_size (10 is not train_micro_batch_size_per_gpu 2 x " \
        "gradient_accumulation_steps 4" in line, line
    assert not (tmp_path / "out").exists()
    # Divisible, but not on one process: the run's own batch check says so.
    bad = dict(FP16_ZERO1, train_batch_size=16)
    r = train_net(["--deepspeed_config", ds_file(tmp_path, bad), *overrides(tmp_path)])
    line = one_error_line(r)
    assert "train.global_batch_size=16 != train_micro_batch_size(2) x data_parallel_size(1) x " \
        "num_accumulation_steps(4)" in line, line


def test_every_key_not_taken_is_one_error_line(tmp_path):
    bad = dict(FP16_ZERO1, fp16={"enabld": True}, zero_optimisation={"stage": 2}, amp={"enabled": True},
               zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}},
               optimizer={"type": "OneBitAdam", "params": {"lr": 1e-3}})
    r = train_net(["--deepspeed_config", ds_file(tmp_path, bad), *overrides(tmp_path)])
    line = one_error_line(r)
    for says in ("5 problems with the DeepSpeed config", "zero_optimisation (not a DeepSpeed key known here; "
                 "did you mean zero_optimization?)", "fp16.enabld (not a DeepSpeed key known here; did you mean "
                 "fp16.enabled?)", "amp (NVIDIA Apex AMP", "zero_optimization.offload_optimizer (CPU offload moves "
                 "a ZeRO optimizer's state and ZeRO is off (stage 0): set zero_optimization.stage to 1",
                 "optimizer.type OneBitAdam (not built here"):
        assert says in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, says", [("{not json", "is not JSON"), ("[1, 2]", "must be a JSON object")])
def test_a_file_that_is_not_a_ds_config_is_one_line(tmp_path, text, says):
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(UsageError, match=says):
        read_ds_config(path)


def test_megatron_deepspeed_reads_its_deepspeed_config(tmp_path):
    ds_dict = {k: v for k, v in FP16_ZERO1.items() if k != "gradient_accumulation_steps"}
    ds_dict.update(train_batch_size=1536, train_micro_batch_size_per_gpu=1, zero_optimization={"stage": 2})
    ds = ds_file(tmp_path, ds_dict)
    run = translate_megatron_args(gpt3_175b() + f" --deepspeed --deepspeed_config {ds}", MEGATRON_MODELS)
    a = run.assignments
    assert (a["train.zero_optimization.enabled"], a["train.zero_optimization.stage"]) == (True, 2)
    assert (a["train.amp.initial_scale"], a["train.amp.growth_interval"]) == (4096.0, 500)  # the engine's scaler
    assert a["optim.params.clip_grad_max_norm"] == 0.5
    assert a["optim.lr"] == 6.0e-5 and a["train.log_period"] == 100  # Megatron's optimizer and log interval
    assert run.scheduler["decay"] == "constant" and run.scheduler["warmup_iters"] == 2  # the file's schedule
    assert any("optimizer (the optimizer is Megatron's" in n for n in run.no_effect)
    conflicting = ds_file(tmp_path, dict(ds_dict, train_batch_size=64), "other.json")
    with pytest.raises(UsageError, match=r"train.global_batch_size 64 differs from --global-batch-size 1536"):
        translate_megatron_args(gpt3_175b() + f" --deepspeed_config {conflicting}", MEGATRON_MODELS)


def test_the_reader_stands_alone():
    import subprocess
    import sys

    code = "import sys, compat.deepspeed; sys.exit('compat.megatron' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
