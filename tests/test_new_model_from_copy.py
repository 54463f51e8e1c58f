"""A new model is a copied project folder: the README's five steps, followed on projects/GPT.

The copy lives outside the repository, its classes are renamed, its MLP is swapped for a gated
one written in its own modeling file, and its Hugging Face mapping is edited for the new weight.
Nothing under libai_lite/ knows the copy: the engine reads the model protocol, tensor
parallelism reads the SBP the new layer declares, the pipeline cuts by ``layer_idx``, and export
finds the copy's mapping through its class. Each layout trains the one-process loss curve.
"""
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from e2e_utils import ROOT, env, losses, tiny, train_net, train_sh

STEPS = 6
COMMON = [
    f"train.train_iter={STEPS}",
    "train.evaluation.enabled=False",
    "train.checkpointer.period=1000",
    "model.cfg.attention_dropout_prob=0.0",
    "model.cfg.output_dropout_prob=0.0",
    "model.cfg.hidden_layers=4",
    "model.cfg.num_attention_heads=4",
    "train.train_micro_batch_size=2",
    "train.global_batch_size=8",
    # 8000 ids pad to 8192 for tp 1 and 2 alike, so every layout builds the same model.
    "tokenization.make_vocab_size_divisible_by=256",
]

# Step 3: the new layer, in the copy's own file. It declares its SBP like the core's layers do:
# the two up projections split their outputs ("col"), the down projection its inputs ("row").
GATED_MLP = '''
"""MyLM's feed-forward block: SwiGLU, ``down(silu(gate(x)) * up(x))``."""
import torch.nn.functional as F
from torch import nn

from libai_lite.layers import Linear1D, TransformerLayer
from libai_lite.parallel.sbp import broadcast, declare, hidden


class GatedMLP(nn.Module):
    sbp = declare(input=broadcast, output=hidden, args=("hidden_states",))

    def __init__(self, hidden_size, ffn_hidden_size, output_dropout_prob=0.0, init_method=None,
                 output_layer_init_method=None, layer_idx=0):
        super().__init__()
        self.layer_idx = layer_idx
        self.gate = Linear1D(hidden_size, ffn_hidden_size, parallel="col", init_method=init_method,
                             layer_idx=layer_idx)
        self.up = Linear1D(hidden_size, ffn_hidden_size, parallel="col", init_method=init_method,
                           layer_idx=layer_idx)
        self.down = Linear1D(ffn_hidden_size, hidden_size, parallel="row", init_method=output_layer_init_method,
                             layer_idx=layer_idx)
        self.dropout = nn.Dropout(output_dropout_prob)

    def forward(self, hidden_states):
        return self.dropout(self.down(F.silu(self.gate(hidden_states)) * self.up(hidden_states)))


class GatedTransformerLayer(TransformerLayer):
    """The core's pre-LayerNorm layer with MyLM's gated feed-forward block."""

    def __init__(self, hidden_size, ffn_hidden_size, num_attention_heads, **kwargs):
        super().__init__(hidden_size, ffn_hidden_size, num_attention_heads, **kwargs)
        self.mlp = GatedMLP(hidden_size, ffn_hidden_size, kwargs.get("output_dropout_prob", 0.0),
                            kwargs.get("init_method"), kwargs.get("output_layer_init_method"),
                            kwargs.get("layer_idx", 0))
'''

MY_CONFIG = '''
from .gpt2_pretrain import dataloader, model, optim, tokenization, train

train.output_dir = "output/my_lm"
'''


def _sub(path: Path, pattern: str, repl: str, count: int = 1) -> None:
    text = path.read_text()
    new, n = re.subn(pattern, repl, text)
    assert n == count, (path, pattern, n)  # the copy still has the shape this test edits
    path.write_text(new)


@pytest.fixture(scope="module")
def my_lm(tmp_path_factory) -> Path:
    """The five steps of README "Start a new model" on a copy of projects/GPT named MyLM."""
    project = tmp_path_factory.mktemp("elsewhere") / "MyLM"
    # 1. Copy the project folder anywhere.
    shutil.copytree(ROOT / "projects" / "GPT", project, ignore=shutil.ignore_patterns("__pycache__"))
    # 2. Rename the model classes.
    for path in project.rglob("*.py"):
        path.write_text(re.sub(r"\bGPT(ForPreTraining|Model|Embedding|Loss)\b", r"MyLM\1", path.read_text()))
    # 3. Write the new layer in its own modeling file and build the model from it.
    (project / "modeling" / "gated_mlp.py").write_text(GATED_MLP.lstrip())
    model_file = project / "modeling" / "gpt_model.py"
    _sub(model_file, r"\n(from libai_lite\.model import LOSS\n)", r"\n\1from .gated_mlp import GatedTransformerLayer\n")
    _sub(model_file, r"str\(i\): TransformerLayer\(", "str(i): GatedTransformerLayer(")
    # 4. Teach the copy's Hugging Face mapping the new weight and a model type of its own.
    mapping = project / "modeling" / "hf_mapping.py"
    _sub(mapping, r'HF_MODEL_TYPE = "gpt2"', 'HF_MODEL_TYPE = "my_lm"')
    _sub(mapping, r'\("mlp\.dense_h_to_4h", "mlp\.c_fc"\),\s*\("mlp\.dense_4h_to_h", "mlp\.c_proj"\)',
         '("mlp.gate", "mlp.c_gate"), ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")', count=2)
    # 5. A config of its own.
    (project / "configs" / "my_lm.py").write_text(MY_CONFIG.lstrip())
    return project


