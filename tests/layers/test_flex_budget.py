"""Shared memory of the FlexAttention kernels at every shipped recipe's shapes, on A100 (sm80) and H100/H200
(sm90), worked out on the CPU.

What each recipe hands flex is recorded by running the library's own code (the MT5 model, or the mask
``MultiheadAttention`` builds for packed documents and a sliding window) with flex stubbed; the kernels'
block sizes come from torch's own heuristics (``InductorChoices().get_flex_attention_{fwd,bwd}_configs``
and ``get_flex_decode_configs``, ``torch.cuda.get_device_capability`` stubbed); what the ``score_mod`` and
``mask_mod`` read from the tensors they capture is traced by calling them on one tile of indices under a
dispatch mode. The model of a Triton flex kernel's shared memory (``kernel_need``):

* Q (and dO in the backward's dQ part; K and V in its dK/dV part), loaded once per program, stay in
  shared memory as MMA operands: ``rows x head_dim_rounded x itemsize`` each.
* The tensors streamed over the loop (K and V forward and for dQ; Q and dO for dK/dV) feed ``tl.dot`` and are
  multi-buffered by Triton's software pipeliner: ``num_stages - 1`` buffers, plus one on sm90 where the
  dot is a Hopper wgmma (4+ warps) (Triton's pipeliner: "for MMAv3 we need an extra buffer"); at least one.
* A read from a captured tensor is staged as the tile its indices span (``[BLOCK_M, BLOCK_N]`` for an
  index that depends on both ``q_idx`` and ``kv_idx``, ``[BLOCK_M, 1]`` for ``q_idx`` alone, ...) times the
  tensor's itemsize. Such reads do not feed a dot and are not multi-buffered: they pass one at a time
  through one staging buffer, so the largest counts. A gather whose index is itself read from a capture
  (``table[buckets[q, k], h]``) is issued from registers in the layout its index already has: 0 bytes.
* The backward kernel runs the dQ part or the dK/dV part per program: the larger of the two counts.

Calibration: the one kernel measured on a GPU, the MT5 recipe's encoder forward before the relative bias
was read by diagonal (an int64 ``[query, key]`` bucket map, a padding mask), is 16,384 (Q) + 3 x 32,768
(K, V) + 131,072 (the bucket map's 128 x 128 tile) = 245,760 bytes, the figure in "out of resource ...
Required: 245760 Hardware limit:232448"; summing the reads instead of taking the largest would give
245,888 (the padding mask's 128 bytes). Triton does not publish its allocator as a formula: where this
model is wrong, the GPU suite's recipe tests (tests/gpu) and the flex guard (libai_lite/utils/fallback.py)
are the next lines of defence.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional
from unittest import mock

import pytest
import torch
import torch.utils._pytree as pytree
from torch._inductor import config as inductor_config
from torch._inductor.choices import InductorChoices
from torch.utils._python_dispatch import TorchDispatchMode

import libai_lite.layers.flex_attention as flex_module
from libai_lite.utils.fallback import forward_backward_probe
from libai_lite.config import LazyConfig
from libai_lite.layers.flex_attention import AttentionMask, attention_backend, shared_mask
from projects.MT5 import MT5Model
from projects.MT5.data.t5_dataset import random_spans_helper
from projects.MT5.modeling.relative_position import RelativePositionBias

# The GPU paths a CPU can run: CI runs them under the lowest torch setup.py admits too.
pytestmark = pytest.mark.gpu_path

ROOT = Path(__file__).resolve().parents[2]
# cudaDevAttrMaxSharedMemoryPerBlockOptin: what Triton checks a kernel's shared memory against.
GPUS = {"sm80": ((8, 0), 166_912), "sm90": ((9, 0), 232_448)}
SPARSE_BLOCK = 128  # create_block_mask's default block size, which flex's BLOCK_M/BLOCK_N must divide


@dataclasses.dataclass
class Call:
    """One flex_attention call as the library makes it."""

    q_len: int
    k_len: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    score_mod: Optional[Callable]
    mask_mod: Optional[Callable]
    kernel_options: dict

    @property
    def label(self) -> str:
        bias = "+bias" if self.score_mod is not None else ""
        return f"{self.q_len}x{self.k_len} {self.heads}/{self.kv_heads}h d{self.head_dim} {self.dtype}{bias}"


@dataclasses.dataclass
class Read:
    tile: tuple
    itemsize: int
    indirect: bool

    @property
    def nbytes(self) -> int:
        return 0 if self.indirect else math.prod(self.tile) * self.itemsize


class _CapturedReads(TorchDispatchMode):
    """Records every read of a tensor the mod captured: the tile its indices span and the tensor's itemsize.

    Tensors the trace was given (score, b, h, q_idx, kv_idx) and computed from them are indices; any other
    tensor an op meets is a capture (views of it too); a non-view op on a capture reads it, and its result
    (and what is computed from that) holds loaded values, which make a later read indirect.
    """

    def __init__(self, given):
        super().__init__()
        self.kind = {id(t): ("index", t) for t in given}
        self.reads = []

    def _kind(self, t):
        entry = self.kind.get(id(t))
        return entry[0] if entry is not None and entry[1] is t else "capture"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        kinds = [self._kind(t) for t in ins]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if "capture" in kinds and func.is_view:
            new = "capture"
        elif "capture" in kinds:
            for t, kind in zip(ins, kinds):
                if kind == "capture":
                    self.reads.append(Read(tuple(outs[0].shape), t.element_size(), indirect="loaded" in kinds))
            new = "loaded"
        else:
            new = "loaded" if "loaded" in kinds else "index"
        for t in outs:
            self.kind[id(t)] = (new, t)
        return out


def captured_reads(call: Call, rows: int, cols: int, transposed: bool = False) -> list:
    """The reads ``call``'s score_mod and mask_mod make for one ``rows x cols`` tile of (query, key) pairs,
    indexed as flex's Triton templates index it (``q_idx`` ``[rows, 1]``, ``kv_idx`` ``[1, cols]``, bounded by
    the real lengths; the backward's dK/dV part holds the transposed tile)."""
    q_idx = torch.arange(rows, dtype=torch.int32) % call.q_len
    kv_idx = torch.arange(cols, dtype=torch.int32) % call.k_len
    q_idx, kv_idx = (q_idx[None, :], kv_idx[:, None]) if transposed else (q_idx[:, None], kv_idx[None, :])
    b, h = torch.tensor(0, dtype=torch.int32), torch.tensor(0, dtype=torch.int32)
    score = torch.zeros(tuple(torch.broadcast_shapes(q_idx.shape, kv_idx.shape)), dtype=call.dtype)
    tracer = _CapturedReads([score, b, h, q_idx, kv_idx])
    with tracer:
        if call.score_mod is not None:
            call.score_mod(score, b, h, q_idx, kv_idx)
        if call.mask_mod is not None:
            call.mask_mod(b, h, q_idx, kv_idx)
    return tracer.reads


