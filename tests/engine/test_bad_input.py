"""Every bad input in docs/bad_input.md, run the way a user runs it: one `error:` line that names the
problem and the fix, a non-zero exit, and no file written, changed or deleted.

The table in docs/bad_input.md is the contract: each row names a case here and quotes the part of
the message this test checks, so the documentation cannot drift from what users see.
"""
import contextlib
import re
import shutil
import socket
import subprocess
import struct

import numpy as np
import pytest

from tests.launch import CONFIG, DATA, ROOT, env, one_error_line, tiny, train_net, train_sh, tree_snapshot
from libai_lite.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder

DOC = ROOT / "docs" / "bad_input.md"


def _copy_data(tmp_path):
    dst = tmp_path / "data" / "demo"
    dst.parent.mkdir(parents=True, exist_ok=True)
    for ext in (".bin", ".idx"):
        shutil.copy(ROOT / (DATA + ext), str(dst) + ext)
    return dst


def _data(tmp_path, damage):
    prefix = _copy_data(tmp_path)
    damage(prefix)
    return [f"dataloader.train.data_prefix={prefix}"]


def _truncate(suffix, size):
    def damage(prefix):
        path = str(prefix) + suffix
        with open(path, "r+b") as f:
            f.truncate(size if size >= 0 else max(0, len(open(path, "rb").read()) + size))
    return damage


def _poke(offset, data):
    def damage(prefix):
        with open(str(prefix) + ".idx", "r+b") as f:
            f.seek(offset)
            f.write(data)
    return damage


def _ids_beyond_vocab(tmp_path):
    prefix = tmp_path / "big" / "ids"
    b = MMapIndexedDatasetBuilder(str(prefix), np.int32)
    src = MMapIndexedDataset(str(ROOT / DATA))
    for i in range(len(src)):
        doc = src[i].astype(np.int32)
        if i == 3:
            doc[0] = 9000
        b.add_item(doc)
        b.end_document()
    b.finalize()
    return [f"dataloader.train.data_prefix={prefix}"]


def _bad_config(tmp_path):
    bad = tmp_path / "bad_config.py"
    bad.write_text("from configs.common.train import train\nraise RuntimeError('boom in config')\n")
    return str(bad)


def _config_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _checkpoint(tmp_path, *extra):
    """A finished tiny run's output dir with its final checkpoint (made before the snapshot)."""
    src = tmp_path / "prev"
    r = train_net(tiny(src, tmp_path / "cache", "train.train_iter=2", "train.evaluation.enabled=False", *extra))
    assert r.returncode == 0, r.stderr[-3000:]
    return src


def _corrupt_resume(tmp_path):
    src = _checkpoint(tmp_path)
    ckpt = src / (src / "last_checkpoint").read_text().strip()
    (ckpt / ".metadata").write_bytes(b"garbage")
    return src


