"""ATen ops and host reads per training step (forward + backward) of Llama, MT5 and an MoE layer, on the CPU.

Every ATen op the dispatcher runs below autograd is one kernel launch on a GPU (a few, such as views,
launch nothing; they are counted apart), so the count predicts launch overhead where shapes are small
and eager mode runs; host reads (``aten._local_scalar_dense``: ``.item()``/``float()``/``bool()``,
``aten.nonzero``, boolean-mask ``aten.index``, and ops whose output size depends on the data:
``bincount``, ``masked_select``, ``repeat_interleave`` without ``output_size``; ``torch.equal``,
``Tensor.tolist``; counted by ``bench/host_reads.py``) are each a GPU stall.
The models are tiny (the counts do not depend on the widths, only on the structure); a warm-up step
runs first. Prints one table and, last, one JSON line. ``--smoke`` is the same at the smallest sizes.
``--moe-experts`` adds an MoE layer's experts run one by one against ``torch._grouped_mm``.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from host_reads import HostReadCounter  # noqa: E402  (after the repo root is on the path)

# Ops a GPU runs without a kernel (metadata only).
_VIEWS = {"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze",
          "slice", "select", "split", "split_with_sizes", "chunk", "unbind", "as_strided", "detach", "alias",
          "view_as_real", "view_as_complex", "unflatten", "flatten", "_reshape_alias", "narrow", "diagonal",
          "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "promote_types",
          "result_type", "sym_size", "sym_stride", "sym_numel", "is_same_size"}


class CountOps(HostReadCounter):
    """Counts ATen ops (views apart) and, as ``HostReadCounter`` with ``tolist``, host reads while active."""

    def __init__(self):
        super().__init__(tolist=True)
        self.ops = collections.Counter()
        self.host_reads = self.counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops["<views>" if name in _VIEWS else name] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)

    @property
    def kernels(self) -> int:
        """Ops that launch work (views excluded)."""
        return sum(n for k, n in self.ops.items() if k != "<views>")


def _llama(smoke: bool):
    from projects.Llama.configs.model import cfg as base
    from projects.Llama.modeling.llama_model import LlamaForPreTraining

    cfg = dict(base)
    cfg.update(hidden_layers=2 if smoke else 4, vocab_size=128, hidden_size=64, ffn_hidden_size=160,
               num_attention_heads=4, num_key_value_heads=2, max_seq_length=32, attention_dropout_prob=0.0,
               output_dropout_prob=0.0, moe=None)
    model = LlamaForPreTraining(cfg)
    ids = torch.randint(0, 128, (2, 32))
    return model, lambda: model(input_ids=ids, labels=ids)


def _mt5(smoke: bool):
    from projects.MT5 import MT5ForPreTraining

    cfg = dict(vocab_size=128, hidden_size=64, hidden_layers=2 if smoke else 4, num_attention_heads=4, head_size=16,
               intermediate_size=160, embedding_dropout_prob=0.0, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, model_type="mt5")
    model = MT5ForPreTraining(cfg)
    enc, dec = torch.randint(0, 128, (2, 32)), torch.randint(0, 128, (2, 8))
    ones_e, ones_d = torch.ones(2, 32, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    return model, lambda: model(encoder_input_ids=enc, decoder_input_ids=dec, labels=dec, encoder_attn_mask=ones_e,
                                decoder_attn_mask=ones_d, encoder_decoder_attn_mask=None)


def _moe(smoke: bool):
    from libai_lite.layers import MoEConfig, MoELayer, collect_moe_outputs

    cfg = MoEConfig(enabled=True, num_experts=4, top_k=2, capacity_factor=1.25)
    layer = MoELayer(cfg, hidden_size=64, ffn_hidden_size=160, activation="silu", gated=True, bias=False)
    x = torch.randn(2, 32, 64)

    def step():
        out = layer(x)
        aux = collect_moe_outputs(layer)["moe_aux_loss"]
        return {"lm_loss": out.float().square().mean() + aux}

    return layer, step


MODELS = {"llama": _llama, "mt5": _mt5, "moe_layer": _moe}


# ------------------------------------------------------------------ components: the replaced code, kept here
def _old_rms_norm(x, weight, eps=1e-6):
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def _old_rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _old_rotary_layer(head_size, q, k, position_ids):
    """One attention's rotary work before: angles recomputed in every layer, five kernels per apply."""
    from libai_lite.layers.rotary import rope_inv_freq

    inv_freq = rope_inv_freq(head_size, 10000.0, None, device=q.device)
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
    return q * cos + _old_rotate_half(q) * sin, k * cos + _old_rotate_half(k) * sin


def _components():
    """``{name: (old step, new step, what one step is)}``; each step returns a tensor to back-propagate."""
    import torch.nn.functional as F

    from libai_lite.layers import MLP, RMSLayerNorm
    from libai_lite.layers.mlp import split_gate_up
    from libai_lite.layers.rotary import RotaryEmbedding, apply_rotary

    x = torch.randn(2, 32, 64, requires_grad=True)
    norm = RMSLayerNorm(64)
    mlp = MLP(64, 160, activation="silu", gated=True, bias=False)
    gate, up = (torch.nn.Parameter(t.detach().clone()) for t in split_gate_up(mlp.dense_h_to_4h.weight))

    def old_mlp():
        return mlp.dense_4h_to_h(F.silu(F.linear(x, gate)) * F.linear(x, up))

    layers, heads, hd = 4, 4, 16
    q = torch.randn(2, heads, 32, hd, requires_grad=True)
    k = torch.randn(2, 2, 32, hd, requires_grad=True)
    rotaries = [RotaryEmbedding(hd) for _ in range(layers)]

    def old_rotary():
        pos = torch.arange(32)[None]
        return sum(sum(t.sum() for t in _old_rotary_layer(hd, q, k, pos)) for _ in range(layers))

    def new_rotary():
        pos = torch.arange(32)[None]  # what LlamaModel.forward hands every layer
        out = 0
        for rotary in rotaries:
            cos, sin = rotary(pos, q.dtype)
            out = out + apply_rotary(q, cos, sin).sum() + apply_rotary(k, cos, sin).sum()
        return out

    return {
        "rms_norm": (lambda: _old_rms_norm(x, norm.weight), lambda: norm(x), "one norm"),
        "gated_mlp": (old_mlp, lambda: mlp(x), "one SwiGLU MLP"),
        "rotary": (old_rotary, new_rotary, f"q and k of {layers} layers"),
    }


