"""Megatron-LM's own example scripts through ``tools/train_net.py --megatron-args``.

The flag lists below are those of Megatron-LM's ``examples/gpt3/train_gpt3_175b_distributed.sh`` and
``examples/llama/train_llama3_8b_h100_fp8.sh`` (written out here, not copied), at their real sizes for the
in-process translation and shrunk (sizes, iterations, paths) for the two runs that train. The lr each step
uses is checked against Megatron-LM's schedule written out from its definition (``megatron_lr``).
"""
import json
import math
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from compat.megatron import MEGATRON_MODELS, render_config, translate_megatron_args
from libai_lite.config import LazyConfig, instantiate
from libai_lite.config.instantiate import instantiate_with
from libai_lite.utils.errors import UsageError
from tests.launch import ROOT, env, losses, one_error_line, python_tool

GPT2 = "--vocab-file data_test/gpt2/vocab.json --merge-file data_test/gpt2/merges.txt"


def gpt3_175b(**size) -> str:
    """examples/gpt3/train_gpt3_175b_distributed.sh's flags. Left out: --step-batch-size-schedule, which
    Megatron-LM itself refuses beside --global-batch-size (and which is refused here: the batch is fixed)."""
    s = dict(layers=96, hidden=12288, heads=96, seq=2048, mbs=1, gbs=1536, iters=500000, decay=430000, tp=8, pp=16,
             warmup=".001", lr="6.0e-5", min_lr="6.0e-6", save="ckpt", tb="tb", data="my_gpt2_text_document",
             interval=1000, eval_iters=10, log=100, save_interval=10000)
    s.update(size)
    return (f"--num-layers {s['layers']} --hidden-size {s['hidden']} --num-attention-heads {s['heads']} "
            f"--seq-length {s['seq']} --max-position-embeddings {s['seq']} --attention-backend auto "
            f"--micro-batch-size {s['mbs']} --global-batch-size {s['gbs']} --train-iters {s['iters']} "
            f"--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 "
            f"--lr {s['lr']} --lr-decay-style cosine --min-lr {s['min_lr']} --lr-warmup-fraction {s['warmup']} "
            f"--lr-decay-iters {s['decay']} "
            f"--tensor-model-parallel-size {s['tp']} --pipeline-model-parallel-size {s['pp']} "
            f"--data-path {s['data']} {GPT2} --split 949,50,1 "
            f"--log-interval {s['log']} --save-interval {s['save_interval']} --eval-interval {s['interval']} "
            f"--save {s['save']} --load {s['save']} --eval-iters {s['eval_iters']} --tensorboard-dir {s['tb']}")


