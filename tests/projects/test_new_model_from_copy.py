"""A new model is a copied project folder: the README's five steps, followed on projects/GPT and projects/MT5.

Each copy lives outside the repository, its classes are renamed, its MLP is swapped for a gated
one written in its own modeling file, and its Hugging Face mapping is edited for the new
weights. Nothing under libai_lite/ knows the copies: the engine reads the model protocol,
tensor parallelism reads the SBP the new layer declares, the pipeline cuts by ``layer_idx``, and
export finds each copy's mapping through its class. Every layout trains the one-process curve.
"""
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launch import ROOT, losses, python_tool, train_net, train_ranks

STEPS = 6

# Step 3: the new layer, in the copy's own file. It takes the core MLP's arguments, so it drops
# in where the project built an MLP, and declares its SBP as the core's layers do: both up
# projections split their outputs ("col"), the down projection its inputs ("row").
GATED_MLP = '''
"""A SwiGLU-style feed-forward block, ``down(act(gate(x)) * up(x))``."""
import functools

import torch.nn.functional as F
from torch import nn

from libai_lite.layers import Linear1D
from libai_lite.sbp import broadcast, declare, hidden

_ACT = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


class GatedMLP(nn.Module):
    sbp = declare(input=broadcast, output=hidden, args=("hidden_states",))

    def __init__(self, hidden_size, ffn_hidden_size, output_dropout_prob=0.0, init_method=None,
                 output_layer_init_method=None, bias=True, activation="silu", gated=True, layer_idx=0):
        super().__init__()
        self.act = _ACT[activation]
        self.layer_idx = layer_idx
        col = functools.partial(Linear1D, hidden_size, ffn_hidden_size, bias=bias, parallel="col",
                                init_method=init_method, layer_idx=layer_idx)
        self.gate, self.up = col(), col()
        self.down = Linear1D(ffn_hidden_size, hidden_size, bias=bias, parallel="row",
                             init_method=output_layer_init_method, layer_idx=layer_idx)
        self.dropout = nn.Dropout(output_dropout_prob)

    def forward(self, hidden_states):
        return self.dropout(self.down(self.act(self.gate(hidden_states)) * self.up(hidden_states)))
'''

GATED_GPT_LAYER = '''

from libai_lite.layers import TransformerLayer


class GatedTransformerLayer(TransformerLayer):
    """The core's pre-LayerNorm layer with this project's gated feed-forward block."""

    def __init__(self, hidden_size, ffn_hidden_size, num_attention_heads, **kwargs):
        super().__init__(hidden_size, ffn_hidden_size, num_attention_heads, **kwargs)
        self.mlp = GatedMLP(hidden_size, ffn_hidden_size, kwargs.get("output_dropout_prob", 0.0),
                            kwargs.get("init_method"), kwargs.get("output_layer_init_method"),
                            activation="silu", layer_idx=kwargs.get("layer_idx", 0))
'''


@dataclass
class Copy:
    """How one project is copied: its new name, the edits of steps 2-5, how it trains and exports."""

    source: str
    name: str
    classes: str  # step 2: the class-name regex, its first group kept
    new_files: dict  # step 3: relative path -> text
    edits: list  # steps 3 and 4: (relative path, regex, replacement, how many matches)
    config: str  # step 5
    args: list
    gated_keys: tuple  # exported names of layer 0's gate and up weights


GPT = Copy(
    source="GPT",
    # Not "MyLM": tests/config/test_project_import.py imports a copy of that name in the same process.
    name="NewLM",
    classes=r"\bGPT(ForPreTraining|Model|Embedding|Loss)\b",
    new_files={"modeling/gated_mlp.py": GATED_MLP.lstrip() + GATED_GPT_LAYER},
    edits=[
        ("modeling/gpt_model.py", r"\n(from libai_lite\.layers\.moe import inactive_expert_parameters\n)",
         r"\n\1from .gated_mlp import GatedTransformerLayer\n", 1),
        ("modeling/gpt_model.py", r"str\(i\): TransformerLayer\(", "str(i): GatedTransformerLayer(", 1),
        ("modeling/hf_mapping.py", r'HF_MODEL_TYPE = "gpt2"', 'HF_MODEL_TYPE = "my_lm"', 1),
        ("modeling/hf_mapping.py", r'\("mlp\.dense_h_to_4h", "mlp\.c_fc"\),\s*\("mlp\.dense_4h_to_h", "mlp\.c_proj"\)',
         '("mlp.gate", "mlp.c_gate"), ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")', 2),
    ],
    config='from .gpt2_pretrain import dataloader, model, optim, tokenization, train\n\n'
           'train.output_dir = "output/my_lm"\n',
    args=[
        "model.cfg.hidden_layers=4", "model.cfg.hidden_size=64", "model.cfg.ffn_hidden_size=128",
        "model.cfg.num_attention_heads=4", "model.cfg.max_seq_length=32", "model.cfg.attention_dropout_prob=0.0",
        "model.cfg.output_dropout_prob=0.0", "train.train_micro_batch_size=2", "train.global_batch_size=8",
        # 8000 ids pad to 8192 for tp 1 and 2 alike, so every layout builds the same model.
        "tokenization.make_vocab_size_divisible_by=256",
    ],
    gated_keys=("transformer.h.0.mlp.c_gate.weight", "transformer.h.0.mlp.c_fc.weight"),
)