def _args(out: Path, cache: Path, *extra) -> list:
    return tiny(out, cache, *COMMON, *extra)


@pytest.fixture(scope="module")
def reference(my_lm, tmp_path_factory):
    """The copy trained by one process: its loss curve, and the run directory."""
    tmp = tmp_path_factory.mktemp("my_lm_ref")
    out = tmp / "out"
    r = train_net(_args(out, tmp / "cache"), config=str(my_lm / "configs" / "my_lm.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    curve = losses(out)
    assert sorted(curve) == list(range(1, STEPS + 1))
    assert curve[STEPS] < curve[1]
    return curve, out


def test_the_copy_builds_its_own_gated_model(my_lm, reference, monkeypatch):
    from libai_lite.config import LazyConfig, instantiate

    monkeypatch.setattr(sys, "path", list(sys.path))  # the load adds the copy's parent folder
    _, out = reference
    cfg = LazyConfig.load(out / "config.yaml")
    assert cfg.model._target_.startswith("MyLM.modeling.")
    model = instantiate(cfg.model)
    mlps = [m for m in model.modules() if type(m).__name__ == "GatedMLP"]
    assert len(mlps) == 4
    assert Path(sys.modules[type(mlps[0]).__module__].__file__) == my_lm / "modeling" / "gated_mlp.py"


LAYOUTS = {
    "tp2": ["train.dist.tensor_parallel_size=2"],
    "pp2_1f1b": ["train.dist.pipeline_parallel_size=2", "train.dist.pipeline_schedule=1f1b"],
    "dp2_zero3": ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=3"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_copy_trains_the_one_process_curve_under(my_lm, reference, tmp_path, name):
    curve, _ = reference
    r = train_sh(2, _args(tmp_path / "out", tmp_path / "cache", *LAYOUTS[name]),
                 config=str(my_lm / "configs" / "my_lm.py"))
    assert r.returncode == 0, r.stderr[-4000:]
    got = losses(tmp_path / "out")
    assert sorted(got) == sorted(curve)
    for it in curve:
        assert got[it] == pytest.approx(curve[it], rel=2e-4, abs=2e-4), (name, it)


def test_the_runs_config_yaml_reruns_it(reference, tmp_path):
    curve, out = reference
    rerun = tmp_path / "rerun"
    r = train_net([f"train.output_dir={rerun}"], config=str(out / "config.yaml"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(rerun) == curve


def test_export_goes_through_the_copys_mapping(reference, tmp_path):
    from safetensors.torch import load_file

    _, out = reference
    hf_dir = tmp_path / "hf"
    r = subprocess.run([sys.executable, "tools/hf_convert.py", "export", "--config-file", str(out / "config.yaml"),
                        "--checkpoint", str(out / "model_final"), "--output", str(hf_dir)],
                       cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == "my_lm"
    tensors = load_file(hf_dir / "model.safetensors")
    for i in range(4):
        gate, up = tensors[f"transformer.h.{i}.mlp.c_gate.weight"], tensors[f"transformer.h.{i}.mlp.c_fc.weight"]
        assert gate.shape == up.shape == (64, 128)
        assert not gate.equal(up), "the gate and up projections are distinct trained weights"
    assert not any("dense_h_to_4h" in k for k in tensors)


README_STEPS = ("Copy the project folder", "Rename the model classes", "new layer", "Hugging Face mapping",
                "config of its own")


def test_the_readme_gives_these_five_steps():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Start a new model", 1)[1].split("\n## ", 1)[0]
    steps = re.findall(r"^\d\. (.+)$", section, flags=re.M)
    assert len(steps) == 5
    for step, words in zip(steps, README_STEPS):
        assert words.lower() in step.lower(), (step, words)
    assert "tests/test_new_model_from_copy.py" in section