# case id -> (what the case needs; returns (overrides, config, output dir or None, nproc)), message part.
def _case(tmp_path, case):
    out = tmp_path / "out"
    cfg = CONFIG
    nproc = 1
    if case == "unknown_key":
        extra = ["train.train_iters=5"]
    elif case == "wrong_type":
        extra = ["train.train_iter=abc"]
    elif case == "missing_config":
        extra, cfg = [], "projects/GPT/configs/nope.py"
    elif case == "config_fails_to_import":
        extra, cfg = [], _bad_config(tmp_path)
    elif case == "missing_data":
        extra = [f"dataloader.train.data_prefix={tmp_path / 'nope'}"]
    elif case == "truncated_bin":
        extra = _data(tmp_path, _truncate(".bin", 4096))
    elif case == "truncated_idx":
        extra = _data(tmp_path, _truncate(".idx", 1000))
    elif case == "idx_wrong_magic":
        extra = _data(tmp_path, _poke(0, b"NOTANIDX!"))
    elif case == "idx_wrong_version":
        extra = _data(tmp_path, _poke(9, struct.pack("<Q", 7)))
    elif case == "idx_pointer_past_bin":
        # The 101st sequence's byte offset (after the 9+8+1+8+8 header and 3189 int32 sizes) runs past the .bin.
        extra = _data(tmp_path, _poke(34 + 3189 * 4 + 100 * 8, struct.pack("<q", 10 ** 9)))
    elif case == "ids_beyond_vocab":
        extra = _ids_beyond_vocab(tmp_path)
    elif case == "missing_tokenizer_file":
        extra = [f"tokenization.tokenizer.vocab_file={tmp_path / 'vocab.json'}"]
    elif case == "tokenizer_not_matching_config":
        # A BERT WordPiece vocab.txt handed to the GPT-2 BPE tokenizer the config names.
        extra = [f"tokenization.tokenizer.vocab_file={ROOT / 'data_test/bert/vocab.txt'}"]
    elif case == "corpus_of_another_tokenizer":
        # The BERT WordPiece demo corpus under the config's GPT-2 tokenizer: 8,000 ids each, so every id fits.
        extra, nproc = [f"dataloader.train.data_prefix={ROOT / 'data_test/bert/demo_bert_text_document'}"], 2
    elif case == "empty_merges_file":
        (tmp_path / "merges.txt").write_text("#version: 0.2\n")
        extra = [f"tokenization.tokenizer.merges_file={tmp_path / 'merges.txt'}"]
    elif case == "batch_not_divisible":
        extra = ["train.global_batch_size=10"]
    elif case == "layout_not_fitting_world":
        # Without strict_layout the size is capped to the world (LiBai's rule) and the run goes on.
        extra = ["train.dist.tensor_parallel_size=2", "train.dist.strict_layout=True"]
    elif case == "layout_not_fitting_model":
        extra, nproc = ["train.dist.tensor_parallel_size=2", "model.cfg.num_attention_heads=3",
                        "model.cfg.hidden_size=66"], 2
    elif case == "resume_corrupt_checkpoint":
        out = _corrupt_resume(tmp_path)
        extra = ["--resume"]
    elif case == "load_weight_other_shape":
        src = _checkpoint(tmp_path)
        extra = [f"train.load_weight={src / 'model_final'}", "model.cfg.hidden_size=32"]
    elif case == "section_null":
        extra = ["model=null"]
    elif case == "yaml_top_level_list":
        extra, cfg = [], _config_file(tmp_path, "list.yaml", "- model\n- train\n")
    elif case == "config_without_sections":
        extra, cfg = [], _config_file(tmp_path, "no_model.py", "from configs.common.train import train\n")
    elif case == "evaluator_not_an_evaluator":
        # Its first use was the evaluation at the end of training, after the run had written its files.
        extra = ["train.evaluation.enabled=True", "train.evaluation.evaluator._target_=torch.nn.Identity"]
    elif case == "last_checkpoint_garbled":
        out = _checkpoint(tmp_path)
        (out / "last_checkpoint").write_bytes(b"\xff\xfe\x00\x01junk")
        extra = ["--resume"]
    elif case == "cache_dir_not_a_directory":
        (tmp_path / "a_file").write_text("x")
        extra = [f"dataloader.train.cache_dir={tmp_path / 'a_file' / 'cache'}"]
    elif case == "target_typo":
        extra = ["optim._target_=torch.optim.Adamz"]
    elif case == "output_dir_not_writable":
        blocker = tmp_path / "a_file"
        blocker.write_text("x")
        out = blocker / "out"
        extra = []
    else:
        raise KeyError(case)
    return tiny(out, tmp_path / "cache", "train.train_iter=2", *extra), cfg, out, nproc


NEEDLES = {
    "unknown_key": "did you mean 'train.train_iter'",
    "wrong_type": "train.train_iter",
    "missing_config": "nope.py",
    "config_fails_to_import": "boom in config",
    "missing_data": "tools/preprocess_data.py",
    "truncated_bin": "is truncated",
    "truncated_idx": "is truncated",
    "idx_wrong_magic": "is not a Megatron mmap index",
    "idx_wrong_version": "has index version 7",
    "ids_beyond_vocab": "9000",
    "missing_tokenizer_file": "vocab.json",
    "tokenizer_not_matching_config": "vocab.txt",
    "corpus_of_another_tokenizer": "was tokenized with BertWordPieceLowerCase (data_test/bert/vocab.txt; 8002 ids",
    "empty_merges_file": "merges.txt holds no merges (it is empty or has only its #version header)",
    "batch_not_divisible": "not divisible",
    "layout_not_fitting_world": "but 1 were launched",
    "layout_not_fitting_model": "does not divide model.cfg.num_attention_heads=3",
    "idx_pointer_past_bin": "is corrupt: sequence 100 ",
    "resume_corrupt_checkpoint": "has 7 bytes but",
    "load_weight_other_shape": "another model shape; model.cfg.hidden_size=32 gives 32 where it has 64",
    "output_dir_not_writable": "not writable",
    "target_typo": "optim._target_='torch.optim.Adamz' cannot be imported: 'torch.optim' has no attribute 'Adamz' "
                   "(did you mean 'torch.optim.Adam'",
    "evaluator_not_an_evaluator": "train.evaluation.evaluator._target_='torch.nn.Identity' is not an evaluator: "
                                  "it has neither reset, process and evaluate",
    "last_checkpoint_garbled": "last_checkpoint holds b'\\xff\\xfe\\x00\\x01junk', not the name of a checkpoint "
                               "directory",
    "cache_dir_not_a_directory": "a_file is a file); set dataloader.train.cache_dir to a writable directory",
    "section_null": "model=null is not a config section: it must hold the model to build, a LazyCall with _target_; "
                    "remove the override that set it",
    "yaml_top_level_list": "list.yaml holds a list at its top level, not a mapping of names to sections",
    "config_without_sections": "no_model.py defines no model, optim, dataloader: a training config defines model, "
                               "optim, dataloader and train at its top level",
}


