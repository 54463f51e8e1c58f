"""Megatron-LM pretrain_gpt.py command lines: tools/from_megatron.py and the translation it prints.

Megatron-LM's example scripts train in tests/compat/test_megatron_scripts.py; here, in-process, a
``pretrain_gpt.sh`` line is the GPT demo config with its values as overrides, and the rules of the flags
without a one-to-one key.
"""
import importlib.util
import json

import pytest
import torch
from omegaconf import OmegaConf

from compat.megatron import MEGATRON_MODELS, render_config, translate_megatron_args
from libai_lite.config import LazyConfig
from libai_lite.config.instantiate import instantiate_with
from libai_lite.scheduler import MegatronLR, WarmupCosineLR
from libai_lite.utils.errors import UsageError
from tests.launch import DATA, ROOT

# Megatron-LM's examples/pretrain_gpt.sh, shrunk (sizes, iterations).
FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 4 --global-batch-size 8 --lr 0.0015 --train-iters 4 --lr-decay-iters 4 "
         "--lr-decay-style cosine --min-lr 0.00015 --lr-warmup-fraction 0.25 --weight-decay 1e-2 --clip-grad 1.0 "
         "--split 949,50,1 --vocab-file data_test/gpt2/vocab.json --merge-file data_test/gpt2/merges.txt "
         "--hidden-dropout 0.0 --attention-dropout 0.0 --save-interval 100 --eval-interval 2 --eval-iters 1 "
         "--log-interval 1 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --DDP-impl local")


def translate(flags, checkpoint_exists=lambda path: ""):
    return translate_megatron_args(flags, MEGATRON_MODELS, checkpoint_exists)


def tool():
    spec = importlib.util.spec_from_file_location("from_megatron", ROOT / "tools" / "from_megatron.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flat(node, prefix=""):
    if not isinstance(node, dict):
        return {prefix: node}
    return {k: v for key, value in node.items() for k, v in flat(value, f"{prefix}.{key}" if prefix else key).items()}


def test_pretrain_gpt_line_is_the_gpt_demo_config_with_its_values(tmp_path):
    flags = f"{FLAGS} --data-path {DATA} --save {tmp_path} --load {tmp_path}"
    run = translate(flags)
    assert run.resume and run.no_effect == ["--DDP-impl (data parallelism is FSDP2/DDP from train.dist and "
                                            "train.zero_optimization)"]
    (tmp_path / "run.py").write_text(render_config(run, flags))
    ours = flat(OmegaConf.to_container(LazyConfig.load(str(tmp_path / "run.py"))))
    base = flat(OmegaConf.to_container(LazyConfig.load(str(ROOT / "projects/GPT/configs/gpt2_pretrain.py"))))
    changed = {k: ours.get(k) for k in set(ours) | set(base) if ours.get(k, "-") != base.get(k, "-")}
    schedule = {k: changed.pop(k) for k in list(changed) if k.startswith("train.scheduler.")}
    assert changed == {
        "model.cfg.hidden_layers": 2, "model.cfg.hidden_size": 64, "model.cfg.ffn_hidden_size": 256,
        "model.cfg.num_attention_heads": 2, "model.cfg.max_seq_length": 32,
        "model.cfg.activation": "gelu",  # Megatron's default GeLU (erf); --openai-gelu is GPT-2's tanh one
        "train.train_micro_batch_size": 4, "train.test_micro_batch_size": 4, "train.global_batch_size": 8,
        "train.train_iter": 4, "train.warmup_ratio": 0.0, "train.log_period": 1, "train.evaluation.eval_period": 2,
        "train.evaluation.eval_iter": 1, "train.output_dir": str(tmp_path),
        "optim.betas": [0.9, 0.999], "dataloader.train.num_workers": 2,  # Megatron's defaults
    }
    assert schedule["train.scheduler._target_"].__name__ == "MegatronLR"
    # Warmup .25 of a 4-iteration decay, cosine to min_lr: the LiBai-style schedule of the same run.
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0015)
    cfg = LazyConfig.load(str(tmp_path / "run.py"))
    ours = instantiate_with(cfg.train.scheduler, optimizer=opt, max_iter=4, warmup_iter=0)
    theirs = WarmupCosineLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0015), 4, warmup_factor=0.0,
                            warmup_iter=1, alpha=0.1)
    assert [ours.factor(i) for i in range(6)] == pytest.approx([theirs.factor(i) for i in range(6)], rel=1e-12)


