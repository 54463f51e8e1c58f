"""tools/convert_checkpoint.py --from megatron: Megatron-LM GPT checkpoints become ours with the same logits.

Megatron-LM does not run here (it needs CUDA and apex), so the checkpoints are files laid out exactly as its
checkpointing code writes them: legacy ``megatron/checkpointing.py`` (``latest_checkpointed_iteration.txt``,
``iter_0000005/mp_rank_0X/model_optim_rng.pt`` holding ``args``, ``checkpoint_version`` 3.0, ``iteration``,
``model.language_model.{embedding,encoder}`` with per-head [q, k, v] rows split over tensor-parallel ranks)
and Megatron core's ``torch_dist`` (a DCP directory with ``common.pt`` and ``metadata.json``, layers stacked).
The reference logits are Megatron's GPT forward written out below on the merged tensors.
"""
import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from libai_lite.checkpoint import Checkpointer
from libai_lite.checkpoint.integrity import read_metadata
from libai_lite.utils.errors import UsageError
from libai_lite.config import LazyConfig, instantiate

ROOT = Path(__file__).resolve().parents[2]
L, H, HEADS, FFN, VOCAB, POS = 2, 32, 4, 64, 128, 16


def _tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint_tool", ROOT / "tools/convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _weights(seed=0, vocab=VOCAB) -> dict:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    w = {"wte": r(vocab, H), "wpe": r(POS, H), "lnf.w": 1 + r(H, std=0.1), "lnf.b": r(H, std=0.1)}
    for i in range(L):
        w.update({f"{i}.ln1.w": 1 + r(H, std=0.1), f"{i}.ln1.b": r(H, std=0.1), f"{i}.qkv.w": r(3 * H, H),
                  f"{i}.qkv.b": r(3 * H), f"{i}.dense.w": r(H, H), f"{i}.dense.b": r(H),
                  f"{i}.ln2.w": 1 + r(H, std=0.1), f"{i}.ln2.b": r(H, std=0.1), f"{i}.fc1.w": r(FFN, H),
                  f"{i}.fc1.b": r(FFN), f"{i}.fc2.w": r(H, FFN), f"{i}.fc2.b": r(H)})
    return w


def megatron_logits(w: dict, ids: torch.Tensor) -> torch.Tensor:
    """Megatron-LM's GPT forward (pre-LayerNorm, fused per-head q/k/v rows, tanh GeLU, tied output)."""
    b, t = ids.shape
    d = H // HEADS
    h = w["wte"][ids] + w["wpe"][:t]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(L):
        x = F.layer_norm(h, (H,), w[f"{i}.ln1.w"], w[f"{i}.ln1.b"], 1e-5)
        q, k, v = (x @ w[f"{i}.qkv.w"].t() + w[f"{i}.qkv.b"]).view(b, t, HEADS, 3, d).unbind(3)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, H)
        h = h + o @ w[f"{i}.dense.w"].t() + w[f"{i}.dense.b"]
        x = F.layer_norm(h, (H,), w[f"{i}.ln2.w"], w[f"{i}.ln2.b"], 1e-5)
        h = h + F.gelu(x @ w[f"{i}.fc1.w"].t() + w[f"{i}.fc1.b"], approximate="tanh") @ w[f"{i}.fc2.w"].t() \
            + w[f"{i}.fc2.b"]
    return F.layer_norm(h, (H,), w["lnf.w"], w["lnf.b"], 1e-5) @ w["wte"].t()


def _args() -> argparse.Namespace:
    return argparse.Namespace(num_layers=L, hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                              max_position_embeddings=POS, padded_vocab_size=VOCAB, hidden_dropout=0.1,
                              attention_dropout=0.1, layernorm_epsilon=1e-5, tensor_model_parallel_size=2,
                              pipeline_model_parallel_size=1)


