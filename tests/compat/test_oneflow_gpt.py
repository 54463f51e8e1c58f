"""OneFlow-GPT's command lines (Oneflow-Inc/OneFlow-Benchmark LanguageModeling/GPT) as its README writes them.

Training: ``python3 -m oneflow_gpt.training FLAGS`` runs here as ``tools/train_net.py --megatron-args "FLAGS"``
(its flag names read beside Megatron's); preprocessing: its ``tools/preprocess_data.py`` line, whose ``--vocab``
is ``--vocab-file``. The 345M line below is written out here (not copied); the runs shrink only its sizes,
paths and iterations.
"""
import json
import sys

import pytest
from omegaconf import OmegaConf

from compat.megatron import MEGATRON_MODELS, translate_megatron_args
from libai_lite.utils.errors import UsageError
from tests.compat.test_megatron_scripts import gpt3_175b, load, train_net
from tests.launch import ROOT, losses, one_error_line, python_tool


def oneflow_345m(**size) -> str:
    """OneFlow-GPT's 345M training line (its README's flags, launched on one GPU of one node)."""
    s = dict(layers=24, hidden=1024, heads=16, seq=1024, mbs=8, gbs=16, acc=1, iters=500000, decay=320000,
             data="gpt_sample_dataset_text_document", vocab=50257, log=10, save="model_save", save_interval=10000)
    s.update(size)
    return (f"--num-layers {s['layers']} --hidden-size {s['hidden']} --num-attention-heads {s['heads']} "
            f"--max-seq-length {s['seq']} --num-gpus-per-node 1 --num-nodes 1 --node-ips 127.0.0.1 "
            f"--micro-batch-size {s['mbs']} --global-batch-size {s['gbs']} --num-accumulation-steps {s['acc']} "
            f"--train-iters {s['iters']} --learning-rate 0.00015 --min-lr 1e-05 --lr-decay-style cosine "
            f"--lr-decay-iters {s['decay']} --lr-warmup-fraction 0.01 --optimizer adamw "
            f"--initial-loss-scale 4294967296 --weight-decay 0.01 --dataset {s['data']} --split 949,50,1 "
            f"--vocab-size {s['vocab']} --checkpoint-activations --multihead-attention-fusion --fp16 "
            f"--log-interval {s['log']} --save {s['save']} --save-interval {s['save_interval']}")


def gpt2_record(prefix, size=50257):
    """The tokenizer record preprocess_data.py writes beside a GPT-2 BPE corpus."""
    return {"tokenizer_type": "GPT2BPETokenizer", "vocab_size": size,
            "files": {"vocab_file": "gpt2-vocab.json", "merges_file": "gpt2-merges.txt"}}


def translate(flags, record=gpt2_record):
    return translate_megatron_args(flags, MEGATRON_MODELS, corpus_record=record)


def test_oneflow_345m_line_is_read_as_megatron_flags():
    run = translate(oneflow_345m())
    a = run.assignments
    assert a["optim.lr"] == 1.5e-4 and a["dataloader.train.data_prefix"] == "gpt_sample_dataset_text_document"
    assert a["model.cfg.max_seq_length"] == 1024 and a["model.cfg.hidden_layers"] == 24
    assert (a["train.train_micro_batch_size"], a["train.global_batch_size"], a["train.num_accumulation_steps"]) == (
        8, 16, 1)
    assert a["train.amp.initial_scale"] == 2.0 ** 32 and a["train.activation_checkpoint.mode"] == "full"
    assert run.scheduler == {"decay": "cosine", "min_lr_ratio": pytest.approx(1e-5 / 1.5e-4), "init_lr_ratio": 0.0,
                             "decay_iters": 320000, "warmup_fraction": 0.01}
    assert a["tokenization.tokenizer"].kwargs == {"vocab_file": "gpt2-vocab.json", "merges_file": "gpt2-merges.txt"}
    named = " ".join(run.no_effect)
    assert "--num-gpus-per-node (the launcher takes it: NPROC of bash tools/train.sh" in named
    assert "--num-nodes (the launcher takes it: NODE=" in named and "--node-ips (the launcher takes it: ADDR" in named
    assert "--multihead-attention-fusion (attention is fused by default" in named
    assert "--vocab-size (the tokenizer is the one gpt_sample_dataset_text_document was made with" in named


def test_oneflow_readme_line_resumes_its_checkpoint_directory():
    """The README's own line: --seq-length, --load and --save the same directory, no --num-accumulation-steps."""
    flags = ("--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --micro-batch-size 4 --global-batch-size 8 "
             "--num-gpus-per-node 1 --train-iters 500000 --learning-rate 0.00015 --dataset gpt_sample_dataset_text_"
             "document --seq-length 1024 --split 949,50,1 --min-lr 1.0e-5 --lr-decay-style cosine --lr-decay-iters "
             "320000 --lr-warmup-fraction 0.01 --weight-decay 1e-2 --optimizer adamw --clip-grad 1.0 --vocab-size "
             "50257 --load checkpoint --save checkpoint --save-interval 10000 --log-interval 100 "
             "--checkpoint-activations --multihead-attention-fusion --fp16")
    run = translate(flags)
    assert run.resume and run.assignments["train.num_accumulation_steps"] is None  # derived from the launch
    assert run.assignments["optim.lr"] == 1.5e-4 and run.assignments["model.cfg.max_seq_length"] == 1024


def test_megatron_optimizer_adam_is_adamw(tmp_path):
    """Megatron-LM's --optimizer adam decays weights decoupled (apex FusedAdam's AdamW mode): the base AdamW."""
    flags = gpt3_175b() + " --optimizer adam"
    cfg = load(translate_megatron_args(flags, MEGATRON_MODELS), flags, tmp_path)
    assert cfg.optim._target_.__name__ == "AdamW" and cfg.optim.weight_decay == 0.1


