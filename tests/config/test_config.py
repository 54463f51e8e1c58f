"""Tests for the lazy config system: LazyCall, instantiate, LazyConfig and the CLI parser."""
import collections
import functools
import logging
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from libai_lite.config import (
    ConfigKeyError,
    ConfigLoadError,
    ConfigTypeError,
    InstantiationError,
    LazyCall,
    LazyConfig,
    default_argument_parser,
    instantiate,
    try_get_key,
)

SAMPLES = Path(__file__).resolve().parent / "samples"


@pytest.fixture(autouse=True)
def _restore_sys_path(monkeypatch):
    # LazyConfig.load appends import roots to sys.path; keep throw-away trees from
    # leaking into other tests.
    monkeypatch.setattr(sys, "path", list(sys.path))


def _write(root: Path, files: dict) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


class Point:
    def __init__(self, x, y=0):
        self.x, self.y = x, y


class Holder:
    def __init__(self, child, items=None, opts=None):
        self.child, self.items, self.opts = child, items, opts


# ------------------------------------------------------------------ LazyCall / instantiate


def test_lazycall_builds_dictconfig_with_target():
    cfg = LazyCall(Point)(x=1, y=2)
    assert isinstance(cfg, DictConfig)
    assert cfg._target_ is Point
    assert list(cfg.keys()) == ["_target_", "x", "y"]
    assert LazyCall("collections.OrderedDict")(a=1)._target_ == "collections.OrderedDict"
    with pytest.raises(TypeError):
        LazyCall(42)


def test_instantiate_recursive_through_dicts_and_lists():
    cfg = LazyCall(Holder)(
        child=LazyCall(Point)(x=1),
        items=[LazyCall(Point)(x=2), [LazyCall(Point)(x=3), 4]],
        opts={"inner": LazyCall("collections.Counter")(a=2), "plain": {"k": [1, 2]}},
    )
    obj = instantiate(cfg)
    assert isinstance(obj, Holder)
    assert isinstance(obj.child, Point) and obj.child.x == 1
    assert type(obj.items) is list and obj.items[0].x == 2
    assert type(obj.items[1]) is list and obj.items[1][0].x == 3 and obj.items[1][1] == 4
    assert type(obj.opts) is dict and obj.opts["inner"] == collections.Counter(a=2)
    assert obj.opts["plain"] == {"k": [1, 2]} and type(obj.opts["plain"]["k"]) is list


def test_instantiate_string_target_and_top_level_containers():
    linear = instantiate(LazyCall("torch.nn.Linear")(in_features=3, out_features=2))
    assert isinstance(linear, torch.nn.Linear) and linear.weight.shape == (2, 3)
    built = instantiate(OmegaConf.create({"a": [{"_target_": "collections.OrderedDict", "x": 1}], "b": 2}))
    assert built == {"a": [collections.OrderedDict(x=1)], "b": 2}
    assert instantiate(5) == 5


def test_instantiate_not_recursive_keeps_children_lazy():
    cfg = LazyCall(Holder)(child=LazyCall(Point)(x=1), _recursive_=False)
    obj = instantiate(cfg)
    assert isinstance(obj.child, DictConfig) and obj.child._target_ is Point
    assert instantiate(obj.child).x == 1


def test_instantiate_partial_and_interpolation():
    root = OmegaConf.create({"size": 7})
    root.point = LazyCall(Point)(x="${size}", _partial_=True)
    make = instantiate(root.point)
    assert isinstance(make, functools.partial)
    assert make(y=3).x == 7


def test_instantiate_errors_name_target_and_key_path():
    root = OmegaConf.create({"model": LazyCall(Holder)(child=LazyCall(Point)(z=1))}, flags={"allow_objects": True})
    with pytest.raises(InstantiationError) as info:
        instantiate(root.model)
    message = str(info.value)
    assert "Point" in message and "'model.child'" in message and "TypeError" in message
    assert "\n" not in message and isinstance(info.value.__cause__, TypeError)

    with pytest.raises(InstantiationError, match=r"Cannot import _target_ 'torch\.nn\.NoSuchLayer' at 'layer'"):
        instantiate(OmegaConf.create({"layer": {"_target_": "torch.nn.NoSuchLayer"}}).layer)


