"""MultiheadAttention's ``qk_norm``: an RMS norm over each query and key head before the rotary embedding, its
cached decoding, and tensor parallelism over 2 gloo ranks (the replicated scales' gradients summed over heads)."""
import math
import os
import socket

import pytest
import torch
from torch import nn

from libai_lite.layers import MultiheadAttention
from libai_lite.layers.attention import KVCache
from libai_lite.layers.rotary import RotaryEmbedding, apply_rotary
from tests.launch import spawn_ranks

HIDDEN, HEADS, KV, HEAD_SIZE = 32, 4, 2, 16  # head_size * heads != hidden, as Qwen3's


def _attention(seed=0):
    torch.manual_seed(seed)
    attn = MultiheadAttention(HIDDEN, HEADS, num_key_value_heads=KV, head_size=HEAD_SIZE, bias=False,
                              rope_theta=1e6, qk_norm=True, qk_norm_eps=1e-6)
    with torch.no_grad():
        # Norm scales start at 1: random ones expose q's and k's swapped or one left out.
        attn.q_norm.weight.normal_(1.0, 0.3)
        attn.k_norm.weight.normal_(1.0, 0.3)
    return attn


def _reference(x, attn):
    """Plain math: separate q/k/v rows, RMS norm per head (scale times x / rms), rotate, causal softmax."""
    bsz, t, _ = x.shape
    g, hd = HEADS // KV, HEAD_SIZE
    blocks = attn.query_key_value.weight.view(KV, g + 2, hd, HIDDEN)
    q = (x @ blocks[:, :g].reshape(-1, HIDDEN).T).view(bsz, t, HEADS, hd)
    k = (x @ blocks[:, g].reshape(-1, HIDDEN).T).view(bsz, t, KV, hd)
    v = (x @ blocks[:, g + 1].reshape(-1, HIDDEN).T).view(bsz, t, KV, hd).transpose(1, 2)

    def rms(h, w):
        return w * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)

    cos, sin = RotaryEmbedding(hd, 1e6)(torch.arange(t))
    q = apply_rotary(rms(q, attn.q_norm.weight).transpose(1, 2), cos, sin)
    k = apply_rotary(rms(k, attn.k_norm.weight).transpose(1, 2), cos, sin)
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1),
                                                                   float("-inf"))
    return attn.dense((scores.softmax(-1) @ v).transpose(1, 2).reshape(bsz, t, -1))


def test_qk_norm_normalises_each_head_before_rotary_as_plain_math():
    attn = _attention().eval()
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (HEAD_SIZE,)
    x = torch.randn(2, 7, HIDDEN)
    torch.testing.assert_close(attn(x), _reference(x, attn), atol=1e-5, rtol=1e-5)
    assert "qk_norm" in repr(attn)
    assert MultiheadAttention(HIDDEN, HEADS).q_norm is None  # off by default: no parameters added


def test_qk_norm_cached_decoding_equals_the_whole_sequence():
    attn = _attention().eval()
    x = torch.randn(2, 6, HIDDEN)
    full = attn(x)
    cache = KVCache(capacity=6)
    steps = [attn(x[:, :3], kv_cache=cache)] + [attn(x[:, i : i + 1], kv_cache=cache) for i in range(3, 6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_qk_norm_under_bf16_autocast_caches_keys_in_the_values_dtype():
    attn = _attention().eval()
    cache = KVCache(capacity=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(torch.randn(2, 6, HIDDEN), kv_cache=cache)
    assert out.dtype == cache.key.dtype == cache.value.dtype == torch.bfloat16


def test_qk_norm_is_refused_for_cross_attention():
    with pytest.raises(ValueError, match="qk_norm"):
        MultiheadAttention(HIDDEN, HEADS, attn_mask_type="padding", is_cross_attention=True, qk_norm=True)


class _Block(nn.Module):
    # Tensor parallelism plans the blocks under a root (sequence parallelism gathers a block's inputs).
    def __init__(self):
        super().__init__()
        self.attn = _attention()

    def forward(self, x):
        return self.attn(x)


def _one_process():
    block = _Block()
    x = torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(1))
    out = block(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {n: p.grad for n, p in block.named_parameters()}


def _plain(t):
    # A collective's result may be an AsyncCollectiveTensor, which torch.load's weights_only refuses.
    return torch.from_numpy(t.detach().numpy().copy())


def _tp_ranks(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from libai_lite.parallel.tensor_parallel import apply_tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(2, 8, HIDDEN, generator=torch.Generator().manual_seed(1))
    results = {}
    for sp in (False, True):
        block = apply_tensor_parallel(_Block(), mesh, sequence_parallel=sp)
        # Under sequence parallelism the block takes and gives this rank's slice of the sequence.
        got = block(x.chunk(world, dim=1)[rank] if sp else x)
        full = torch.cat([torch.empty_like(got) for _ in range(world)], dim=1) if sp else got
        if sp:
            dist.all_gather(list(full.chunk(world, dim=1)), got.contiguous())
        weights = torch.linspace(-1, 1, full.numel()).view_as(full)
        (got * (weights.chunk(world, dim=1)[rank] if sp else weights)).sum().backward()
        grads = {n: _plain(p.grad.full_tensor()) for n, p in block.named_parameters()}
        results[sp] = {"out": _plain(full), "grads": grads,
                       "placements": {n: str(p.placements[0]) for n, p in block.named_parameters()}}
    if rank == 0:
        torch.save(results, os.path.join(out, "tp.pt"))
    dist.barrier()  # every rank past its last collective before gloo is torn down
    dist.destroy_process_group()


def test_qk_norm_under_tensor_parallel_2_matches_one_process(tmp_path):
    """tp=2 (one key/value group per rank), with and without sequence parallelism: the output and every
    gradient equal one process's; the norm scales stay replicated and their gradients sum both ranks' heads."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_ranks(_tp_ranks, 2, (2, port, str(tmp_path)))
    got = torch.load(tmp_path / "tp.pt")
    expected_out, expected_grads = _one_process()
    for sp in (False, True):
        torch.testing.assert_close(got[sp]["out"], expected_out, atol=1e-5, rtol=1e-5)
        assert got[sp]["grads"].keys() == expected_grads.keys()
        for name, grad in expected_grads.items():
            torch.testing.assert_close(got[sp]["grads"][name], grad, atol=1e-5, rtol=1e-5, msg=name)
        assert got[sp]["placements"]["attn.q_norm.weight"] == got[sp]["placements"]["attn.k_norm.weight"] == \
            "R"
        assert got[sp]["placements"]["attn.query_key_value.weight"] == "S(0)"