def torch_configs(call: Call, capability: tuple) -> dict:
    """The kernels torch's inductor compiles for ``call`` on a GPU of ``capability``, with their blocks."""
    gqa = call.heads // call.kv_heads
    opts = call.kernel_options
    with mock.patch.object(torch.cuda, "get_device_capability", lambda *args: capability), \
            inductor_config.patch(max_autotune=False):
        choices = InductorChoices()
        fwd = choices.get_flex_attention_fwd_configs(call.head_dim, call.dtype, "cuda")
        bwd = choices.get_flex_attention_bwd_configs(call.head_dim, call.dtype, "cuda")
        dec = choices.get_flex_decode_configs(call.head_dim, call.dtype, "cuda")
    assert len(fwd) == len(bwd) == len(dec) == 1, "max_autotune is off: one default config each"
    fwd, bwd, dec = fwd[0], bwd[0], dec[0]

    def opt(name, default):
        return opts.get(name, default)

    kernels = {}
    # torch's _use_flex_decoding: a short query, a power-of-two GQA group, one block mask for all heads.
    if call.q_len < 128 and gqa & (gqa - 1) == 0 and not opts.get("FORCE_USE_FLEX_ATTENTION"):
        block_m = opt("BLOCK_M", max(1 << (call.q_len * gqa - 1).bit_length(), 16))
        kernels["decode"] = dict(block_m=block_m, block_n=opt("BLOCK_N", min(dec.block_n, SPARSE_BLOCK)),
                                 stages=opt("num_stages", dec.num_stages), warps=opt("num_warps", dec.num_warps))
    else:
        kernels["forward"] = dict(block_m=opt("fwd_BLOCK_M", opt("BLOCK_M", fwd.block_m)),
                                  block_n=opt("fwd_BLOCK_N", opt("BLOCK_N", fwd.block_n)),
                                  stages=opt("fwd_num_stages", opt("num_stages", fwd.num_stages)),
                                  warps=opt("fwd_num_warps", opt("num_warps", fwd.num_warps)))
    kernels["backward"] = dict(block_m1=opt("bwd_BLOCK_M1", opt("BLOCK_M1", bwd.block_m1)),
                               block_n1=opt("bwd_BLOCK_N1", opt("BLOCK_N1", bwd.block_n1)),
                               block_m2=opt("bwd_BLOCK_M2", opt("BLOCK_M2", bwd.block_m2)),
                               block_n2=opt("bwd_BLOCK_N2", opt("BLOCK_N2", bwd.block_n2)),
                               stages=opt("bwd_num_stages", opt("num_stages", bwd.num_stages)),
                               warps=opt("bwd_num_warps", opt("num_warps", bwd.num_warps)))
    return kernels