def llama3_8b(fp8=True, decoupled=True, tokenizer=None, **size) -> str:
    """examples/llama/train_llama3_8b_h100_fp8.sh's flags, its real-data branch (DTYPE=fp8 adds the --fp8-*
    flags, as the script does)."""
    s = dict(layers=32, hidden=4096, ffn=14336, heads=32, groups=8, kv=128, seq=8192, mbs=1, gbs=128,
             samples=1953125000, decay=1949218748, warmup=3906252, lr="0.00015", min_lr="0.00001", tp=1, cp=1,
             data="my_llama3_text_document", cache="cache", log=1, eval_iters=32, interval=100, save_interval=1000,
             start=4, end=6, save="ckpt", tb="tb")
    s.update(size)
    tokenizer = tokenizer or "--tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3-8B"
    flags = [
        f"--use-mcore-models --num-layers {s['layers']} --hidden-size {s['hidden']} --ffn-hidden-size {s['ffn']} "
        f"--num-attention-heads {s['heads']} --group-query-attention --num-query-groups {s['groups']} "
        f"--kv-channels {s['kv']} --seq-length {s['seq']} --max-position-embeddings {s['seq']} "
        f"--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 "
        f"--hidden-dropout 0.0 --swiglu --normalization RMSNorm --init-method-std 0.0134 --attention-backend fused "
        f"--apply-layernorm-1p --untie-embeddings-and-output-weights --disable-bias-linear",
        f"--micro-batch-size {s['mbs']} --global-batch-size {s['gbs']} --train-samples {s['samples']} "
        f"--lr-decay-samples {s['decay']} --lr-warmup-samples {s['warmup']} --lr {s['lr']} --min-lr {s['min_lr']}",
        "--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5" if decoupled else "",
        "--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 "
        "--grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc "
        "--empty-unused-memory-level 1 --exit-duration-in-mins 235",
        "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather"
        if fp8 else "",
        f"--tensor-model-parallel-size {s['tp']} --context-parallel-size {s['cp']} --sequence-parallel",
        "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather",
        f"--data-path {s['data']} {tokenizer} --data-cache-path {s['cache']} --split '99,1,0' "
        f"--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1 --vocab-size 128256",
        f"--log-interval {s['log']} --eval-iters {s['eval_iters']} --eval-interval {s['interval']} "
        f"--save-interval {s['save_interval']} --log-throughput --profile --profile-step-start {s['start']} "
        f"--profile-step-end {s['end']} --ckpt-format torch_dist --distributed-timeout-minutes 60 "
        f"--save {s['save']} --load {s['save']} --tensorboard-dir {s['tb']}",
    ]
    return " ".join(f for f in flags if f)


def megatron_lr(samples: float, lr: float, min_lr: float, warmup: float, decay: float, style: str = "cosine") -> float:
    """Megatron-LM's lr once ``samples`` samples are trained (its schedule counts samples): linear warmup
    from 0 up to ``warmup`` samples, then ``style`` from lr down to min_lr at ``decay`` samples, min_lr after."""
    if warmup > 0 and samples <= warmup:
        return lr * samples / warmup
    if style == "constant":
        return lr
    if samples > decay:
        return min_lr
    ratio = (samples - warmup) / (decay - warmup)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if style == "cosine" else 1.0 - ratio
    return min_lr + coeff * (lr - min_lr)


def translate(flags: str):
    return translate_megatron_args(flags, MEGATRON_MODELS)


def load(run, flags: str, tmp_path):
    """The config file ``run`` renders, loaded."""
    path = tmp_path / "megatron_run.py"
    path.write_text(render_config(run, flags))
    return LazyConfig.load(str(path))