def write_megatron_legacy(path: Path, w: dict, tp: int = 2) -> None:
    """megatron/checkpointing.py's layout: column-parallel rows and row-parallel columns split over tp ranks."""
    def part(t, dim, r):
        return t.chunk(tp, dim=dim)[r].clone()

    step = path / "iter_0000005"
    for r in range(tp):
        enc = {}
        for i in range(L):
            p = f"layers.{i}."
            enc.update({p + "input_layernorm.weight": w[f"{i}.ln1.w"], p + "input_layernorm.bias": w[f"{i}.ln1.b"],
                        p + "self_attention.query_key_value.weight": part(w[f"{i}.qkv.w"], 0, r),
                        p + "self_attention.query_key_value.bias": part(w[f"{i}.qkv.b"], 0, r),
                        p + "self_attention.dense.weight": part(w[f"{i}.dense.w"], 1, r),
                        p + "self_attention.dense.bias": w[f"{i}.dense.b"],
                        p + "post_attention_layernorm.weight": w[f"{i}.ln2.w"],
                        p + "post_attention_layernorm.bias": w[f"{i}.ln2.b"],
                        p + "mlp.dense_h_to_4h.weight": part(w[f"{i}.fc1.w"], 0, r),
                        p + "mlp.dense_h_to_4h.bias": part(w[f"{i}.fc1.b"], 0, r),
                        p + "mlp.dense_4h_to_h.weight": part(w[f"{i}.fc2.w"], 1, r),
                        p + "mlp.dense_4h_to_h.bias": w[f"{i}.fc2.b"]})
        enc.update({"final_layernorm.weight": w["lnf.w"], "final_layernorm.bias": w["lnf.b"]})
        state = {"args": _args(), "checkpoint_version": 3.0, "iteration": 5,
                 "model": {"language_model": {
                     "embedding": {"word_embeddings": {"weight": part(w["wte"], 0, r)},
                                   "position_embeddings": {"weight": w["wpe"]}},
                     "encoder": enc}},
                 "optimizer": {"optimizer": {"state": {}}, "fp32_from_fp16_params": []},
                 "rng_state": [{"random_rng_state": None}]}
        (step / f"mp_rank_{r:02d}").mkdir(parents=True)
        torch.save(state, step / f"mp_rank_{r:02d}" / "model_optim_rng.pt")
    (path / "latest_checkpointed_iteration.txt").write_text("5")