MT5 = Copy(
    source="MT5",
    name="NewT5",
    classes=r"\bMT5(ForPreTraining|Model|Config|Loss|TransformerLayer)\b",
    new_files={"modeling/gated_mlp.py": GATED_MLP.lstrip()},
    edits=[
        ("modeling/transformer_layer.py", r"\nfrom \.relative_position import", "\nfrom .gated_mlp import GatedMLP\n\\g<0>", 1),
        ("modeling/transformer_layer.py", r"\(MLP if moe is None", "(GatedMLP if moe is None", 1),
        ("modeling/hf_mapping.py", r'\("dense_h_to_4h", "wi_0"\), \("dense_h_to_4h_linear", "wi_1"\), \("dense_4h_to_h", "wo"\)',
         '("gate", "wi_0"), ("up", "wi_1"), ("down", "wo")', 1),
    ],
    config='from .mt5_pretrain import dataloader, model, optim, tokenization, train\n\n'
           'train.output_dir = "output/my_t5"\n',
    args=[
        "model.cfg.hidden_layers=2", "model.cfg.hidden_size=64", "model.cfg.num_attention_heads=4",
        "model.cfg.head_size=16", "model.cfg.intermediate_size=128", "dataloader.train.max_seq_length=64",
        "train.train_micro_batch_size=2", "train.global_batch_size=8", "train.num_accumulation_steps=null",
        "train.train_epoch=0", "train.amp.enabled=False", "train.zero_optimization.enabled=False",
        "train.dist.data_parallel_size=null", "train.dist.tensor_parallel_size=1",
        "tokenization.make_vocab_size_divisible_by=256", "optim.lr=1e-3",
    ],
    gated_keys=("encoder.block.0.layer.1.DenseReluDense.wi_0.weight",
                "encoder.block.0.layer.1.DenseReluDense.wi_1.weight"),
)

COPIES = {"GPT": GPT, "MT5": MT5}


def _sub(path: Path, pattern: str, repl: str, count: int) -> None:
    new, n = re.subn(pattern, repl, path.read_text())
    assert n == count, (path, pattern, n)  # the project still has the shape this test edits
    path.write_text(new)


def make_copy(spec: Copy, where: Path) -> Path:
    """The five steps of README "Start a new model" on ``projects/<source>``."""
    project = where / spec.name
    # 1. Copy the project folder anywhere.
    shutil.copytree(ROOT / "projects" / spec.source, project, ignore=shutil.ignore_patterns("__pycache__"))
    # 2. Rename the model classes.
    for path in project.rglob("*.py"):
        path.write_text(re.sub(spec.classes, spec.name + r"\1", path.read_text()))
    # 3. and 4. The new layer in its own file, the model built from it, the mapping taught its weights.
    for rel, text in spec.new_files.items():
        (project / rel).write_text(text)
    for rel, pattern, repl, count in spec.edits:
        _sub(project / rel, pattern, repl, count)
    # 5. A config of its own.
    (project / "configs" / "mine.py").write_text(spec.config)
    return project


def _train_args(spec: Copy, out: Path, cache: Path, *extra) -> list:
    return [f"train.output_dir={out}", f"dataloader.train.cache_dir={cache}", "dataloader.train.num_workers=0",
            f"train.train_iter={STEPS}", "train.log_period=1", "train.evaluation.enabled=False",
            "train.checkpointer.period=1000", *spec.args, *extra]