def kernel_need(call: Call, kernel: str, blocks: dict, gpu: str) -> int:
    """Bytes of shared memory ``kernel`` needs for ``call`` on ``gpu`` (the model in the module docstring)."""
    capability, _ = GPUS[gpu]
    isz = torch.empty((), dtype=call.dtype).element_size()
    qk = 1 << (call.head_dim - 1).bit_length()  # the templates pad head dims to a power of two
    v = 1 << (call.v_head_dim - 1).bit_length()
    mmav3 = capability == (9, 0) and blocks["warps"] >= 4
    buffers = max(blocks["stages"] - 1 + int(mmav3), 1)

    def staged(rows, cols, transposed=False):
        return max([r.nbytes for r in captured_reads(call, rows, cols, transposed)], default=0)

    if kernel in ("forward", "decode"):
        m, n = blocks["block_m"], blocks["block_n"]
        return m * qk * isz + buffers * n * (qk + v) * isz + staged(m, n)
    dq = blocks["block_m2"] * (qk + v) * isz + buffers * blocks["block_n2"] * (qk + v) * isz \
        + staged(blocks["block_m2"], blocks["block_n2"])
    dkdv = blocks["block_n1"] * (qk + v) * isz + buffers * blocks["block_m1"] * (qk + v) * isz \
        + staged(blocks["block_m1"], blocks["block_n1"], transposed=True)
    return max(dq, dkdv)


def over_budget(calls, gpus=GPUS) -> list:
    """``(call, kernel, gpu, need, limit)`` for every kernel of ``calls`` that needs more than the GPU has."""
    over = []
    for call in calls:
        for gpu, (capability, limit) in gpus.items():
            for kernel, blocks in torch_configs(call, capability).items():
                need = kernel_need(call, kernel, blocks, gpu)
                if need > limit:
                    over.append((call.label, kernel, gpu, need, limit))
    return over


# ---------------------------------------------------------------- what the recipes hand flex