# ---------------------------------------------------------------------------- loading


def test_load_relative_imports():
    cfg = LazyConfig.load(SAMPLES / "derived.py")
    assert set(cfg.keys()) == {"train", "model", "optim", "hidden_sizes", "name"}
    assert cfg.train.train_iter == 20 and cfg.train.dist.tensor_parallel_size == 1
    assert cfg.model._target_ is torch.nn.Linear and cfg.model.in_features == 8
    assert cfg.optim.lr == pytest.approx(1e-4)
    assert isinstance(cfg.hidden_sizes, ListConfig)
    assert isinstance(instantiate(cfg.model), torch.nn.Linear)

    child = LazyConfig.load(str(SAMPLES / "sub" / "child.py"))
    assert child.train.output_dir == "output/child"
    # The child's own import of common/train.py is fresh: derived.py's mutation is not in it.
    assert child.train.train_iter == 10
    assert child.model.in_features == 8


def test_load_keys():
    train = LazyConfig.load(SAMPLES / "derived.py", keys="train")
    assert isinstance(train, DictConfig) and train.train_iter == 20
    model, name = LazyConfig.load(SAMPLES / "derived.py", keys=("model", "name"))
    assert model.out_features == 2 and name == "derived"
    with pytest.raises(KeyError, match="no top-level name 'nope'"):
        LazyConfig.load(SAMPLES / "derived.py", keys="nope")


@pytest.fixture
def config_tree(tmp_path, monkeypatch):
    """A throw-away repo with configs/common and projects/Demo/configs, cwd somewhere else."""
    root = tmp_path / "repo"
    helper_pkg = f"demo_modeling_{tmp_path.name.replace('-', '_')}"
    _write(
        root,
        {
            "configs/__init__.py": "",
            "configs/common/__init__.py": "",
            "configs/common/train.py": """
                import uuid
                train = dict(train_iter=100, token=uuid.uuid4().hex, dist=dict(pipeline_parallel_size=1))
            """,
            "configs/common/models/gpt.py": f"""
                from libai_lite.config import LazyCall
                from {helper_pkg}.net import TinyNet
                model = LazyCall(TinyNet)(hidden=16)
            """,
            "configs/gpt_tiny.py": """
                from configs.common.train import train
                from .common.models.gpt import model
                train.train_iter = 5
            """,
            "configs/untouched.py": """
                from configs.common.train import train
                import configs.common.models.gpt as gpt_module
                from configs.common import train as train_module
                model = gpt_module.model
                same_token = train_module.train.token == train.token
            """,
            "projects/__init__.py": "",
            "projects/Demo/__init__.py": "",
            "projects/Demo/configs/__init__.py": "",
            "projects/Demo/configs/base.py": """
                from configs.common.train import train
                train.dist.pipeline_parallel_size = 2
            """,
            "projects/Demo/configs/demo.py": """
                from projects.Demo.configs.base import train
                from ..configs.base import train as relative_train
                from ....configs.common.models.gpt import model
                model.hidden = 32
            """,
            f"{helper_pkg}/__init__.py": "",
            f"{helper_pkg}/net.py": """
                class TinyNet:
                    def __init__(self, hidden):
                        self.hidden = hidden
            """,
        },
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return root


def test_load_absolute_imports_from_any_cwd(config_tree):
    cfg = LazyConfig.load(config_tree / "configs" / "gpt_tiny.py")
    assert cfg.train.train_iter == 5
    net = instantiate(cfg.model)
    assert type(net).__name__ == "TinyNet" and net.hidden == 16
    assert str(config_tree) in sys.path

    demo = LazyConfig.load(config_tree / "projects" / "Demo" / "configs" / "demo.py")
    assert demo.train.dist.pipeline_parallel_size == 2
    assert demo.relative_train.dist.pipeline_parallel_size == 2
    assert demo.model.hidden == 32

    other = LazyConfig.load(config_tree / "configs" / "untouched.py")
    assert other.model.hidden == 16
    # `import a.b.c as m` and `from a.b import c` forms are routed through the fresh loader too.
    assert other.same_token is False
    assert not any(name.startswith("configs.common.train") for name in sys.modules if "_cfg_loader" not in name)


def test_each_load_is_fresh(config_tree):
    first = LazyConfig.load(config_tree / "configs" / "gpt_tiny.py")
    second = LazyConfig.load(config_tree / "configs" / "untouched.py")
    third = LazyConfig.load(config_tree / "configs" / "gpt_tiny.py")
    # gpt_tiny.py mutated the shared train; the other load never sees it.
    assert first.train.train_iter == 5 and second.train.train_iter == 100
    # common/train.py ran again for every load.
    assert len({first.train.token, second.train.token, third.train.token}) == 3
    first.train.dist.pipeline_parallel_size = 8
    assert LazyConfig.load(config_tree / "configs" / "gpt_tiny.py").train.dist.pipeline_parallel_size == 1


def test_load_same_names_from_two_repos(tmp_path, monkeypatch):
    # Two trees with their own configs/common/train.py: each config sees its own.
    for name, iters in (("a", 1), ("b", 2)):
        _write(
            tmp_path / name,
            {
                "configs/common/train.py": f"train = dict(train_iter={iters})\n",
                "configs/run.py": "from configs.common.train import train\n",
            },
        )
    monkeypatch.chdir(tmp_path)
    assert LazyConfig.load(tmp_path / "a" / "configs" / "run.py").train.train_iter == 1
    assert LazyConfig.load(tmp_path / "b" / "configs" / "run.py").train.train_iter == 2


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="no_such_config.py"):
        LazyConfig.load("projects/no_such_config.py")