@pytest.fixture(scope="module", params=list(COPIES))
def copied(request, tmp_path_factory):
    """``(spec, project folder, one-process loss curve, its run directory)`` for each copied project."""
    spec = COPIES[request.param]
    project = make_copy(spec, tmp_path_factory.mktemp("elsewhere"))
    tmp = tmp_path_factory.mktemp(f"{spec.name}_ref")
    out = tmp / "out"
    r = train_net(_train_args(spec, out, tmp / "cache"), config=str(project / "configs" / "mine.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    curve = losses(out)
    assert sorted(curve) == list(range(1, STEPS + 1))
    assert curve[STEPS] < curve[1]
    return spec, project, curve, out


def test_the_copy_builds_its_own_gated_model(copied, monkeypatch):
    from libai_lite.config import LazyConfig, instantiate

    monkeypatch.setattr(sys, "path", list(sys.path))  # the load adds the copy's parent folder
    spec, project, _, out = copied
    cfg = LazyConfig.load(out / "config.yaml")
    assert cfg.model._target_.startswith(f"{spec.name}.")
    model = instantiate(cfg.model)
    assert type(model).__name__ == f"{spec.name}ForPreTraining"
    mlps = [m for m in model.modules() if type(m).__name__ == "GatedMLP"]
    assert len(mlps) == 4
    (gated_file,) = spec.new_files
    assert Path(sys.modules[type(mlps[0]).__module__].__file__) == project / gated_file


LAYOUTS = {
    "tp2": ["train.dist.tensor_parallel_size=2"],
    "pp2_1f1b": ["train.dist.pipeline_parallel_size=2", "train.dist.pipeline_schedule=1f1b"],
    "dp2_zero3": ["train.zero_optimization.enabled=True", "train.zero_optimization.stage=3"],
}


# The copies' ZeRO-3 and tp2 runs go with -m slow: the originals' run by default (the copies' modules
# come from the same generic layers; pp2 shows the copy's own pipeline protocol).
@pytest.mark.parametrize("layout", [pytest.param(n, marks=pytest.mark.slow) if n in ("dp2_zero3", "tp2") else n
                                    for n in LAYOUTS])
def test_the_copy_trains_the_one_process_curve_under(copied, tmp_path, layout):
    spec, project, curve, _ = copied
    r = train_ranks(2, _train_args(spec, tmp_path / "out", tmp_path / "cache", *LAYOUTS[layout]),
                    config=str(project / "configs" / "mine.py"))
    assert r.returncode == 0, r.stderr[-4000:]
    got = losses(tmp_path / "out")
    assert sorted(got) == sorted(curve)
    for it in curve:
        assert got[it] == pytest.approx(curve[it], rel=2e-4, abs=2e-4), (spec.name, layout, it)


def test_the_runs_config_yaml_reruns_it(copied, tmp_path):
    _, _, curve, out = copied
    rerun = tmp_path / "rerun"
    r = train_net([f"train.output_dir={rerun}"], config=str(out / "config.yaml"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(rerun) == curve


def test_export_goes_through_the_copys_mapping(copied, tmp_path):
    """The project's own mapping would fail on the copy's weights; the copy's writes them."""
    from safetensors.torch import load_file

    spec, _, _, out = copied
    hf_dir = tmp_path / "hf"
    r = python_tool([sys.executable, "tools/hf_convert.py", "export", "--config-file", str(out / "config.yaml"),
                     "--checkpoint", str(out / "model_final"), "--output", str(hf_dir)], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    tensors = load_file(hf_dir / "model.safetensors")
    gate, up = (tensors[k] for k in spec.gated_keys)
    assert gate.shape == up.shape and not gate.equal(up), "the gate and up projections are distinct trained weights"
    if spec is GPT:
        assert json.loads((hf_dir / "config.json").read_text())["model_type"] == "my_lm"


README_STEPS = ("Copy the project folder", "Rename the model classes", "new layer", "Hugging Face mapping",
                "config of its own")


def test_the_readme_gives_these_five_steps():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Start a new model", 1)[1].split("\n## ", 1)[0]
    steps = re.findall(r"^\d\. (.+)$", section, flags=re.M)
    assert len(steps) == 5
    for step, words in zip(steps, README_STEPS):
        assert words.lower() in step.lower(), (step, words)
    assert "tests/projects/test_new_model_from_copy.py" in section
