"""The SBP vocabulary (libai_lite.sbp), what each layer declares with it, and the split-size check."""
import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from libai_lite.layers import (
    MLP,
    Embedding,
    LayerNorm,
    Linear1D,
    MultiheadAttention,
    RMSLayerNorm,
    VocabEmbedding,
)
from libai_lite.sbp import (
    LayerSBP,
    broadcast,
    declare,
    hidden,
    nd_sbp,
    partial_sum,
    placements,
    shorthand,
    split,
)
from libai_lite.parallel.tensor_parallel import check_declared_splits
from libai_lite.utils.errors import UsageError
from projects.MT5.modeling.relative_position import RelativePositionBias

from tests.workers.tp_worker import TINY_GPT, build


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------- the vocabulary


def test_each_sbp_is_its_dtensor_placement():
    assert split(0) == Shard(0) and split(-1) == Shard(-1)
    assert broadcast == Replicate()
    assert partial_sum == Partial()


def test_nd_sbp_is_placements_on_the_dp_tp_mesh():
    sbp = nd_sbp(split(0), broadcast)
    assert placements(sbp, ("dp", "tp")) == (Shard(0), Replicate())
    assert placements(sbp, ("tp",)) == (Replicate(),)
    assert placements(sbp) == (Replicate(),)  # the tp entry by default


def test_hidden_resolves_to_the_sequence_slice_only_under_sequence_parallelism():
    sbp = nd_sbp(split(0), hidden)
    assert placements(sbp) == (Replicate(),)
    assert placements(sbp, sequence_parallel=True) == (Shard(1),)
    assert copy.deepcopy(sbp)[1] is hidden  # models are deep-copied (pipeline stages, references)


def test_bad_sbp_is_refused_in_one_line():
    with pytest.raises(UsageError) as info:
        nd_sbp(split(0), "broadcast")
    assert "tp entry must be split(d), broadcast, partial_sum or hidden, got 'broadcast'" in _one_line(info)
    with pytest.raises(UsageError) as info:
        split("0")
    assert "split() takes a tensor dimension" in _one_line(info)
    with pytest.raises(UsageError) as info:
        placements(nd_sbp(broadcast, broadcast), ("pp",))
    assert "not ['pp']" in _one_line(info)


def test_declare_fills_the_data_parallel_entries():
    d = declare(weight=split(0), bias=split(0), input=broadcast, output=split(-1))
    assert d == LayerSBP(
        weight=(Replicate(), Shard(0)), bias=(Replicate(), Shard(0)),
        input=(Shard(0), Replicate()), output=(Shard(0), Shard(-1)),
    )
    assert declare().weight is None and declare().bias is None


def test_declared_args_are_found_in_the_forward_signature():
    attn = MultiheadAttention(16, 2, attn_mask_type="padding", is_cross_attention=True)
    assert attn.sbp.arg_positions(attn.forward) == ((0, 2), ("hidden_states", "encoder_states"))
    with pytest.raises(UsageError) as info:
        declare(args=("x",)).arg_positions(MLP(8, 16).forward)
    assert "names inputs ['x']" in _one_line(info)


def test_unknown_shorthand_is_refused_in_one_line():
    with pytest.raises(UsageError) as info:
        Linear1D(4, 4, parallel="column")
    assert _one_line(info) == "Linear1D parallel must be 'col', 'row', 'vocab' or 'data', got 'column'"
    with pytest.raises(UsageError) as info:
        Embedding(4, 4, parallel="row")
    assert _one_line(info) == "Embedding parallel must be 'data', 'vocab' or 'col', got 'row'"
    lin = Linear1D(4, 4, parallel="col")
    with pytest.raises(UsageError):
        lin.parallel = "rows"
    assert lin.parallel == "col"
    with pytest.raises(UsageError):
        shorthand({"a": declare()}, "b", "Thing")


# ---------------------------------------------------------------- what the layers declare


def _tp(sbp):
    return None if sbp is None else placements(sbp)[0]


def _declared(layer):
    s = layer.sbp
    return _tp(s.weight), _tp(s.bias), _tp(s.input), _tp(s.output)