def test_failing_config_names_file_and_cause():
    with pytest.raises(ConfigLoadError) as info:
        LazyConfig.load(SAMPLES / "failing.py")
    message = str(info.value)
    assert "\n" not in message
    assert str(SAMPLES / "failing.py") in message and "NameError" in message and "undefined_name" in message
    assert isinstance(info.value.__cause__, NameError)


def test_failing_imported_config_points_at_the_broken_file():
    with pytest.raises(ConfigLoadError) as info:
        LazyConfig.load(SAMPLES / "failing_nested.py")
    message = str(info.value)
    assert str(SAMPLES / "failing_nested.py") in message and "ZeroDivisionError" in message
    assert f"{SAMPLES / 'broken_part.py'}, line 1" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_syntax_error_and_missing_relative_import(tmp_path):
    _write(tmp_path, {"bad.py": "train = dict(\n", "missing.py": "from .common.nope import train\n"})
    with pytest.raises(ConfigLoadError, match=r"bad\.py: SyntaxError: .*line 1"):
        LazyConfig.load(tmp_path / "bad.py")
    with pytest.raises(ConfigLoadError, match=r"missing\.py: ImportError: .*nope\.py does not exist"):
        LazyConfig.load(tmp_path / "missing.py")


# ------------------------------------------------------------------------ save / load


def test_save_load_round_trip(tmp_path):
    cfg = OmegaConf.create(
        {
            "train": {"train_iter": 10, "lr": 1e-4, "amp": True, "note": "hello world", "unset": None},
            "sizes": [1, 2, [3, 4]],
            "missing": "???",
        },
        flags={"allow_objects": True},
    )
    cfg.model = LazyCall(torch.nn.Linear)(in_features=4, out_features="${model.in_features}")
    cfg.optim = LazyCall(torch.optim.AdamW)(params=None, lr="${train.lr}", betas=[0.9, 0.95])
    path = tmp_path / "out" / "config.yaml"
    LazyConfig.save(cfg, path)

    saved = yaml.safe_load(path.read_text())
    assert saved["model"]["_target_"] == "torch.nn.Linear"  # shortest public path
    assert saved["optim"]["_target_"] == "torch.optim.AdamW"
    assert saved["optim"]["lr"] == "${train.lr}"
    assert not (tmp_path / "out" / "config.yaml.pkl").exists()

    loaded = LazyConfig.load(path)
    expected = OmegaConf.to_container(cfg, resolve=False)
    expected["model"]["_target_"] = "torch.nn.Linear"
    expected["optim"]["_target_"] = "torch.optim.AdamW"
    assert OmegaConf.to_container(loaded, resolve=False) == expected
    assert loaded.optim.lr == pytest.approx(1e-4) and loaded.model.out_features == 4
    assert isinstance(instantiate(loaded.model), torch.nn.Linear)

    LazyConfig.save(loaded, tmp_path / "again.yaml")
    assert (tmp_path / "again.yaml").read_text() == path.read_text()