def test_tool_prints_one_error_line_or_its_help(capsys):
    from_megatron = tool()
    assert from_megatron.main(["--hiden-size", "8"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--hiden-size (not known here; did you mean " \
                                                                "--hidden-size?)" in err[0]
    assert from_megatron.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("Print the config file and command that run a Megatron-LM")


def test_tool_prints_the_config_and_the_command(capsys):
    assert tool().main([*FLAGS.split(), "--data-path", DATA, "--context-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "from projects.GPT.configs.gpt2_pretrain import" in out and "train.dist.context_parallel_size = 2" in out
    assert "run it (2 x your data-parallel size processes)" in out


def test_rules_of_the_flags_without_a_one_to_one_key():
    base = "--num-layers 2 --num-attention-heads 2 --micro-batch-size 2 --data-path d --vocab-file v --merge-file m "
    run_ = translate(base + "--hidden-size 1024 --seq-length 1024 --max-position-embeddings 2048 --bf16 "
                            "--lr 3e-4 --min-lr 3e-5 --lr-decay-style linear --train-iters 100 "
                            "--lr-warmup-iters 10 --data-path 0.3 a_text_document 0.7 b_text_document "
                            "--save out --load out --recompute-activations --use-distributed-optimizer "
                            "--eval-iters 0 --clip-grad 0 --data-cache-path cache")
    a = run_.assignments
    assert a["model.cfg.ffn_hidden_size"] == 4096 and a["model.cfg.max_seq_length"] == 2048
    assert a["dataloader.train.seq_length"] == 1024 and a["train.num_accumulation_steps"] == 1
    assert a["train.amp.dtype"] == "bf16" and a["train.warmup_ratio"] == 0.0
    assert run_.scheduler == {"decay": "linear", "min_lr_ratio": pytest.approx(0.1), "init_lr_ratio": 0.0,
                              "warmup_iters": 10}
    assert a["dataloader.train.data_prefix"] == [0.3, "a_text_document", 0.7, "b_text_document"]
    assert run_.resume and a["train.activation_checkpoint.mode"] == "selective"
    assert a["train.zero_optimization.stage"] == 1 and a["train.evaluation.enabled"] is False
    assert a["optim.params.clip_grad_max_norm"] is None and a["dataloader.train.cache_dir"] == "cache"
    assert a["dataloader.train.splits_string"] == "969,30,1"  # Megatron's default with --data-path
    assert a["train.evaluation.eval_period"] == 100  # no --eval-interval: once, at the end
    more = translate(base + "--hidden-size 8 --seq-length 8 --lr 1 --train-iters 1 --use-torch-fsdp2 --async-save "
                            "--wandb-project p --wandb-exp-name n --virtual-pipeline-model-parallel-size 2 "
                            "--fp8-format e4m3 --fp8-recipe tensorwise --tokenizer-type BertWordPieceCase "
                            "--vocab-file data_test/bert/vocab.txt").assignments
    assert more["train.zero_optimization.stage"] == 3 and more["train.checkpointer.async_save"] is True
    assert (more["train.wandb.enabled"], more["train.wandb.project"], more["train.wandb.name"]) == (True, "p", "n")
    assert more["train.dist.virtual_pipeline_size"] == 2
    assert more["train.dist.pipeline_schedule"] == "interleaved_1f1b"
    assert more["train.fp8.recipe"] == "rowwise"
    bert = more["tokenization.tokenizer"]
    assert bert.target == "libai_lite.tokenizer:BertTokenizer" and bert.kwargs["do_lower_case"] is False
    swiglu = translate(base + "--hidden-size 1024 --swiglu --normalization RMSNorm --position-embedding-type rope "
                              "--disable-bias-linear --hidden-dropout 0 --seq-length 8 --lr 1 --train-iters 1")
    assert swiglu.model.name == "projects/Llama" and swiglu.assignments["model.cfg.ffn_hidden_size"] == 2688
    assert swiglu.assignments["model.cfg.num_key_value_heads"] == 2  # no --group-query-attention: one per head
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(UsageError, match="train.warmup_ratio and the scheduler's own warmup"):
        MegatronLR(opt, 100, warmup_iter=5, warmup_iters=10)
    with pytest.raises(UsageError, match="make the decay longer than the warmup"):
        MegatronLR(opt, 100, decay_iters=10, warmup_fraction=1.0)
    with pytest.raises(UsageError, match=r"--load ckpt \(a Megatron-LM checkpoint: convert it first"):
        translate(base + "--hidden-size 8 --seq-length 8 --lr 1 --train-iters 1 --load ckpt", lambda path: "megatron")


def test_megatron_deepspeed_and_oneflow_gpt_seed_lines_translate(tmp_path):
    # Megatron-DeepSpeed's examples/run_deepspeed_example.sh and OneFlow-GPT's pretrain script flags, with the
    # ds_config.json the script writes (the DeepSpeed engine's loss scale and ZeRO stage are the file's).
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1,
        "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "prescale_gradients": True,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
                 "initial_scale_power": 12}, "wall_clock_breakdown": True}))
    ds = translate(
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 24 --hidden-size 1024 "
        "--num-attention-heads 16 --micro-batch-size 4 --global-batch-size 64 --seq-length 1024 "
        "--max-position-embeddings 1024 --train-iters 5000 --lr-decay-iters 5000 --data-path d_text_document "
        "--vocab-file v.json --merge-file m.txt --data-impl mmap --split 949,50,1 --distributed-backend nccl "
        "--lr 1.5e-4 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 "
        "--lr-warmup-fraction .01 --checkpoint-activations --log-interval 10 --save-interval 1000 "
        "--eval-interval 1000 --eval-iters 10 --fp16 --loss-scale 12 --hysteresis 2 --deepspeed "
        f"--deepspeed_config {config} --zero-stage 1 --deepspeed-activation-checkpointing --partition-activations "
        "--checkpoint-num-layers 1")
    a = ds.assignments
    assert a["train.dist.pipeline_parallel_size"] == 2 and a["train.zero_optimization.stage"] == 1
    assert a["train.amp.initial_scale"] == 4096.0 and ds.parallel_sizes == {"tp": 2, "pp": 2, "cp": 1}
    assert a["train.amp.growth_interval"] == 500 and a["train.log_period"] == 10
    assert any(n.startswith("--partition-activations") for n in ds.no_effect)