@pytest.mark.parametrize(
    "parallel,expected",
    [
        ("col", (split(0), split(0), broadcast, split(-1))),
        ("row", (split(1), broadcast, split(-1), partial_sum)),
        ("vocab", (split(0), split(0), broadcast, split(-1))),  # input: the hidden states, whole without SP
        ("data", (broadcast, broadcast, broadcast, broadcast)),
    ],
)
def test_linear1d_declares_its_shorthand(parallel, expected):
    lin = Linear1D(8, 4, parallel=parallel)
    assert _declared(lin) == expected
    assert lin.sbp.input[0] == split(0) and lin.sbp.weight[0] == broadcast  # dp: batch split, weights whole


def test_reassigning_the_shorthand_redeclares():
    lin = Linear1D(8, 4, parallel="col")
    lin.parallel = "row"
    assert _declared(lin)[0] == split(1)


def test_embeddings_norms_and_the_t5_bias_table():
    assert _declared(VocabEmbedding(16, 4)) == (split(0), None, broadcast, partial_sum)
    assert _declared(Embedding(16, 4))[0] == broadcast and Embedding(16, 4).sbp.output[1] is hidden
    table = RelativePositionBias(8, 4, bidirectional=True)
    assert table.parallel == "col" and _declared(table) == (split(1), None, broadcast, split(-1))
    for norm in (LayerNorm(4), RMSLayerNorm(4)):
        assert _declared(norm)[:2] == (broadcast, broadcast)
        assert norm.sbp.input[1] is hidden and norm.sbp.output[1] is hidden


def test_attention_splits_whole_heads_and_blocks_need_whole_inputs():
    attn = MultiheadAttention(24, 4, head_size=6)
    assert attn.query_key_value.sbp.unit == 18 and attn.dense.sbp.unit == 6
    assert attn.sbp.weight is None and _tp(attn.sbp.input) == broadcast
    assert MLP(8, 16).sbp.args == ("hidden_states",)


# ---------------------------------------------------------------- split sizes from the declarations


def test_declared_splits_pass_for_sizes_that_divide():
    with torch.device("meta"):
        model = build("gpt")
    for tp in (1, 2, 4):
        check_declared_splits(model, tp)


@pytest.mark.parametrize(
    "override,tp,expected",
    [
        (dict(vocab_size=132), 3,
         "tensor_parallel_size=3 does not divide dim 0 of GPT_model.layers.0.self_attention.query_key_value.weight: "
         "4 blocks of 48 (whole heads); use a tensor_parallel_size that divides 4 (1, 2 or 4)"),
        (dict(ffn_hidden_size=250), 4,
         "tensor_parallel_size=4 does not divide dim 0 of GPT_model.layers.0.mlp.dense_h_to_4h.weight: 250; "
         "use a tensor_parallel_size that divides 250 (1, 2, 5, 10, 25, 50, 125 or 250)"),
    ],
)
def test_declared_split_that_tp_does_not_divide_is_named(override, tp, expected):
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    with torch.device("meta"):
        model = GPTForPreTraining({**TINY_GPT, **override})
    with pytest.raises(UsageError) as info:
        check_declared_splits(model, tp)
    assert _one_line(info) == expected


def test_vocab_split_refusal_points_at_padding():
    from projects.GPT.modeling.gpt_model import GPTForPreTraining

    with torch.device("meta"):
        model = GPTForPreTraining({**TINY_GPT, "vocab_size": 130})
    with pytest.raises(UsageError) as info:
        check_declared_splits(model, 4)
    msg = _one_line(info)
    assert msg.startswith("tensor_parallel_size=4 does not divide dim 0 of GPT_model.embeddings.token_embeddings.weight")
    assert "make_vocab_size_divisible_by" in msg
    with pytest.raises(UsageError, match="at least 1"):
        check_declared_splits(model, 0)


def test_t5_heads_not_their_width_are_split():
    table = nn.ModuleDict({"bias": RelativePositionBias(8, 6, bidirectional=True),
                           "attn": MultiheadAttention(512, 6, head_size=64)})
    check_declared_splits(table, 2)
    with pytest.raises(UsageError, match="dim 1 of bias.weight: 6;"):
        check_declared_splits(table, 4)