@pytest.mark.parametrize("case", list(NEEDLES))
def test_bad_input_is_one_line_nonzero_and_changes_nothing(tmp_path, case):
    args, cfg, out, nproc = _case(tmp_path, case)
    existed = out.exists()
    before = tree_snapshot(tmp_path)
    r = train_sh(nproc, args, config=cfg, timeout=180) if nproc > 1 else train_net(args, config=cfg, timeout=180)
    assert r.returncode != 0
    line = one_error_line(r)
    assert NEEDLES[case] in line, line
    assert out.exists() == existed
    assert tree_snapshot(tmp_path) == before, "a refused run wrote, changed or deleted files"


@pytest.mark.parametrize("where", ["a_file", "a_file/cache", "read-only"])
def test_a_cache_dir_that_cannot_hold_the_index_cache_is_one_line_and_changes_nothing(tmp_path, where):
    """A regular file, a path under one, a read-only filesystem (a bind mount, where mounting is permitted)."""
    (tmp_path / "a_file").write_text("x")
    with contextlib.ExitStack() as stack:
        cache = tmp_path / where
        if where == "read-only":
            cache = stack.enter_context(_read_only_dir(tmp_path / "ro"))
        before = tree_snapshot(tmp_path)
        r = train_net(tiny(tmp_path / "out", cache, "train.train_iter=2"), timeout=180)
        assert r.returncode == 1
        line = one_error_line(r)
        reason = "Read-only file system" if where == "read-only" else f"{tmp_path / 'a_file'} is a file"
        assert line == (f"error: cannot write the dataset's index cache at {cache} ({reason}); set "
                        f"dataloader.train.cache_dir to a writable directory (null caches beside the data)"), line
        assert tree_snapshot(tmp_path) == before and not (tmp_path / "out").exists()


@contextlib.contextmanager
def _read_only_dir(path):
    """``path`` as a read-only bind mount of an empty folder (skipped where mounting is not permitted)."""
    src = path.with_name(path.name + "_src")
    src.mkdir()
    path.mkdir()
    r = subprocess.run(["mount", "--bind", str(src), str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"a read-only bind mount needs root or CAP_SYS_ADMIN: {r.stderr.strip()}")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True).returncode != 0:
            pytest.skip("remounting read-only is not permitted")
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)


