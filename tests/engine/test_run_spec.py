"""The config is resolved once (``libai_lite.run_spec.resolve_run``): the caller's config is left as it was, the
resolved one is read-only, and the trainer, the planner and the checkpointer's trainer state read the same spec."""
import json

import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.errors import ReadonlyConfigError

from libai_lite.config import LazyConfig
from libai_lite.run_spec import resolve_run, tokenizer_from_config
from libai_lite.utils.errors import UsageError
from libai_lite.utils.parallel_dims import ParallelDims
from tests.launch import CONFIG, ROOT, tiny


def _load(tmp_path, *extra):
    cfg = LazyConfig.load(str(ROOT / CONFIG))
    return LazyConfig.apply_overrides(cfg, tiny(tmp_path / "out", tmp_path / "cache", *extra))


def _dims(world, **dist):
    return ParallelDims.resolve(world, dist)


def test_resolution_leaves_the_callers_config_and_returns_a_read_only_resolved_one(tmp_path):
    cfg = _load(tmp_path, "train.global_batch_size=null", "train.num_accumulation_steps=3",
                "train.dist.data_parallel_size=null", "train.dist.tensor_parallel_size=2")
    before = OmegaConf.to_yaml(cfg)
    spec = resolve_run(cfg, _dims(4, **cfg.train.dist), tokenizer_from_config(cfg.tokenization))
    assert OmegaConf.to_yaml(cfg) == before
    # 4 processes at tp 2: dp 2, so the global batch is micro 4 x dp 2 x accumulation 3.
    assert (spec.dims.data_parallel_size, spec.dims.tensor_parallel_size) == (2, 2)
    assert (spec.batch.micro_batch_size, spec.batch.global_batch_size, spec.batch.num_accumulation_steps) == (4, 24, 3)
    assert spec.vocab_size == 8064 and spec.cfg.model.cfg.vocab_size == 8064
    assert spec.cfg.train.global_batch_size == 24 and spec.cfg.train.dist.data_parallel_size == 2
    assert spec.train_iter == 300
    assert spec.describe() == "layout pp=1 dp=2 tp=2; global batch 24 = micro 4 x dp 2 x accumulation 3"
    with pytest.raises(ReadonlyConfigError):
        spec.cfg.train.train_iter = 5
    with pytest.raises(ReadonlyConfigError):
        spec.cfg.model.cfg.hidden_size = 8