def test_oneflow_flags_not_taken_are_reported_together():
    flags = oneflow_345m() + " --optimizer sgd --lr 1e-4 --save-init --num-accumulation-steps 0"
    with pytest.raises(UsageError) as e:
        translate(flags, lambda prefix: gpt2_record(prefix, size=8000))
    message = str(e.value)
    assert message.startswith("5 problems with the Megatron flags")
    assert "--vocab-size (50257, but the corpus gpt_sample_dataset_text_document was made with a tokenizer of " \
           "8000 tokens" in message
    assert "--optimizer sgd (the optimizer these flags build is AdamW; for SGD write a config" in message
    assert "--lr (means the same as --learning-rate, given too: give one)" in message
    assert "--save-init (no checkpoint of the initial weights is written here" in message
    assert "--num-accumulation-steps (0 is not a positive number of micro-batches)" in message


def test_a_corpus_without_tokenizer_record_asks_for_the_gpt2_files():
    with pytest.raises(UsageError, match=r"--tokenizer-type \(missing: .* give --vocab-file gpt2-vocab.json "
                                         r"--merge-file gpt2-merges.txt\)"):
        translate(oneflow_345m(), lambda prefix: None)
    run = translate(oneflow_345m() + " --vocab-file v.json --merge-file m.txt", lambda prefix: None)
    assert run.assignments["tokenization.tokenizer"].kwargs == {"vocab_file": "v.json", "merges_file": "m.txt"}


def test_oneflow_345m_line_shrunk_trains_with_the_settings_it_asks(tmp_path):
    out = tmp_path / "model_save"
    # The demo corpus's tokenizer has 8000 tokens (its record names it); two micro-batches of 2 per step.
    flags = oneflow_345m(layers=2, hidden=64, heads=4, seq=32, mbs=2, gbs=4, acc=2, iters=3, decay=2,
                         data="data_test/gpt2/demo_gpt2_text_document", vocab=8000, log=1, save=out,
                         save_interval=100)
    r = train_net(flags, f"dataloader.train.cache_dir={tmp_path / 'cache'}")
    assert r.returncode == 0, r.stderr[-3000:]
    # Logged at start-up: on the console and in log.txt.
    assert "--num-gpus-per-node (the launcher takes it" in r.stdout
    assert "--num-gpus-per-node (the launcher takes it" in (out / "log.txt").read_text()
    cfg = OmegaConf.load(out / "config.yaml")
    assert cfg.optim.lr == 1.5e-4 and cfg.optim._target_ == "torch.optim.AdamW"
    assert cfg.train.scheduler.min_lr_ratio == pytest.approx(1e-5 / 1.5e-4)
    assert cfg.train.scheduler.warmup_fraction == 0.01 and cfg.train.scheduler.decay_iters == 2
    # config.yaml leaves the accumulation to each launch's data-parallel size; its header records this one's.
    assert (cfg.train.train_micro_batch_size, cfg.train.global_batch_size) == (2, 4)
    assert "global batch 4 = micro 2 x dp 1 x accumulation 2." in (out / "config.yaml").read_text()
    assert cfg.train.amp.enabled and cfg.train.amp.dtype == "fp16" and cfg.train.amp.initial_scale == 2.0 ** 32
    assert cfg.train.activation_checkpoint.enabled and cfg.train.activation_checkpoint.mode == "full"
    assert cfg.tokenization.tokenizer.vocab_file == "data_test/gpt2/vocab.json"
    assert sorted(losses(out)) == [1, 2, 3]


def preprocess(tmp_path, name, vocab_flag, impl="mmap"):
    """OneFlow-GPT's README preprocessing line on the corpus of ``write_corpus``, its vocab given by ``vocab_flag``."""
    return python_tool([sys.executable, "tools/preprocess_data.py", "--input", str(tmp_path / "data.json"),
                        "--output-prefix", str(tmp_path / name), vocab_flag, "data_test/gpt2/vocab.json",
                        "--merge-file", "data_test/gpt2/merges.txt", "--dataset-impl", impl, "--tokenizer-type",
                        "GPT2BPETokenizer", "--append-eod", "--workers", "2"])


def write_corpus(tmp_path):
    rows = [{"src": "www.nvidia.com", "text": "The quick brown fox", "type": "Eng", "id": "0", "title": "First"},
            {"src": "The Internet", "text": "jumps over the lazy dog", "type": "Eng", "id": "42", "title": "Second"}]
    rows += [{"text": f"Document {i}: a few words of text, again and again. " * (i % 5 + 1)} for i in range(40)]
    (tmp_path / "data.json").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_oneflow_preprocessing_line_writes_what_vocab_file_writes(tmp_path):
    write_corpus(tmp_path)
    for name, flag in (("oneflow", "--vocab"), ("megatron", "--vocab-file")):
        r = preprocess(tmp_path, name, flag)
        assert r.returncode == 0, r.stderr[-3000:]
    for ext in ("bin", "idx"):
        ours = (tmp_path / f"oneflow_text_document.{ext}").read_bytes()
        assert ours and ours == (tmp_path / f"megatron_text_document.{ext}").read_bytes(), ext


def test_a_dataset_impl_other_than_mmap_is_refused_in_one_line(tmp_path):
    write_corpus(tmp_path)
    r = preprocess(tmp_path, "cached", "--vocab", impl="cached")
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if "error: " in line]
    assert len(errors) == 1 and "--dataset-impl cached is not written here: only mmap" in errors[0], r.stderr
    assert not list(tmp_path.glob("cached*"))