def count_components() -> dict:
    """ATen ops (views apart) of each replaced piece, old and new, forward and backward apart."""
    out = {}
    for name, (old, new, what) in _components().items():
        row = {"per": what}
        for label, fn in (("old", old), ("new", new)):
            for _ in range(2):  # the second is counted (caches warm, as in a training step)
                with CountOps() as fwd:
                    y = fn()
                with CountOps() as bwd:
                    y.float().sum().backward()
            row[label] = {"forward": fwd.kernels, "backward": bwd.kernels}
        out[name] = row
    return out


def count_moe_experts(experts: int = 8, top_k: int = 2, tokens: int = 256) -> dict:
    """ATen ops (views apart) of one MoE layer's experts, forward and backward apart, on the dropless path:
    the per-expert loop against the grouped GEMMs (``torch._grouped_mm`` runs on the CPU too; on a GPU each
    counted op is a kernel, so the GPU figures are predicted). The routing around the experts is the same
    on both paths and is not counted."""
    from libai_lite.layers import MoEConfig, MoELayer
    from libai_lite.layers import experts as experts_module

    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(enabled=True, num_experts=experts, top_k=top_k, capacity_factor=None),
                     hidden_size=64, ffn_hidden_size=160, activation="silu", gated=True, bias=False)
    sizes = [len(c) for c in torch.arange(tokens * top_k).chunk(experts)]  # a balanced router's counts
    x = torch.randn(tokens * top_k, 64, requires_grad=True)
    row = {"experts": experts, "top_k": top_k, "rows": tokens * top_k}
    saved = experts_module._grouped_eligible
    try:
        for label, grouped in (("loop", False), ("grouped", True)):
            layer.experts.grouped_gemm = grouped
            experts_module._grouped_eligible = lambda *_: True  # as on CUDA in bf16; the op count is the same
            experts_module.GROUPED_EXPERTS.reset()
            for _ in range(2):  # the first call runs the guard's probe; the second is counted
                layer.zero_grad(set_to_none=True)
                with CountOps() as fwd:
                    y = layer.experts(x, sizes)
                with CountOps() as bwd:
                    y.backward(torch.ones_like(y))
            row[label] = {"forward": fwd.kernels, "backward": bwd.kernels,
                          "top_ops": dict((fwd.ops + bwd.ops).most_common(6))}
    finally:
        experts_module._grouped_eligible = saved
        experts_module.GROUPED_EXPERTS.reset()
    return row


def count(name: str, smoke: bool) -> dict:
    """ATen ops (views apart), views, and host reads in one forward+backward of ``name`` after a warm-up."""
    torch.manual_seed(0)
    model, step = MODELS[name](smoke)
    model.train()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with CountOps() as c:
            step()["lm_loss"].backward()
    return {"kernels": c.kernels, "views": c.ops["<views>"], "host_reads": sum(c.host_reads.values()),
            "host_read_ops": dict(c.host_reads), "top_ops": dict(c.ops.most_common(12))}


def main(argv=None) -> dict:
    """Count each model's ops; print a table and one JSON line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {list(MODELS)}")
    p.add_argument("--smoke", action="store_true", help="two-layer models: checks the script runs")
    p.add_argument("--components", action="store_true",
                   help="also count the replaced pieces (RMSNorm, gated MLP, rotary) old against new")
    p.add_argument("--moe-experts", action="store_true",
                   help="also count one MoE layer's experts (8, top-2): the per-expert loop against grouped GEMMs")
    args = p.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        print(f"error: unknown model {unknown[0]!r} in --models; choose from {', '.join(MODELS)}", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(1)
    result = {n: count(n, args.smoke) for n in names}
    print(f"{'model':10} {'kernels':>8} {'views':>6} {'host reads':>10}  host-read ops")
    for n, r in result.items():
        print(f"{n:10} {r['kernels']:8d} {r['views']:6d} {r['host_reads']:10d}  {r['host_read_ops']}")
    if args.components:
        result["components"] = count_components()
        print(f"\n{'component':10} {'old fwd':>8} {'old bwd':>8} {'new fwd':>8} {'new bwd':>8}  per")
        for n, r in result["components"].items():
            print(f"{n:10} {r['old']['forward']:8d} {r['old']['backward']:8d} {r['new']['forward']:8d} "
                  f"{r['new']['backward']:8d}  {r['per']}")
    if args.moe_experts:
        r = result["moe_experts"] = count_moe_experts()
        print(f"\nMoE experts ({r['experts']} experts, top-{r['top_k']}, {r['rows']} rows; GPU kernels predicted)")
        print(f"{'path':10} {'forward':>8} {'backward':>8}")
        for label in ("loop", "grouped"):
            print(f"{label:10} {r[label]['forward']:8d} {r[label]['backward']:8d}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