def write_megatron_torch_dist(path: Path, w: dict) -> None:
    """Megatron core dist_checkpointing (torch_dist backend): one DCP state dict, layers stacked on a leading axis,
    TransformerEngine's fused layer norms, plus common.pt and metadata.json."""
    import torch.distributed.checkpoint as dcp

    def stack(name):
        return torch.stack([w[f"{i}.{name}"] for i in range(L)])

    sd = {"embedding.word_embeddings.weight": w["wte"], "embedding.position_embeddings.weight": w["wpe"],
          "decoder.layers.self_attention.linear_qkv.layer_norm_weight": stack("ln1.w"),
          "decoder.layers.self_attention.linear_qkv.layer_norm_bias": stack("ln1.b"),
          "decoder.layers.self_attention.linear_qkv.weight": stack("qkv.w"),
          "decoder.layers.self_attention.linear_qkv.bias": stack("qkv.b"),
          "decoder.layers.self_attention.linear_proj.weight": stack("dense.w"),
          "decoder.layers.self_attention.linear_proj.bias": stack("dense.b"),
          "decoder.layers.mlp.linear_fc1.layer_norm_weight": stack("ln2.w"),
          "decoder.layers.mlp.linear_fc1.layer_norm_bias": stack("ln2.b"),
          "decoder.layers.mlp.linear_fc1.weight": stack("fc1.w"), "decoder.layers.mlp.linear_fc1.bias": stack("fc1.b"),
          "decoder.layers.mlp.linear_fc2.weight": stack("fc2.w"), "decoder.layers.mlp.linear_fc2.bias": stack("fc2.b"),
          "decoder.final_layernorm.weight": w["lnf.w"], "decoder.final_layernorm.bias": w["lnf.b"]}
    step = path / "iter_0000007"
    dcp.save(sd, checkpoint_id=str(step))
    torch.save({"args": _args(), "iteration": 7, "checkpoint_version": 3.0}, step / "common.pt")
    (step / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (path / "latest_checkpointed_iteration.txt").write_text("7")


def _converted_logits(out: Path, ids: torch.Tensor) -> torch.Tensor:
    cfg = LazyConfig.load(out / "config.py")
    model = instantiate(cfg.model)
    Checkpointer(model).load(str(out), weights_only=True)
    with torch.no_grad():
        return model.eval()(ids)["logits"][..., :VOCAB]


@pytest.mark.parametrize("layout", ["legacy_tp2", "torch_dist"])
def test_megatron_gpt_converts_with_the_same_logits(tmp_path, layout):
    w = _weights()
    src = tmp_path / "megatron"
    (write_megatron_legacy if layout == "legacy_tp2" else write_megatron_torch_dist)(src, w)
    out = tmp_path / "ours"
    assert _tool().main(["--from", "megatron", "--input", str(src), "--output", str(out)]) == 0
    ids = torch.randint(0, VOCAB, (2, POS), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_converted_logits(out, ids), megatron_logits(w, ids), rtol=1e-4, atol=1e-4)
    # Handed to training unconverted (train.load_weight, --resume), the checkpoint and its iteration
    # folder are named with the converting command.
    name = "Megatron-LM legacy" if layout == "legacy_tp2" else "Megatron core torch_dist"
    for path in (src, next(src.glob("iter_*"))):
        with pytest.raises(UsageError, match=f"is a {name} checkpoint: convert it with python "
                                             f"tools/convert_checkpoint.py --from megatron"):
            read_metadata(str(path))


def test_other_checkpoints_are_named_not_called_corrupt(tmp_path, capsys):
    tool = _tool()
    libai = tmp_path / "libai" / "model_0000999" / "model" / "GPT_model.embeddings.token_embeddings.weight"
    libai.mkdir(parents=True)
    (libai / "meta").write_bytes(b"\x08\x01")
    (libai / "out").write_bytes(b"\x00" * 16)
    assert tool.main(["--from", "megatron", "--input", str(tmp_path / "libai"), "--output", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a LiBai (OneFlow) checkpoint" in err[0]
    (tmp_path / "empty").mkdir()
    assert tool.main(["--from", "megatron", "--input", str(tmp_path / "empty"), "--output", str(tmp_path / "o")]) == 1
    assert "is not a Megatron-LM checkpoint directory" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_converted_checkpoint_trains_alike_under_tp2_and_on_one_process(tmp_path):
    from tests.launch import ROOT as REPO, losses, train_net, train_sh

    src, out = tmp_path / "megatron", tmp_path / "ours"
    # The demo tokenizer's 8000 ids, padded as Megatron pads them (a multiple of 128).
    write_megatron_legacy(src, _weights(vocab=8064))
    demo = REPO / "data_test" / "gpt2"
    assert _tool().main(["--from", "megatron", "--input", str(src), "--output", str(out), "--vocab-file",
                         str(demo / "vocab.json"), "--merge-file", str(demo / "merges.txt")]) == 0
    common = [f"dataloader.train.data_prefix={demo / 'demo_gpt2_text_document'}", "train.train_iter=2",
              "train.evaluation.enabled=False", "train.train_micro_batch_size=2", "train.global_batch_size=2",
              "dataloader.train.num_workers=0", f"dataloader.train.cache_dir={tmp_path / 'cache'}",
              "train.log_period=1", "train.log_memory_estimate=False", "model.cfg.embedding_dropout_prob=0.0",
              "model.cfg.attention_dropout_prob=0.0", "model.cfg.output_dropout_prob=0.0"]
    one = train_net([*common, f"train.output_dir={tmp_path / 'one'}"], config=str(out / "config.py"))
    assert one.returncode == 0, one.stderr[-3000:]
    tp2 = train_sh(2, [*common, f"train.output_dir={tmp_path / 'tp2'}", "train.dist.tensor_parallel_size=2"],
                   config=str(out / "config.py"))
    assert tp2.returncode == 0, tp2.stderr[-3000:]
    a, b = losses(tmp_path / "one"), losses(tmp_path / "tp2")
    assert len(a) == 2 and a.keys() == b.keys()
    for it in a:  # float32 sums in another order across two ranks
        assert abs(a[it] - b[it]) < 1e-4 * abs(a[it]), (a, b)
