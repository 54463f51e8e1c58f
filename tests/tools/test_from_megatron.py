"""Megatron-LM pretrain_gpt.py command lines: tools/from_megatron.py and tools/train_net.py --megatron-args."""
import subprocess
import sys

import pytest

from libai_lite.config.megatron_args import translate_megatron_args
from libai_lite.utils.errors import UsageError
from tests.launch import DATA, ROOT, env, losses, one_error_line

# Megatron-LM's examples/pretrain_gpt.sh, shrunk (sizes, iterations) to run in seconds here.
FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 4 --global-batch-size 8 --lr 0.0015 --train-iters 4 --lr-decay-iters 4 "
         "--lr-decay-style cosine --min-lr 0.00015 --lr-warmup-fraction 0.25 --weight-decay 1e-2 --clip-grad 1.0 "
         "--split 949,50,1 --vocab-file data_test/gpt2/vocab.json --merge-file data_test/gpt2/merges.txt "
         "--hidden-dropout 0.0 --attention-dropout 0.0 --save-interval 100 --eval-interval 2 --eval-iters 1 "
         "--log-interval 1 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --DDP-impl local")
SPEED = ["dataloader.train.num_workers=0", "train.log_memory_estimate=False"]


def run(args):
    return subprocess.run([sys.executable, "tools/train_net.py", *args], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=600)


def test_megatron_command_line_trains_the_same_run_as_its_config(tmp_path):
    cache = tmp_path / "cache"
    flags = f"{FLAGS} --data-path {DATA} --save {tmp_path / 'mg'} --load {tmp_path / 'mg'}"
    r = run(["--megatron-args", flags, *SPEED, f"dataloader.train.cache_dir={cache}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--DDP-impl" in r.stderr  # named, not silently dropped
    # The same run written as overrides of the GPT demo config by hand.
    by_hand = ["model.cfg.hidden_layers=2", "model.cfg.hidden_size=64", "model.cfg.ffn_hidden_size=256",
               "model.cfg.num_attention_heads=2", "model.cfg.max_seq_length=32", "train.train_micro_batch_size=4",
               "train.global_batch_size=8", "optim.lr=0.0015", "train.train_iter=4", "train.warmup_ratio=0.25",
               "train.scheduler.alpha=0.1", "train.scheduler.warmup_factor=0.0", "optim.weight_decay=0.01",
               "optim.params.clip_grad_max_norm=1.0", "model.cfg.embedding_dropout_prob=0.0",
               "model.cfg.output_dropout_prob=0.0", "model.cfg.attention_dropout_prob=0.0",
               "train.checkpointer.period=100", "train.evaluation.eval_period=2", "train.evaluation.eval_iter=1",
               "train.log_period=1", f"dataloader.train.data_prefix={DATA}", f"train.output_dir={tmp_path / 'cfg'}",
               f"dataloader.train.cache_dir={cache}", *SPEED]
    r2 = run(["--config-file", "projects/GPT/configs/gpt2_pretrain.py", *by_hand])
    assert r2.returncode == 0, r2.stderr[-3000:]
    ours, theirs = losses(tmp_path / "mg"), losses(tmp_path / "cfg")
    assert len(ours) == 4 and ours == theirs
    assert losses(tmp_path / "mg", "lr") == losses(tmp_path / "cfg", "lr")


def test_unknown_flag_is_one_line_with_the_nearest_known_one(tmp_path):
    r = run(["--megatron-args", "--num-layer 2 --hidden-size 64"])
    assert r.returncode != 0
    assert one_error_line(r) == "error: Megatron flag --num-layer is not known here; did you mean --num-layers?"
    r = subprocess.run([sys.executable, "tools/from_megatron.py", "--hiden-size", "8"], cwd=ROOT, env=env(),
                       capture_output=True, text=True)
    assert r.returncode == 1 and "did you mean --hidden-size?" in one_error_line(r)


def test_rules_of_the_flags_without_a_one_to_one_key():
    run_ = translate_megatron_args("--hidden-size 1024 --seq-length 1024 --max-position-embeddings 2048 --bf16 "
                                   "--lr 3e-4 --min-lr 3e-5 --lr-decay-style linear --train-iters 100 "
                                   "--lr-warmup-iters 10 --data-path 0.3 a_text_document 0.7 b_text_document "
                                   "--save out --load out --recompute-activations --use-distributed-optimizer")
    a = run_.assignments
    assert a["model.cfg.ffn_hidden_size"] == 4096 and a["model.cfg.max_seq_length"] == 2048
    assert a["dataloader.train.seq_length"] == 1024
    assert a["train.amp.dtype"] == "bf16" and a["train.warmup_ratio"] == 0.1
    assert run_.scheduler["decay"] == "linear" and abs(run_.scheduler["min_lr_ratio"] - 0.1) < 1e-12
    assert a["dataloader.train.data_prefix"] == [0.3, "a_text_document", 0.7, "b_text_document"]
    assert run_.resume and a["train.activation_checkpoint.mode"] == "selective"
    assert a["train.zero_optimization.stage"] == 1
    with pytest.raises(UsageError, match="--lr-decay-iters 50 differs from --train-iters 100"):
        translate_megatron_args("--train-iters 100 --lr-decay-iters 50 --lr 1e-4")
    with pytest.raises(UsageError, match="Megatron-LM checkpoint: convert it first"):
        translate_megatron_args("--load ckpt", lambda path: "megatron")


def test_megatron_deepspeed_and_oneflow_gpt_seed_lines_translate():
    # Megatron-DeepSpeed's examples/run_deepspeed_example.sh and OneFlow-GPT's pretrain script flags.
    ds = translate_megatron_args(
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 24 --hidden-size 1024 "
        "--num-attention-heads 16 --micro-batch-size 4 --global-batch-size 64 --seq-length 1024 "
        "--max-position-embeddings 1024 --train-iters 5000 --lr-decay-iters 5000 --data-path d_text_document "
        "--vocab-file v.json --merge-file m.txt --data-impl mmap --split 949,50,1 --distributed-backend nccl "
        "--lr 1.5e-4 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 "
        "--lr-warmup-fraction .01 --checkpoint-activations --log-interval 10 --save-interval 1000 "
        "--eval-interval 1000 --eval-iters 10 --fp16 --loss-scale 12 --hysteresis 2 --deepspeed "
        "--deepspeed_config ds.json --zero-stage 1 --deepspeed-activation-checkpointing --partition-activations "
        "--checkpoint-num-layers 1")
    a = ds.assignments
    assert a["train.dist.pipeline_parallel_size"] == 2 and a["train.zero_optimization.stage"] == 1
    assert a["train.amp.initial_scale"] == 12.0 and ds.parallel_sizes == {"tp": 2, "pp": 2}
    assert any(n.startswith("--partition-activations") for n in ds.no_effect)
    with pytest.raises(UsageError, match="--swiglu is not built from a command line here: a Llama-style model"):
        translate_megatron_args("--num-layers 2 --swiglu")