def test_port_in_use_is_one_line_and_changes_nothing(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(["bash", "tools/train.sh", "tools/train_net.py", CONFIG, "1",
                            f"train.output_dir={tmp_path / 'out'}"], cwd=ROOT, env=env(PORT=str(port)),
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert f"port {port}" in one_error_line(r)
    assert list(tmp_path.iterdir()) == []


def test_resume_without_checkpoint_warns_and_starts_fresh(tmp_path):
    out = tmp_path / "out"
    r = train_net(tiny(out, tmp_path / "cache", "train.train_iter=2", "train.evaluation.enabled=False") + ["--resume"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "has no last_checkpoint: starting from scratch" in (out / "log.txt").read_text()


# Rows of docs/bad_input.md whose cases are tested in the files their rows name.
TESTED_ELSEWHERE = {
    "value_out_of_range", "unknown_key_in_dict_override", "output_dir_in_use", "disk_full_while_logging",
    "checkpoint_bytes_flipped", "checkpoint_of_a_larger_model", "trainer_state_garbled", "preprocess_disk_full",
    "split_sentences_without_nltk", "packing_without_eod", "wandb_not_installed", "plot_without_metrics",
    "harness_not_installed", "harness_without_checkpoint", "harness_unknown_model_arg", "fp8_on_a_cpu",
    "cp_encoder_decoder", "cp_sequence_not_divisible", "t5_dataset_not_sentence_split",
    "slurm_outside_a_job", "checkpoint_of_another_tokenizer", "tp_not_dividing_vocab", "index_beyond_memory",
    "eval_iter_beyond_valid_split", "optim_unknown_argument", "estimate_layout_capped", "libai_config_without_dialect",
    "tool_output_is_its_input", "valid_split_without_documents",
    "vocab_size_below_tokenizer", "hf_import_tp_not_dividing_model",
    "preprocess_empty_texts", "hf_export_computes_otherwise", "preprocess_damaged_gzip", "preprocess_text_not_a_string",
    "estimate_device_memory_not_positive", "dataloader_worker_killed",
    "hf_import_weights_of_another_size", "tool_output_not_writable", "out_of_memory",
}


def _doc_rows():
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`([a-z0-9_]+)`", cells[-1]) if len(cells) >= 3 else None
        if m:
            rows[m.group(1)] = cells
    return rows


def test_the_documented_table_lists_every_case_with_the_message_this_test_checks():
    rows = _doc_rows()
    tested = set(NEEDLES) | {"port_in_use", "resume_without_checkpoint", "disk_full_during_save",
                             "collective_timeout"} | TESTED_ELSEWHERE
    assert set(rows) == tested, f"docs/bad_input.md rows {sorted(rows)} != tested cases {sorted(tested)}"
    for case, needle in NEEDLES.items():
        assert needle in rows[case][-2].replace("\\|", "|"), (case, needle)


# Configs and overrides that leave out a section a training reads -> the part of the one-line message checked
# (the file as the launcher loads it, checked before and after the overrides, in process).
SECTIONS = {
    "train.dist=null": "train.dist=null is not a config section: it must hold the parallel layout",
    "~train.dist": "train.dist is missing from the config: it holds the parallel layout",
    "~dataloader.train": "dataloader.train is missing from the config: it holds the training data",
    "empty.yaml": "empty.yaml defines no model, optim, dataloader, train: a training config defines",
    "no_model.py": "no_model.py defines no model, optim, dataloader:",
    "hello.yaml": "hello.yaml defines no model, optim, dataloader, train:",
}


@pytest.mark.parametrize("case", list(SECTIONS))
def test_a_config_without_a_section_a_training_reads_is_refused_before_and_after_the_overrides(tmp_path, case):
    from libai_lite.config import LazyConfig
    from libai_lite.config.validate import check_sections
    from libai_lite.utils.errors import UsageError

    texts = {"empty.yaml": "", "no_model.py": "from configs.common.train import train\n", "hello.yaml": "hello\n"}
    config = _config_file(tmp_path, case, texts[case]) if case in texts else str(ROOT / CONFIG)
    overrides = [] if case in texts else [case]
    with pytest.raises(UsageError) as e:
        cfg = LazyConfig.load(config)
        check_sections(cfg, config)
        LazyConfig.apply_overrides(cfg, overrides)
        check_sections(cfg, config)
    assert SECTIONS[case] in str(e.value), str(e.value)


def test_every_shipped_config_has_the_sections_and_targets_a_training_reads():
    from libai_lite.config import LazyConfig
    from libai_lite.config.validate import check_sections, check_targets

    for path in sorted((ROOT / "projects").glob("*/configs/*.py")):
        cfg = LazyConfig.load(str(path))
        if "train" in cfg:  # not a part other configs import
            check_sections(cfg, path)
            check_targets(cfg)


# Values out of their range (libai_lite/config/validate.py's table) and overrides of the wrong shape:
# override -> the part of the one-line message checked.
BAD_VALUES = {
    "optim.lr=-1": "optim.lr=-1.0 is out of range: it must be a finite number > 0",
    "optim.lr=null": "optim.lr=null is out of range",
    # Once passed the range and stopped as "training diverged ... --resume from the last checkpoint".
    "optim.lr=inf": "optim.lr=inf is out of range: it must be a finite number > 0",
    "optim.eps=0": "optim.eps=0.0 is out of range",
    "optim.weight_decay=-0.1": "optim.weight_decay=-0.1 is out of range: it must be a finite number >= 0",
    "optim.betas=[0.9]": "optim.betas=[0.9] is out of range: it must be a list of 2 numbers",
    "optim.betas=[0.9,1.5]": "each >= 0 and < 1",
    "train.dist.tensor_parallel_size=0":
        "train.dist.tensor_parallel_size=0 is out of range: it must be an integer >= 1",
    "train.dist.pipeline_parallel_size=-1": "train.dist.pipeline_parallel_size=-1 is out of range",
    "train.dist.timeout=0": "train.dist.timeout=0 is out of range",
    "train.log_period=0": "train.log_period=0 is out of range",
    "train.seed=-5": "train.seed=-5 is out of range",
    "train.warmup_ratio=2": "train.warmup_ratio=2.0 is out of range: it must be a finite number >= 0 and <= 1",
    "train.train_iter=2.5": "train.train_iter=2.5 is out of range: it must be an integer",
    "train.test_micro_batch_size=0": "train.test_micro_batch_size=0 is out of range",
    "train.evaluation.eval_iter=0": "train.evaluation.eval_iter=0 is out of range",
    "train.amp.growth_interval=0": "train.amp.growth_interval=0 is out of range",
    "dataloader.train.num_workers=-1": "dataloader.train.num_workers=-1 is out of range",
    "model.cfg.attention_dropout_prob=1.5": "model.cfg.attention_dropout_prob=1.5 is out of range",
    "model.cfg.hidden_size=0": "model.cfg.hidden_size=0 is out of range",
    "train.checkpointer={period:5,foo:1}": "Unknown config key 'train.checkpointer.foo'",
    "train.dist=5": "Cannot override config key 'train.dist' (a dict) with 5",
    "optim.betas=0.9": "optim.betas=0.9 is out of range: it must be a list of 2 numbers",
    "train.train_iter=[1,2]": "Cannot override config key 'train.train_iter' (int, currently",
    "train.dist.pipeline_schedule=foo": "train.dist.pipeline_schedule='foo' is not allowed: it must be one of 'gpipe'",
    "train.scheduler.warmup_method=foo": "train.scheduler.warmup_method='foo' is not allowed",
    "train.evaluation.eval_mode=x": "train.evaluation.eval_mode='x' is not allowed: it must be one of 'min', 'max'",
    "train.output_dir=": "train.output_dir is empty",
}


@pytest.mark.parametrize("override", list(BAD_VALUES))
def test_out_of_range_values_and_wrong_shapes_are_refused_where_they_enter(override):
    """In process (fast): the config as the launcher loads it, the override, then the range table."""
    from libai_lite.config import LazyConfig
    from libai_lite.run_sections import check_settings
    from libai_lite.utils.errors import UsageError

    from libai_lite.engine.default import DefaultTrainer

    cfg = LazyConfig.load(str(ROOT / CONFIG))
    with pytest.raises(UsageError) as e:
        LazyConfig.apply_overrides(cfg, [override])
        check_settings(cfg)
        DefaultTrainer.precheck_output_dir(cfg.train.output_dir)
    assert BAD_VALUES[override] in str(e.value), str(e.value)


def test_every_shipped_config_is_within_the_ranges():
    from libai_lite.config import LazyConfig
    from libai_lite.run_sections import check_settings

    for path in sorted((ROOT / "projects").glob("*/configs/*.py")):
        cfg = LazyConfig.load(str(path))
        if "train" in cfg:
            check_settings(cfg)


# One case by default (the range table is checked in process above); the others with -m slow.
@pytest.mark.parametrize("override", [pytest.param("train.dist.tensor_parallel_size=0", marks=pytest.mark.slow),
                                      "optim.lr=-1",
                                      pytest.param("train.checkpointer={period:5,foo:1}", marks=pytest.mark.slow)])
def test_bad_values_through_train_sh_are_one_line_and_write_nothing(tmp_path, override):
    """As a user meets them: train.sh with two ranks, one `error:` line, nothing written."""
    out = tmp_path / "out"
    before = tree_snapshot(tmp_path)
    r = train_sh(2, tiny(out, tmp_path / "cache", "train.train_iter=2", override), timeout=120)
    assert r.returncode == 1
    assert BAD_VALUES[override] in one_error_line(r)
    assert not out.exists() and tree_snapshot(tmp_path) == before