def test_pipeline_stages_epochs_and_the_evaluation_cap_are_resolved_into_the_spec(tmp_path):
    cfg = _load(tmp_path, "train.dist.pipeline_parallel_size=2", "train.train_epoch=2", "train.train_iter=1",
                "train.evaluation.eval_iter=100000")
    spec = resolve_run(cfg, _dims(2, **cfg.train.dist), tokenizer_from_config(cfg.tokenization))
    assert spec.stage_of_layer == (0, 1) and list(spec.cfg.train.dist.stage_of_layer) == [0, 1]
    # The demo corpus at 32 tokens a sample: two epochs of its train split, 8 samples a step.
    from libai_lite.config.instantiate import instantiate_target

    loader = cfg.dataloader.train
    count = instantiate_target(loader).samples_per_epoch
    import inspect

    per_epoch = count(**{k: v for k, v in loader.items() if k in inspect.signature(count).parameters})
    assert spec.train_iter == -(-2 * per_epoch // 8) == spec.cfg.train.train_iter
    # eval_iter beyond one pass over the valid split is capped to it (one warning), in the spec and config.yaml.
    assert 1 <= spec.eval_iter < 100000 and spec.cfg.train.evaluation.eval_iter == spec.eval_iter
    assert cfg.train.train_iter == 1 and cfg.train.evaluation.eval_iter == 100000


def test_what_cannot_run_is_refused_while_resolving(tmp_path):
    cfg = _load(tmp_path, "train.global_batch_size=10")
    with pytest.raises(UsageError, match="train.global_batch_size=10 is not divisible"):
        resolve_run(cfg, _dims(1), None)
    cfg = _load(tmp_path, "train.train_iter=0")
    with pytest.raises(UsageError, match="set train.train_iter"):
        resolve_run(cfg, _dims(1), None)
    cfg = _load(tmp_path, "train.dist.pipeline_parallel_size=4")
    with pytest.raises(UsageError, match="more stages than the model's 2 layers"):
        resolve_run(cfg, _dims(4, **cfg.train.dist), None)
    cfg = _load(tmp_path, "train.amp.enabled=True", "train.amp.dtype=fp8")
    with pytest.raises(UsageError, match="train.amp.dtype='fp8'"):
        resolve_run(cfg, _dims(1), None)


def test_the_planner_plans_the_run_the_trainer_resolves(tmp_path):
    from libai_lite.planning import plan_settings, settings_from_config

    cfg = _load(tmp_path, "train.dist.tensor_parallel_size=2", "train.zero_optimization.enabled=True",
                "train.zero_optimization.stage=2", "train.amp.enabled=True", "train.activation_checkpoint.enabled=True")
    dims = ParallelDims.resolve(4, cfg.train.dist, cfg.train.zero_optimization)
    spec = resolve_run(cfg, dims, tokenizer_from_config(cfg.tokenization))
    settings = settings_from_config(cfg, 4, "cpu")
    assert settings == plan_settings(spec, "cpu")
    assert (settings.data_parallel_size, settings.tensor_parallel_size, settings.zero_stage) == (2, 2, 2)
    assert settings.amp_dtype is spec.param_dtype is torch.bfloat16 and settings.activation_checkpoint_every == 1


def test_the_trainer_state_is_a_stateful_the_checkpointer_is_given(tmp_path):
    from libai_lite.checkpoint import Checkpointer
    from libai_lite.checkpoint.trainer_state import RngState, TrainerState

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    position = {"iteration": 4, "consumed_samples": 40, "scheduler": {"last_epoch": 5}}
    restored = []
    ck = Checkpointer(model, opt, str(tmp_path / "a"),
                      states={"rng": RngState(), "trainer": TrainerState(lambda: position, restored.append)})
    path = ck.save("model_0000004")
    # The same trainer_state.json as a save handed the dict.
    Checkpointer(model, opt, str(tmp_path / "b")).save("model_0000004", position)
    files = [json.load(open(tmp_path / d / "model_0000004" / "trainer_state.json")) for d in ("a", "b")]
    assert files[0] == files[1] == position
    assert ck.load(path) == position and restored == [position]
    with pytest.raises(ValueError, match="needs the trainer's state"):
        Checkpointer(model, opt, str(tmp_path / "c")).save("model_0000001")


def test_a_trainer_subclass_overriding_builders_gets_its_config_node_and_the_spec(tmp_path):
    """LiBai's extension point: override a build_* method; it receives the one node it builds, read-only from the
    resolved config, and finds what was derived in self.spec; the run trains with the overrides."""
    import logging
    from types import SimpleNamespace

    from libai_lite.engine.default import DefaultTrainer
    from libai_lite.engine.launch import default_setup
    from libai_lite.utils.distributed import destroy

    seen = {}

    class ConstantLR(DefaultTrainer):
        def build_model(self, node):
            seen.update(model_node=node is self.cfg.model, vocab=node.cfg.vocab_size)
            return super().build_model(node)

        def build_lr_scheduler(self, node, optimizer):
            seen.update(readonly=OmegaConf.is_readonly(node), scheduler_node=node is self.cfg.train.scheduler,
                        accumulation=self.cfg.train.num_accumulation_steps, spec_iters=self.spec.train_iter)
            return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    log = logging.getLogger("libai_lite")
    saved = (list(log.handlers), log.level, log.propagate)
    cfg = _load(tmp_path, "train.train_iter=3", "train.evaluation.enabled=False", "optim.lr=2e-3",
                "train.num_accumulation_steps=null")
    try:
        job = ConstantLR(cfg, default_setup(cfg, SimpleNamespace()))
        job.train()
    finally:
        destroy()
        for h in list(log.handlers):
            log.removeHandler(h)
        log.handlers[:], log.level, log.propagate = saved
    assert seen == {"model_node": True, "vocab": 8064, "readonly": True, "scheduler_node": True, "accumulation": 2,
                    "spec_iters": 3}
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.json")]
    assert [row["lr"] for row in rows if "lr" in row] == [2e-3] * 3
    assert cfg.train.num_accumulation_steps is None  # the loaded config is left as it was


def test_a_setting_the_config_leaves_out_takes_the_value_configs_common_train_gives_it():
    """One set of defaults: each settings record's field default (what a key missing from a config reads as) is
    configs/common/train.py's value, but for the keys whose absence asks for nothing."""
    from omegaconf import OmegaConf

    from libai_lite import run_sections as rs
    from libai_lite.config.settings import setting_defaults

    # Loaded by path: another test's tree may have joined the ``configs`` package ahead of this repo's.
    common = OmegaConf.create({"optim": LazyConfig.load(str(ROOT / "configs" / "common" / "optim.py")).optim,
                               "train": LazyConfig.load(str(ROOT / "configs" / "common" / "train.py")).train},
                              flags={"allow_objects": True})
    nothing = {"train.evaluation.enabled": False, "train.evaluation.eval_metric": None,
               "train.checkpointer.max_to_keep": None, "optim.params.clip_grad_max_norm": None}
    # Required where the run uses them (no default): the periods; and the run's own folder.
    required = {"train.checkpointer.period", "train.log_period", "train.evaluation.eval_period", "train.output_dir"}
    from libai_lite.converters.compile import CompileOptions
    from libai_lite.converters.float8 import Float8Options

    records = (*rs.RECORDS, CompileOptions, Float8Options)
    defaults = {k: v for record in records for k, v in setting_defaults(record).items()}
    # The config's choice where the record's default is the plain path: compile on a GPU, left to the run.
    nothing["train.compile.enabled"] = False
    assert set(nothing) | required <= set(defaults)
    given = {k: v for k, v in defaults.items() if k not in nothing and k not in required}
    assert len(given) >= 28, sorted(given)  # every amp, straggler, wandb, profile, clipping, compile, fp8 key
    config = {k: OmegaConf.select(common, k) for k in given}
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in OmegaConf.to_container(
        OmegaConf.create(config), resolve=True).items()} == given
    # Where the config asks for something a missing key does not.
    assert all(OmegaConf.select(common, k) != v for k, v in nothing.items())
    assert all(OmegaConf.select(common, k) is not None for k in required)
    assert float(common.train.warmup_ratio) > 0  # read by resolve_run: a missing warmup_ratio is none


