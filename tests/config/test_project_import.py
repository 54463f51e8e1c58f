"""A project folder copied out of the repository, and a LiBai-style tree, import the user's own files.

The config loader executes config files afresh on every load, but the model code they reach
(``from ..modeling.gpt_model import ...``) is a real module with a stable dotted name, so a
saved ``config.yaml`` builds the same class in another process started from anywhere.
"""
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from libai_lite.config import ConfigLoadError, InstantiationError, LazyConfig, instantiate
from libai_lite.config.lazy import IMPORT_ROOTS_KEY

REPO = Path(__file__).resolve().parents[2]

TINY = "hidden_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=2, vocab_size=128, max_seq_length=16"

MY_CONFIG = f"""
from libai_lite.config import LazyCall
from .model import cfg
from configs.common.train import train

from ..modeling.gpt_model import MyLMForPreTraining

model = LazyCall(MyLMForPreTraining)(cfg=cfg)
model.cfg.update({TINY})
train.output_dir = "output/my_lm"
"""

# Runs in a fresh interpreter: load the saved YAML and build the model it names.
REBUILD = """
import inspect, json, sys
from libai_lite.config import LazyConfig, instantiate
cfg = LazyConfig.load(sys.argv[1])
model = instantiate(cfg.model)
print(json.dumps([type(model).__name__, type(model).__module__, inspect.getfile(type(model))]))
"""


@pytest.fixture(autouse=True)
def _restore_sys_path(monkeypatch):
    # Loads append the user's folders to sys.path; keep them out of other tests.
    monkeypatch.setattr(sys, "path", list(sys.path))


def _write(root: Path, files: dict) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture(scope="module")
def my_lm(tmp_path_factory) -> Path:
    """projects/GPT copied outside the repository as MyLM, its model classes renamed."""
    project = tmp_path_factory.mktemp("elsewhere") / "MyLM"
    shutil.copytree(REPO / "projects" / "GPT", project, ignore=shutil.ignore_patterns("__pycache__"))
    for path in project.rglob("*.py"):
        text = re.sub(r"\bGPT(ForPreTraining|Model|Embedding|Loss)\b", r"MyLM\1", path.read_text())
        path.write_text(text)
    (project / "configs" / "my.py").write_text(textwrap.dedent(MY_CONFIG))
    return project


def test_copied_project_builds_its_own_class_and_its_saved_config_reruns(my_lm, tmp_path):
    cfg = LazyConfig.load(my_lm / "configs" / "my.py")
    model = instantiate(cfg.model)
    model_file = my_lm / "modeling" / "gpt_model.py"
    assert type(model).__name__ == "MyLMForPreTraining"
    assert type(model).__module__ == "MyLM.modeling.gpt_model"
    assert Path(inspect.getfile(type(model))) == model_file
    assert cfg[IMPORT_ROOTS_KEY] == [str(my_lm.parent)]
    # The common configs still come from the installed package, fresh for this load.
    assert cfg.train.output_dir == "output/my_lm"
    # Model code is imported once: a second load names the very same class.
    assert LazyConfig.load(my_lm / "configs" / "my.py").model._target_ is type(model)

    saved = tmp_path / "run" / "config.yaml"
    LazyConfig.save(cfg, saved)
    assert "_target_: MyLM.modeling" in saved.read_text()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", REBUILD, str(saved)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    name, module, path = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (name, module, Path(path)) == ("MyLMForPreTraining", "MyLM.modeling.gpt_model", model_file)


def test_saved_config_overrides_and_key_suggestions_ignore_import_roots(my_lm, tmp_path):
    cfg = LazyConfig.load(my_lm / "configs" / "my.py")
    LazyConfig.apply_overrides(cfg, ["model.cfg.hidden_layers=1"])
    LazyConfig.save(cfg, tmp_path / "config.yaml")
    again = LazyConfig.load(tmp_path / "config.yaml")
    assert again[IMPORT_ROOTS_KEY] == [str(my_lm.parent)] and again.model.cfg.hidden_layers == 1
    with pytest.raises(KeyError) as info:
        LazyConfig.apply_overrides(again, ["import_roots=1"])
    assert IMPORT_ROOTS_KEY not in str(info.value)


def test_libai_style_tree_without_init_files_imports_its_own_configs(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    _write(
        repo,
        {
            "configs/common/train.py": "train = dict(train_iter=7, output_dir='mine')\n",
            "projects/MyProj/modeling/model.py": """
                from projects.MyProj.modeling.layers import width

                class MyNet:
                    def __init__(self, scale=1):
                        self.width = width * scale
            """,
            "projects/MyProj/modeling/layers.py": "width = 3\n",
            "projects/MyProj/configs/my.py": """
                from libai_lite.config import LazyCall
                from configs.common.train import train
                from configs.common.optim import optim
                from ..modeling.model import MyNet

                model = LazyCall(MyNet)(scale=2)
            """,
            "projects/MyProj/configs/absolute.py": """
                from libai_lite.config import LazyCall
                from projects.MyProj.configs.my import train
                from projects.MyProj.modeling.model import MyNet

                model = LazyCall(MyNet)(scale=3)
            """,
        },
    )
    monkeypatch.chdir(tmp_path)
    cfg = LazyConfig.load(repo / "projects" / "MyProj" / "configs" / "my.py")
    # The user's configs/common/train.py, not the installed one; what the tree lacks falls back.
    assert cfg.train.train_iter == 7 and cfg.train.output_dir == "mine"
    assert "lr" in cfg.optim
    net = instantiate(cfg.model)
    assert type(net).__module__ == "projects.MyProj.modeling.model" and net.width == 6
    assert cfg[IMPORT_ROOTS_KEY] == [str(repo)]

    absolute = LazyConfig.load(repo / "projects" / "MyProj" / "configs" / "absolute.py")
    assert absolute.train.train_iter == 7
    assert absolute.model._target_ is type(net)
    # The installed projects still import beside the user's.
    gpt = LazyConfig.load(REPO / "projects" / "GPT" / "configs" / "gpt2_pretrain.py", keys="model")._target_
    assert Path(inspect.getfile(gpt)) == REPO / "projects" / "GPT" / "modeling" / "gpt_model.py"


def test_missing_model_module_is_one_clear_line(my_lm, tmp_path):
    (my_lm / "configs" / "broken.py").write_text("from ..modeling.no_such_model import MyLMForPreTraining\n")
    with pytest.raises(ConfigLoadError) as info:
        LazyConfig.load(my_lm / "configs" / "broken.py")
    message = str(info.value)
    assert "\n" not in message and "broken.py" in message
    assert str(my_lm / "modeling" / "no_such_model.py") in message and "does not exist" in message

    saved = tmp_path / "config.yaml"
    saved.write_text("model:\n  _target_: NoSuchLM.modeling.gpt_model.NoSuchLMForPreTraining\n")
    with pytest.raises(InstantiationError) as info:
        instantiate(LazyConfig.load(saved).model)
    message = str(info.value)
    assert "\n" not in message
    assert "no module named 'NoSuchLM'" in message and "PYTHONPATH" in message