def record_flex_calls(monkeypatch) -> dict:
    """Stub flex: each distinct call's shapes, dtype, score_mod, mask_mod and kernel_options go into the
    returned dict, in order (the guard's probe repeats a call)."""
    calls = {}

    def record(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
               kernel_options=None, **_):
        call = Call(query.shape[-2], key.shape[-2], query.shape[1], key.shape[1], query.shape[-1], value.shape[-1],
                    query.dtype, score_mod, None if block_mask is None else block_mask.mask_mod,
                    dict(kernel_options or {}))
        # Keyed by the mask too: a ragged decoder padded to the encoder's tile has the encoder's shapes.
        calls.setdefault((call.label, None if block_mask is None else id(block_mask)), call)
        return query.new_zeros(query.shape[:-1] + (value.shape[-1],))

    def block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cuda", **_):
        # The real one evaluates mask_mod over every (query, key) pair; only mask_mod matters here.
        return SimpleNamespace(mask_mod=mask_mod, shape=(B, H, Q_LEN, KV_LEN))

    monkeypatch.setattr(flex_module, "flex_attention", record)
    monkeypatch.setattr(flex_module, "create_block_mask", block_mask)
    # The stub's zeros are not attention: the guard only runs it (no comparison with the dense path).
    monkeypatch.setattr(flex_module._flex_or_dense, "probe", forward_backward_probe)
    return calls


@pytest.fixture
def recorded(monkeypatch):
    flex_module._flex_or_dense.reset()
    yield record_flex_calls(monkeypatch)
    flex_module._flex_or_dense.reset()


def _config(name: str):
    return LazyConfig.load(str(ROOT / name))