def test_each_settings_record_field_declares_its_key_and_meaning_and_its_rule_refuses_in_one_line():
    """A record's field carries its key and a line of doc; ``check_settings`` refuses by the field's own rule."""
    import dataclasses

    from omegaconf import OmegaConf

    from libai_lite import run_sections as rs

    from libai_lite.converters.compile import CompileOptions
    from libai_lite.converters.float8 import Float8Options

    for record in (*rs.RECORDS, CompileOptions, Float8Options):
        for f in dataclasses.fields(record):
            assert f.metadata.get("doc"), f"{record.__name__}.{f.name} has no doc"
    with pytest.raises(UsageError, match=r"^train\.amp\.growth_interval=0 is out of range: it must be an integer "
                                         r">= 1; set train\.amp\.growth_interval to such a value$"):
        rs.check_settings(OmegaConf.create({"train": {"amp": {"growth_interval": 0}}}))
    with pytest.raises(UsageError, match=r"^train\.evaluation\.eval_mode='best' is not allowed: it must be one "
                                         r"of 'min', 'max'"):
        rs.check_settings(OmegaConf.create({"train": {"evaluation": {"eval_mode": "best"}}}))
    cfg = OmegaConf.create({"train": {"log_period": 5, "checkpointer": {"period": 3}, "straggler": {"ratio": None}},
                            "optim": {"params": {"clip_grad_norm_type": None}}})
    sections = rs.read_sections(cfg, trains=True, evaluates=False, fp16=True)
    assert sections["log"].period == 5 and sections["log"].straggler_ratio is None
    assert sections["optim"].clip_grad_norm_type == 2.0 and sections["loss_scale"] == rs.LossScale()
    with pytest.raises(UsageError, match=r"^train\.log_period is missing from the config"):
        rs.read_sections(OmegaConf.create({"train": {"checkpointer": {"period": 3}}}), trains=True, evaluates=False,
                         fp16=False)