def test_save_py_config_round_trip(tmp_path):
    cfg = LazyConfig.load(SAMPLES / "derived.py")
    LazyConfig.save(cfg, tmp_path / "config.yaml")
    loaded = LazyConfig.load(tmp_path / "config.yaml")
    assert loaded.model._target_ == "torch.nn.Linear"
    assert loaded.optim._target_ == "torch.optim.SGD"
    loaded.model._target_ = torch.nn.Linear
    assert OmegaConf.to_container(loaded, resolve=False) == OmegaConf.to_container(cfg, resolve=False)


def test_save_unserialisable_writes_placeholder_and_pickle(tmp_path, caplog):
    class Local:  # not importable by its dotted path
        pass

    cfg = OmegaConf.create({"dtype": torch.float16, "local": LazyCall(Local)(), "ok": 1}, flags={"allow_objects": True})
    with caplog.at_level(logging.WARNING):
        LazyConfig.save(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["ok"] == 1 and saved["dtype"].startswith("<unserializable")
    assert saved["local"]["_target_"].endswith("<locals>.Local")
    assert "dtype" in caplog.text and "local._target_" in caplog.text
    cloudpickle = pytest.importorskip("cloudpickle")
    with open(tmp_path / "config.yaml.pkl", "rb") as f:
        restored = cloudpickle.load(f)
    assert restored.dtype is torch.float16


def test_save_without_cloudpickle_only_warns(tmp_path, caplog, monkeypatch):
    monkeypatch.setitem(sys.modules, "cloudpickle", None)
    with caplog.at_level(logging.WARNING):
        LazyConfig.save(OmegaConf.create({"x": object()}, flags={"allow_objects": True}), tmp_path / "c.yaml")
    assert (tmp_path / "c.yaml").exists() and not (tmp_path / "c.yaml.pkl").exists()
    assert "cloudpickle" in caplog.text


# ------------------------------------------------------------------------- overrides


@pytest.fixture
def cfg():
    return LazyConfig.load(SAMPLES / "derived.py")


def test_overrides_each_grammar_form(cfg):
    LazyConfig.apply_overrides(
        cfg,
        [
            "train.train_iter=100",
            "hidden_sizes=[1,2]",
            'train.output_dir="hello world"',
            "train.lr=null",
            "train.load_weight=1e-4",
            "optim.lr=${train.train_iter}",
            "train.dist={tensor_parallel_size:2}",
            "train.amp=true",
            "model.in_features='16'",
        ],
    )
    assert cfg.train.train_iter == 100
    assert list(cfg.hidden_sizes) == [1, 2]
    assert cfg.train.output_dir == "hello world"
    assert cfg.train.lr is None
    assert cfg.train.load_weight == pytest.approx(1e-4)
    assert cfg.optim.lr == 100
    # A dict merges into the existing node instead of replacing it.
    assert cfg.train.dist == {"data_parallel_size": 1, "tensor_parallel_size": 2}
    assert cfg.train.amp is True
    assert cfg.model.in_features == 16 and isinstance(cfg.model.in_features, int)


def test_override_add_force_add_and_delete(cfg):
    LazyConfig.apply_overrides(
        cfg, ["+train.new_key=3", "+brand.new.tree=[a,b]", "++train.train_iter=7", "++train.other=1"]
    )
    assert cfg.train.new_key == 3 and list(cfg.brand.new.tree) == ["a", "b"]
    assert cfg.train.train_iter == 7 and cfg.train.other == 1
    LazyConfig.apply_overrides(cfg, ["~train.new_key"])
    assert "new_key" not in cfg.train
    with pytest.raises(ConfigKeyError, match=r"Cannot add config key 'train.lr': it already exists"):
        LazyConfig.apply_overrides(cfg, ["+train.lr=1"])


def test_unknown_key_message(cfg):
    with pytest.raises(KeyError) as info:
        LazyConfig.apply_overrides(cfg, ["train.train_iters=100"])
    assert isinstance(info.value, ConfigKeyError)
    assert str(info.value) == (
        "Unknown config key 'train.train_iters'; did you mean 'train.train_iter'? "
        "Use +train.train_iters=... to add a new key."
    )
    with pytest.raises(ConfigKeyError, match=r"did you mean 'train.train_iter'"):
        LazyConfig.apply_overrides(cfg, ["train_iter=100"])
    with pytest.raises(ConfigKeyError) as info:
        LazyConfig.apply_overrides(cfg, ["zzzz.qqqq=1"])
    assert str(info.value) == "Unknown config key 'zzzz.qqqq'. Use +zzzz.qqqq=... to add a new key."
    with pytest.raises(ConfigKeyError, match=r"'train.train_iter' holds int"):
        LazyConfig.apply_overrides(cfg, ["train.train_iter.deeper=1"])


def test_wrong_type(cfg):
    with pytest.raises(ConfigTypeError) as info:
        LazyConfig.apply_overrides(cfg, ["train.train_iter=abc"])
    message = str(info.value)
    assert "'train.train_iter'" in message and "int" in message and "'abc'" in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(ConfigTypeError, match="train.lr"):
        LazyConfig.apply_overrides(cfg, ["train.lr=[1,2]"])
    with pytest.raises(ConfigTypeError, match="train.amp"):
        LazyConfig.apply_overrides(cfg, ["train.amp=5"])
    with pytest.raises(ConfigTypeError, match="train.train_iter"):
        LazyConfig.apply_overrides(cfg, ["train.train_iter=true"])
    assert cfg.train.train_iter == 20  # failed overrides change nothing

    LazyConfig.apply_overrides(cfg, ["train.train_iter=2.5", "train.lr=1", "train.load_weight=/ckpt", "train.amp=null"])
    assert cfg.train.train_iter == 2.5
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.load_weight == "/ckpt" and cfg.train.amp is None
    LazyConfig.apply_overrides(cfg, ["train.amp=[1]"])  # null -> anything
    assert list(cfg.train.amp) == [1]


def test_bad_override_syntax(cfg):
    with pytest.raises(ValueError, match=r"Cannot parse override 'train.train_iter'"):
        LazyConfig.apply_overrides(cfg, ["train.train_iter"])
    with pytest.raises(ValueError, match="sweep"):
        LazyConfig.apply_overrides(cfg, ["train.train_iter=1,2"])


# --------------------------------------------------------------------------- helpers


def test_try_get_key(cfg):
    assert try_get_key(cfg, "train.nope", "train.train_iter") == 20
    assert try_get_key(cfg, "a.b", default=3) == 3
    assert try_get_key({"x": {"y": 1}}, "x.y") == 1


def test_default_argument_parser():
    parser = default_argument_parser()
    args = parser.parse_args(
        [
            "--config-file",
            "projects/GPT/configs/gpt2_pretrain.py",
            "--fast-dev-run",
            "train.train_iter=100",
            "a.s=hello world",
        ]
    )
    assert args.config_file.endswith("gpt2_pretrain.py")
    assert args.fast_dev_run and not args.resume and not args.eval_only
    assert args.opts == ["train.train_iter=100", "a.s=hello world"]
    assert "bash tools/train.sh tools/train_net.py projects/GPT/configs/gpt2_pretrain.py 1 train.train_iter=100" in (
        parser.epilog
    )
    assert default_argument_parser(epilog="custom").epilog == "custom"
    with pytest.raises(SystemExit):
        parser.parse_args([])