def mt5_calls(recorded, name: str) -> list:
    """Run the recipe's attention (its heads, head size, buckets, dropout, precision and sequence lengths)
    through a one-layer-per-stack MT5 model; return the flex calls it made."""
    cfg = _config(name)
    m, data = cfg.model.cfg, cfg.dataloader.train
    enc_len = int(data.max_seq_length)
    dec_len = data.max_seq_length_dec or random_spans_helper(enc_len, data.masked_lm_prob, data.mean_span_length)[1]
    model = MT5Model(dict(vocab_size=64, hidden_size=64, hidden_layers=1, num_attention_heads=m.num_attention_heads,
                          head_size=m.head_size, intermediate_size=64, model_type=m.model_type,
                          relative_attention_num_buckets=m.relative_attention_num_buckets,
                          relative_attention_max_distance=m.relative_attention_max_distance,
                          embedding_dropout_prob=0.0, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=m.attention_probs_dropout_prob))
    batch = 2
    enc, dec = torch.randint(0, 64, (batch, enc_len)), torch.randint(0, 64, (batch, int(dec_len)))
    enc_mask, dec_mask = torch.ones_like(enc, dtype=torch.bool), torch.ones_like(dec, dtype=torch.bool)
    enc_mask[1, enc_len // 2:] = False
    dec_mask[1, int(dec_len) // 2:] = False
    amp = cfg.train.amp
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp.dtype] if amp.enabled else torch.float32
    with attention_backend("flex"), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        model(enc, dec, enc_mask, dec_mask)
    return list(recorded.values())


def packed_calls(recorded, name: str, seq: Optional[int] = None, window: Optional[int] = None) -> list:
    """The flex call of the recipe's causal self-attention over packed documents (and a sliding window):
    the mask ``MultiheadAttention`` builds for them, with queries, keys and values of the recipe's shapes on meta."""
    cfg = _config(name)
    m = cfg.model.cfg
    seq = int(seq or m.max_seq_length)
    heads = int(m.num_attention_heads)
    kv_heads = int(m.get("num_key_value_heads") or heads)
    head_size = int(m.get("head_size") or m.hidden_size // heads)
    window = window if window is not None else m.get("sliding_window")
    dtype = torch.bfloat16 if cfg.train.amp.enabled else torch.float32
    q = torch.empty(1, heads, seq, head_size, dtype=dtype, device="meta")
    kv = torch.empty(1, kv_heads, seq, head_size, dtype=dtype, device="meta")
    docs = (torch.arange(seq) // 700)[None]  # documents of 700 tokens
    mask = shared_mask(seq, seq, causal=True, window=window, document_ids=docs, device="cpu", flex=True)
    flex_module.flex_attend(q, kv, kv, mask, scale=None)
    return list(recorded.values())


MT5_RECIPES = ["projects/MT5/configs/mt5_small.py", "projects/MT5/configs/mt5_base.py",
               "projects/MT5/configs/mt5_large.py", "projects/MT5/configs/mt5_pretrain.py",
               "projects/MT5/configs/t5_moe.py"]
PACKED_RECIPES = [  # (config, sequence, sliding window)
    ("projects/Llama/configs/tinyllama_1.1B.py", None, None),
    ("projects/Llama/configs/llama3_8B.py", 8192, None),
    ("projects/Llama/configs/mistral_7B.py", 8192, 4096),  # v0.1's window
    ("projects/Llama/configs/qwen2_7B.py", 4096, None),
    ("projects/GPT/configs/gpt2_345M.py", None, None),
    ("projects/GPT/configs/gpt2_1.3B.py", None, None),
    ("projects/GPT/configs/gpt2_2.7B.py", None, None),  # head size 80
    ("projects/GPT/configs/gpt2_3.7B.py", None, None),  # head size 96
]


@pytest.mark.parametrize("name", MT5_RECIPES)
def test_mt5_recipes_flex_kernels_fit_sm80_and_sm90(recorded, name):
    calls = mt5_calls(recorded, name)
    # Encoder self-attention with the bias, decoder self-attention with it, cross-attention without.
    assert [c.score_mod is not None for c in calls] == [True, True, False], [c.label for c in calls]
    encoder = calls[0]
    reads = captured_reads(encoder, 128, 128)
    # The bias is one direct read of a [BLOCK_M, BLOCK_N] tile of the table's rows, in the attention's dtype.
    assert any(r.tile == (128, 128) and not r.indirect and r.itemsize == encoder.dtype.itemsize for r in reads)
    assert over_budget(calls) == []


@pytest.mark.parametrize("name,seq,window", PACKED_RECIPES)
def test_packed_document_recipes_flex_kernels_fit_sm80_and_sm90(recorded, name, seq, window):
    calls = packed_calls(recorded, name, seq, window)
    assert len(calls) == 1 and calls[0].score_mod is None
    # The document ids are read per query row and per key column: [BLOCK_M, 1] and [1, BLOCK_N] int64.
    assert sorted(r.tile for r in captured_reads(calls[0], 128, 64)) == [(1, 64), (128, 1)]
    assert over_budget(calls) == []


def test_the_budget_model_catches_the_mt5_crash_of_the_bucket_map_capture():
    """The score_mod before this change gathered ``table[buckets[q, k], h]`` from an int64 [query, key] map:
    at the MT5 recipe's encoder shapes the model gives the 245,760 bytes the H200 reported, over sm90's limit."""
    rel = RelativePositionBias(32, 12, bidirectional=True)
    table, buckets = rel.table().detach().to(torch.bfloat16), rel.buckets(512, 512)
    padding = torch.ones(16, 512, dtype=torch.bool)

    def old_score_mod(score, b, h, q_idx, kv_idx):
        return score + table[buckets[q_idx, kv_idx], h]

    call = Call(512, 512, 12, 12, 64, 64, torch.bfloat16, old_score_mod,
                AttentionMask(512, 512, key_padding=padding).mask_mod(), {})
    blocks = torch_configs(call, GPUS["sm90"][0])["forward"]
    assert (blocks["block_m"], blocks["block_n"], blocks["stages"]) == (128, 128, 3)
    assert kernel_need(call, "forward", blocks, "sm90") == 245_760
    assert over_budget([call]) == [(call.label, "forward", "sm90", 245_760, 232_448)]


if __name__ == "__main__":  # the table behind the tests: python tests/layers/test_flex_budget.py
    for recipe in MT5_RECIPES + PACKED_RECIPES:
        with pytest.MonkeyPatch.context() as patch:
            rec = record_flex_calls(patch)
            calls = mt5_calls(rec, recipe) if recipe in MT5_RECIPES else packed_calls(rec, *recipe)
        for call in calls:
            for gpu, (capability, limit) in GPUS.items():
                for kernel, blocks in torch_configs(call, capability).items():
                    name = recipe if isinstance(recipe, str) else recipe[0]
                    print(f"{Path(name).stem:15s} {call.label:42s} {gpu} {kernel:8s} "
                          f"{kernel_need(call, kernel, blocks, gpu):>7d} / {limit}  {blocks}")
