"""DeepSpeed's T5 guide's four set-ups, each from a ds_config.json, on this project's MT5/T5 (shrunk only in sizes and
iterations): fp16 with pipeline stages and ZeRO-1, MoE with ZeRO-2 over two ranks, ZeRO-1 and ZeRO-2 with the
optimizer offloaded. Each trains, and its config.yaml holds what the file asks for."""
import json

import pytest
from omegaconf import OmegaConf

from tests.launch import losses, train_net, train_sh

MT5 = "projects/MT5/configs/mt5_pretrain.py"
T5_MOE = "projects/MT5/configs/t5_moe.py"
SHRUNK = ["model.cfg.hidden_layers=2", "model.cfg.hidden_size=64", "model.cfg.num_attention_heads=4",
          "model.cfg.head_size=16", "model.cfg.intermediate_size=128", "dataloader.train.max_seq_length=64",
          "dataloader.train.num_workers=0", "train.train_epoch=0", "train.train_iter=4",
          "train.evaluation.enabled=False", "train.checkpointer.period=1000", "train.log_memory_estimate=False",
          "tokenization.make_vocab_size_divisible_by=256"]
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 1000, "hysteresis": 2,
        "min_loss_scale": 1}
CASES = {
    # ds_config.json -> (config, processes, extra overrides, what config.yaml must hold)
    "fp16_pipeline_zero1": ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
                             "fp16": FP16, "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0},
                            MT5, 2, ["train.dist.pipeline_parallel_size=2"],
                            {"train.amp.dtype": "fp16", "train.amp.initial_scale": 4096.0,
                             "train.zero_optimization.stage": 1, "train.dist.pipeline_parallel_size": 2}),
    "moe_zero2": ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1,
                   "fp16": FP16, "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True}},
                  T5_MOE, 2, ["model.cfg.moe.ep_size=2"],
                  {"train.amp.dtype": "fp16", "train.zero_optimization.stage": 2, "train.global_batch_size": 8}),
    "zero1_offload": ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1,
                       "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
                      MT5, 1, [], {"train.zero_optimization.stage": 1, "train.zero_optimization.offload": True}),
    "zero2_offload": ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1,
                       "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
                      MT5, 1, [], {"train.zero_optimization.stage": 2, "train.zero_optimization.offload": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_t5_guides_deepspeed_configs_train_mt5_with_their_settings(tmp_path, case):
    ds, config, nproc, extra, expected = CASES[case]
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    out = tmp_path / "out"
    args = ["--deepspeed", "--deepspeed_config", str(path), f"train.output_dir={out}",
            f"dataloader.train.cache_dir={tmp_path / 'cache'}", *SHRUNK, *extra]
    r = train_sh(nproc, args, config=config) if nproc > 1 else train_net(args, config=config)
    assert r.returncode == 0, r.stderr[-4000:]
    assert sorted(losses(out)) == [1, 2, 3, 4]
    cfg = OmegaConf.load(out / "config.yaml")
    for key, value in expected.items():
        assert OmegaConf.select(cfg, key) == value, (key, OmegaConf.select(cfg, key))
    assert cfg.train.zero_optimization.enabled
    if case == "moe_zero2":  # DeepSpeed's train batch: micro 2 x accumulation 2 x 2 ranks
        assert "global batch 8 = micro 2 x dp 2 x accumulation 2" in (out / "log.txt").read_text()
        # FSDP2's warning about the position bias each layer passes on, once a rank, said nothing to act on.
        assert "returned a view tensor" not in r.stderr, r.stderr[-3000:]