def scheduler_of(cfg):
    """``train.scheduler`` built as the trainer builds it (max_iter and warmup_iter from train.*)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=float(cfg.optim.lr))
    warmup_iter = int(cfg.train.train_iter * float(cfg.train.warmup_ratio))
    return instantiate_with(cfg.train.scheduler, optimizer=opt, max_iter=cfg.train.train_iter,
                            warmup_iter=warmup_iter)


def test_gpt3_175b_script_keeps_megatron_schedule_and_defaults(tmp_path):
    flags = gpt3_175b()
    run = translate(flags)
    assert run.model.name == "projects/GPT" and run.resume
    a = run.assignments
    assert a["train.train_iter"] == 500000 and a["train.global_batch_size"] == 1536
    assert a["model.cfg.ffn_hidden_size"] == 4 * 12288 and a["model.cfg.activation"] == "gelu"
    # Megatron's defaults for what the script leaves out: 0.1 dropouts, eps 1e-8.
    assert a["model.cfg.output_dropout_prob"] == a["model.cfg.embedding_dropout_prob"] == 0.1
    assert a["model.cfg.attention_dropout_prob"] == 0.1 and a["optim.eps"] == 1e-8
    assert a["train.amp.dtype"] == "fp16" and a["train.amp.initial_scale"] == 2.0 ** 32
    assert run.parallel_sizes == {"tp": 8, "pp": 16, "cp": 1}
    assert [n.split(" ")[0] for n in run.no_effect] == ["--attention-backend", "--tensorboard-dir"]
    sched = scheduler_of(load(run, flags, tmp_path))
    # The decay ends at --lr-decay-iters (430000), 70000 iterations before the run; warmup .001 of the decay.
    for it in (0, 1, 429, 430, 431, 100000, 429999, 430000, 430001, 499999):
        assert sched.factor(it) * 6e-5 == pytest.approx(megatron_lr(it * 1536, 6e-5, 6e-6, 430 * 1536, 430000 * 1536),
                                                        rel=1e-12, abs=1e-18), it


def test_llama3_8b_script_builds_the_llama_project_with_its_sample_schedule(tmp_path):
    flags = llama3_8b(decoupled=False)
    run = translate(flags)
    assert run.model.name == "projects/Llama"
    a = run.assignments
    expected = {"hidden_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_size": 128, "max_seq_length": 8192, "rope_theta": 1e6,
                "tie_word_embeddings": False, "qkv_bias": False, "initializer_range": 0.0134,
                "output_dropout_prob": 0.0, "attention_dropout_prob": 0.0, "rope_scaling": None}
    assert {k[len("model.cfg."):]: v for k, v in a.items() if k.startswith("model.cfg.")} == {
        **expected, "layernorm_epsilon": 1e-5}
    assert a["train.train_iter"] == 1953125000 // 128
    assert a["train.fp8.enabled"] and a["train.fp8.recipe"] == "tensorwise"
    assert a["train.zero_optimization.stage"] == 1 and a["train.dist.sequence_parallel"]
    assert a["dataloader.train.cache_dir"] == "cache" and a["dataloader.train.splits_string"] == "99,1,0"
    assert a["train.dist.timeout"] == 3600
    # Megatron profiles steps [4, 6): torch.profiler waits 3, warms up 1, traces 2.
    assert (a["train.profile.wait"], a["train.profile.warmup"], a["train.profile.active"]) == (3, 1, 2)
    named = " ".join(run.no_effect)
    for switch in ("--use-mcore-models", "--overlap-grad-reduce", "--overlap-param-gather", "--manual-gc",
                   "--attention-backend", "--fp8-amax-history-len", "--ckpt-format", "--apply-layernorm-1p"):
        assert f"{switch} (" in named
    cfg = load(run, flags, tmp_path)
    assert cfg.model.cfg.num_key_value_heads == 8 and cfg.model._target_.__name__ == "LlamaForPreTraining"
    sched = scheduler_of(cfg)
    gbs = 128
    total = 1953125000 // gbs
    for it in (0, 1, 30517, 30518, 1000000, 15228271, 15228272, 15228273, total - 1):
        assert sched.factor(it) * 1.5e-4 == pytest.approx(
            megatron_lr(it * gbs, 1.5e-4, 1e-5, 3906252, 1949218748), rel=1e-12, abs=1e-18), it


def test_the_flags_make_the_config_the_project_config_writes_by_hand(tmp_path):
    """A shrunk Llama script is the Llama demo config with the same values written as overrides."""
    flags = llama3_8b(fp8=False, decoupled=False, layers=2, hidden=64, ffn=128, heads=4, groups=2, kv=16, seq=32,
                      mbs=2, gbs=8, samples=48, decay=40, warmup=12)
    ours = load(translate(flags), flags, tmp_path)
    theirs = LazyConfig.load(str(ROOT / "projects/Llama/configs/llama_demo.py"))
    theirs = LazyConfig.apply_overrides(theirs, [
        "model.cfg.hidden_layers=2", "model.cfg.hidden_size=64", "model.cfg.ffn_hidden_size=128",
        "model.cfg.num_attention_heads=4", "model.cfg.num_key_value_heads=2", "model.cfg.head_size=16",
        "model.cfg.max_seq_length=32", "model.cfg.rope_theta=1000000.0", "model.cfg.tie_word_embeddings=False",
        "model.cfg.initializer_range=0.0134", "model.cfg.output_dropout_prob=0.0",
        "model.cfg.attention_dropout_prob=0.0"])
    assert OmegaConf.to_container(ours.model) == OmegaConf.to_container(theirs.model)
    model = instantiate(ours.model)
    heads = model.llama.layers["0"].self_attention
    assert heads.num_key_value_heads == 2 and model.llama.lm_head.weight is not model.llama.embeddings.weight


def test_hugging_face_tokenizer_of_the_llama_script_is_built(tmp_path):
    from tests.tokenizer.test_tokenizer import write_hf_tokenizer

    write_hf_tokenizer(tmp_path)
    flags = llama3_8b(fp8=False, decoupled=False, tokenizer=f"--tokenizer-type HuggingFaceTokenizer "
                                                           f"--tokenizer-model {tmp_path}")
    from tokenizers import Tokenizer

    tokenizer = instantiate(load(translate(flags), flags, tmp_path).tokenization.tokenizer)
    text = "Return the number of items in a container."
    theirs = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert type(tokenizer).__name__ == "HuggingFaceTokenizer" and tokenizer.encode(text) == theirs


def test_every_flag_not_taken_is_reported_in_one_error_with_its_reason():
    flags = llama3_8b() + " --num-layer 4 --context-paralel-size 2 --step-batch-size-schedule 0:16 --moe-router-topk 2"
    with pytest.raises(UsageError) as e:
        translate(flags)
    message = str(e.value)
    assert message.startswith("4 problems with the Megatron flags, each with its reason: ")
    # In the order given; a suggestion only for a near miss.
    assert message.index("--num-layer (") < message.index("--context-paralel-size (")
    assert "--decoupled-lr" not in message
    assert "--num-layer (not known here; did you mean --num-layers?)" in message
    assert "--context-paralel-size (not known here; did you mean --context-parallel-size?)" in message
    assert "--step-batch-size-schedule (the global batch size is fixed" in message
    assert "--moe-router-topk (a mixture of experts" in message
    assert "did you mean" not in translate_error("--frobnicate 1")


def test_decoupled_lr_flags_map_to_the_embedding_and_output_layers_own_lr(tmp_path):
    flags = llama3_8b()
    run = translate(flags)
    assert run.assignments["optim.params.decoupled_lr"] == 5e-4
    assert run.assignments["optim.params.decoupled_min_lr"] == 4.5e-5
    cfg = load(run, flags, tmp_path)
    assert (cfg.optim.params.decoupled_lr, cfg.optim.params.decoupled_min_lr) == (5e-4, 4.5e-5)
    # Megatron's floor without --decoupled-min-lr is --min-lr; without --decoupled-lr the floor does nothing.
    only_peak = translate(llama3_8b(decoupled=False) + " --decoupled-lr 5e-4").assignments
    assert only_peak["optim.params.decoupled_min_lr"] == 1e-5
    only_floor = translate(llama3_8b(decoupled=False) + " --decoupled-min-lr 1e-5")
    assert "optim.params.decoupled_lr" not in only_floor.assignments
    assert any(n.startswith("--decoupled-min-lr") for n in only_floor.no_effect)
    assert "--decoupled-min-lr (" in translate_error("--decoupled-lr 1e-5 --decoupled-min-lr 1e-4")


def translate_error(extra: str) -> str:
    with pytest.raises(UsageError) as e:
        translate(gpt3_175b() + " " + extra)
    return str(e.value)


@pytest.mark.parametrize("extra, says", [
    ("--swiglu", "projects/Llama builds RMSNorm, rope positions, swiglu MLP, no linear biases (--normalization "
                 "RMSNorm, --position-embedding-type rope, --disable-bias-linear)"),
    ("--untie-embeddings-and-output-weights", "--untie-embeddings-and-output-weights (False for Megatron's "
                                              "share_embeddings_and_output_weights: projects/GPT builds True)"),
    ("--group-query-attention --num-query-groups 8", "--num-query-groups (8: projects/GPT has no setting for it"),
    ("--lr-decay-samples 10", "--lr-decay-samples (this run counts iters (--train-iters): give --lr-decay-iters)"),
    ("--fp8-format hybrid --fp8-recipe mxfp8", "--fp8-recipe mxfp8 (torchao's float8 here scales per tensor or "
                                               "per row"),
    ("--lr-decay-style WSD", "--lr-decay-style WSD (not built here; use cosine, linear, constant)"),
])
def test_a_model_or_schedule_not_built_here_is_refused_with_its_reason(extra, says):
    assert says in translate_error(extra)


def test_llama_refuses_dropout_after_the_embeddings():
    with pytest.raises(UsageError, match=r"--hidden-dropout \(0.1 for Megatron's embedding_dropout: "
                                         r"projects/Llama builds 0.0\)"):
        translate(llama3_8b(decoupled=False).replace("--hidden-dropout 0.0", ""))


def train_net(flags: str, *overrides):
    return python_tool([sys.executable, "tools/train_net.py", "--megatron-args", flags,
                        "dataloader.train.num_workers=0", "train.log_memory_estimate=False", *overrides], timeout=600)


def no_effect_line(r, out=None) -> str:
    """The start-up line naming the flags with no effect: logged once, on the console and (``out``) in log.txt."""
    marker = "Megatron flags with no effect here: "
    lines = [line[line.index(marker):] for line in r.stdout.splitlines() if marker in line]
    assert len(lines) == 1 and marker not in r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    if out is not None:
        assert lines[0] in (out / "log.txt").read_text()
    return lines[0]


def test_gpt3_175b_script_shrunk_trains_with_its_decay_shorter_than_the_run(tmp_path):
    out = tmp_path / "ckpt"
    # The decay ends at iteration 4 of 5; the warmup is .3 of the decay: 1.2 iterations. --fp16 starts at
    # Megatron's 2**32 loss scale, whose first steps overflow and are skipped: a smaller start lets 5 steps train.
    flags = gpt3_175b(layers=2, hidden=64, heads=4, seq=32, mbs=2, gbs=8, iters=5, decay=4, warmup=".3", tp=1, pp=1,
                      lr="6.0e-4", min_lr="6.0e-5", save=out, tb=tmp_path / "tb", log=1, interval=2, eval_iters=1,
                      data="data_test/gpt2/demo_gpt2_text_document", save_interval=100) + " --initial-loss-scale 1024"
    r = train_net(flags, f"dataloader.train.cache_dir={tmp_path / 'cache'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--attention-backend (" in no_effect_line(r) and "--tensorboard-dir (" in no_effect_line(r, out)
    assert "Model GPTForPreTraining" in (out / "log.txt").read_text()
    lrs, loss = losses(out, "lr"), losses(out)
    assert sorted(lrs) == [1, 2, 3, 4, 5] and all(math.isfinite(v) for v in loss.values())
    # metrics.json's iteration k is the k-th step, which trains at the lr of k - 1 steps done.
    for k, lr in lrs.items():
        assert lr == pytest.approx(megatron_lr((k - 1) * 8, 6e-4, 6e-5, 1.2 * 8, 4 * 8), rel=1e-6), k
    evaluated = [json.loads(line) for line in open(out / "metrics.json") if "valid/PPL" in line]
    assert evaluated, "the valid split of --split 949,50,1 was not evaluated"


def test_llama3_8b_script_shrunk_trains_the_llama_project(tmp_path):
    out = tmp_path / "ckpt"
    # The script's DTYPE=bf16 branch (FP8 needs an H100); with its --decoupled-lr. The data
    # are data_test's SentencePiece corpus, read with Megatron's SentencePieceTokenizer.
    spm = "--tokenizer-type SentencePieceTokenizer --tokenizer-model data_test/spm/spiece.model"
    flags = llama3_8b(fp8=False, tokenizer=spm, layers=2, hidden=64, ffn=128, heads=4, groups=2,
                      kv=16, seq=32, mbs=2, gbs=8, samples=48, decay=40, warmup=12, data=
                      "data_test/spm/demo_spm_text_document", cache=tmp_path / "cache", eval_iters=2, interval=3,
                      save=out, tb=tmp_path / "tb")
    r = train_net(flags)
    assert r.returncode == 0, r.stderr[-3000:]
    named = no_effect_line(r)
    assert all(f"{s} (" in named for s in ("--use-mcore-models", "--overlap-grad-reduce", "--manual-gc"))
    assert "Model LlamaForPreTraining" in (out / "log.txt").read_text()
    lrs, loss = losses(out, "lr"), losses(out)
    assert sorted(lrs) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in loss.values())
    for k, lr in lrs.items():  # 48 samples of 8 a step: warmup 12 samples, decay ends at 40
        assert lr == pytest.approx(megatron_lr((k - 1) * 8, 1.5e-4, 1e-5, 12, 40), rel=1e-6), k
    # --split '99,1,0': the valid split is evaluated, the test split (no share) is not built.
    assert any("valid/PPL" in line for line in open(out / "metrics.json"))
    assert list((out / "profile").glob("trace_iter0000005_rank*.json"))  # steps [4, 6)


def test_unknown_flags_are_one_error_line_of_train_net():
    r = train_net("--num-layer 2 --hidden-size 64 --frobnicate")
    assert r.returncode == 1
    line = one_error_line(r)
    assert line.startswith("error: ") and "--num-layer (not known here; did you mean --num-layers?)" in line
    assert "--frobnicate (not known here)" in line and "--lr (missing" in line


@pytest.mark.skipif("--megatron-args" not in (ROOT / "tools/train.sh").read_text(),
                    reason="tools/train.sh does not take --megatron-args yet")
def test_train_sh_carries_the_megatron_args_to_two_ranks(tmp_path):
    from tests.launch import free_port

    out = tmp_path / "ckpt"
    flags = gpt3_175b(layers=2, hidden=64, heads=4, seq=32, mbs=2, gbs=8, iters=2, decay=2, warmup="0", tp=1, pp=1,
                      save=out, tb=tmp_path / "tb", log=1, interval=100, eval_iters=0, save_interval=100,
                      data="data_test/gpt2/demo_gpt2_text_document").replace("--fp16", "")
    r = subprocess.run(["bash", "tools/train.sh", "tools/train_net.py", "--megatron-args", flags, "2",
                        "dataloader.train.num_workers=0", "train.log_memory_estimate=False",
                        f"dataloader.train.cache_dir={tmp_path / 'cache'}"],
                       cwd=ROOT, env=env(PORT=str(free_port())), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dp=2" in (out / "log.txt").read_text() and sorted(losses(out)) == [1, 2]
    assert r.stdout.count("Megatron flags with no effect here:") == 1  # rank 0 names them



def megatron_deepspeed_gpt2(ds_config, **size) -> str:
    """Megatron-DeepSpeed's examples/ds_pretrain_gpt2.sh flags (Megatron-LM 1.x names: --model-parallel-size,
    --batch-size per GPU, --gas, --warmup as a fraction), with its ZeRO and checkpointing tuning flags."""
    s = dict(mp=2, layers=24, hidden=1024, heads=16, seq=1024, mbs=8, gas=1, iters=320000, save="ckpt",
             data="my_gpt2_text_document")
    s.update(size)
    return (f"--model-parallel-size {s['mp']} --num-layers {s['layers']} --hidden-size {s['hidden']} "
            f"--num-attention-heads {s['heads']} --seq-length {s['seq']} --max-position-embeddings {s['seq']} "
            f"--batch-size {s['mbs']} --gas {s['gas']} --train-iters {s['iters']} --lr-decay-iters {s['iters']} "
            f"--save {s['save']} --load {s['save']} --data-path {s['data']} --vocab-file data_test/gpt2/vocab.json "
            "--merge-file data_test/gpt2/merges.txt --data-impl mmap --split 949,50,1 --distributed-backend nccl "
            "--lr 1.5e-4 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 --warmup 0.01 "
            "--checkpoint-activations --log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 "
            f"--fp16 --deepspeed --deepspeed_config {ds_config} --zero-stage 1 --zero-reduce-bucket-size 50000000 "
            "--zero-allgather-bucket-size 5000000000 --zero-contigious-gradients --zero-reduce-scatter "
            "--deepspeed-activation-checkpointing --partition-activations --contigious-checkpointing "
            "--checkpoint-in-cpu --synchronize-each-layer")


def _ds_gpt2_config(path, train_batch, micro, gas):
    import json

    path.write_text(json.dumps({"train_batch_size": train_batch, "train_micro_batch_size_per_gpu": micro,
                                "gradient_accumulation_steps": gas, "steps_per_print": 1,
                                "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
                                "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000,
                                         "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 10},
                                "wall_clock_breakdown": False}))
    return path


def test_megatron_deepspeed_gpt2_script_translates_its_megatron_1x_flags(tmp_path):
    """--model-parallel-size, --batch-size, --gas and --warmup were 'not known here'; its ZeRO bucket flags too."""
    run = translate(megatron_deepspeed_gpt2(_ds_gpt2_config(tmp_path / "ds.json", 64, 8, 4), gas=4))
    a = run.assignments
    assert a["train.dist.tensor_parallel_size"] == 2 and a["train.train_micro_batch_size"] == 8
    assert a["train.num_accumulation_steps"] == 4 and a["train.zero_optimization.stage"] == 1
    assert a["train.amp.initial_scale"] == 1024.0 and a["train.activation_checkpoint.enabled"]
    assert run.scheduler["warmup_fraction"] == 0.01 and run.scheduler["decay_iters"] == 320000
    named = " ".join(run.no_effect)
    for flag in ("--zero-reduce-bucket-size", "--zero-allgather-bucket-size", "--zero-contigious-gradients",
                 "--zero-reduce-scatter", "--contigious-checkpointing", "--checkpoint-in-cpu",
                 "--synchronize-each-layer"):
        assert f"{flag} (" in named, flag


@pytest.mark.skipif("--megatron-args" not in (ROOT / "tools/train.sh").read_text(),
                    reason="tools/train.sh does not take --megatron-args yet")
def test_megatron_deepspeed_gpt2_script_shrunk_trains_on_two_ranks_with_its_ds_config(tmp_path):
    from tests.launch import free_port

    out = tmp_path / "ckpt"
    ds = _ds_gpt2_config(tmp_path / "ds.json", 8, 2, 2)
    flags = megatron_deepspeed_gpt2(ds, mp=1, layers=2, hidden=64, heads=4, seq=32, mbs=2, gas=2, iters=3, save=out,
                                    data="data_test/gpt2/demo_gpt2_text_document")
    r = subprocess.run(["bash", "tools/train.sh", "tools/train_net.py", "--megatron-args", flags, "2",
                        "dataloader.train.num_workers=0", "train.log_memory_estimate=False",
                        f"dataloader.train.cache_dir={tmp_path / 'cache'}"],
                       cwd=ROOT, env=env(PORT=str(free_port())), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (out / "log.txt").read_text()
    assert "dp=2" in log and "global batch 8 = micro 2 x dp 2 x accumulation 2" in log, log[-3000:]
    assert sorted(losses(out)) == [1, 2, 3]
    assert "--zero-reduce-bucket-size (" in log  # the no-effect line, in the run's log
