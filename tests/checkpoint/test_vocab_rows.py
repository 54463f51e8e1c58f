"""A checkpoint whose vocabulary is padded otherwise loads with padding rows cut or added (in one process,
through DCP, optimizer state included); a shape refusal names the model.cfg key that differs."""
import pytest
import torch
from torch import nn

from libai_lite.checkpoint import Checkpointer
from libai_lite.checkpoint.vocab_rows import shape_refusal, vocab_padding_differs
from libai_lite.utils.errors import UsageError

IDS, HIDDEN = 10, 4


class TiedLM(nn.Module):
    """An embedding and the LM head tied to it: the two tensors a vocabulary pads."""

    def __init__(self, rows):
        super().__init__()
        self.emb = nn.Embedding(rows, HIDDEN)
        self.head = nn.Linear(HIDDEN, rows, bias=False)
        self.head.weight = self.emb.weight
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


def _trained(rows, tmp_path):
    torch.manual_seed(0)
    model = TiedLM(rows)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(IDS)
    nn.functional.cross_entropy(model(ids), ids).backward()
    opt.step()
    Checkpointer(model, opt, str(tmp_path)).save("model_0000000", {"iteration": 0})
    return model, opt, str(tmp_path / "model_0000000")


@pytest.mark.parametrize("stored, built", [(16, 12), (12, 16)])
def test_padding_rows_cut_or_added_at_load(tmp_path, stored, built, caplog):
    src, src_opt, path = _trained(stored, tmp_path)
    model = TiedLM(built)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    Checkpointer(model, opt, vocab_ids=IDS, model_config={"vocab_size": built, "hidden_size": HIDDEN}).load(path)
    keep = min(stored, built)
    w, w_src = model.emb.weight.detach(), src.emb.weight.detach()
    torch.testing.assert_close(w[:keep], w_src[:keep], rtol=0, atol=0)
    assert model.head.weight is model.emb.weight
    if built > stored:  # an added row is the mean of the real ids' rows; its Adam moments are zero
        torch.testing.assert_close(w[stored:], w_src[:IDS].mean(0).expand(built - stored, HIDDEN))
    state = opt.state[model.emb.weight]
    src_state = src_opt.state[src.emb.weight]
    torch.testing.assert_close(state["exp_avg"][:keep], src_state["exp_avg"][:keep], rtol=0, atol=0)
    assert state["exp_avg"].shape[0] == built and not state["exp_avg"][stored:].any()
    torch.testing.assert_close(model.norm.weight, src.norm.weight, rtol=0, atol=0)
    assert f"has {stored} vocabulary rows where this config builds {built}" in caplog.text


def test_real_ids_are_never_cut_and_other_shapes_name_the_key(tmp_path):
    _, _, path = _trained(12, tmp_path)
    # The checkpoint's 12 rows cannot hold a tokenizer of 14 ids: another tokenizer, not padding.
    with pytest.raises(UsageError, match="fewer than the tokenizer's 14 ids; set tokenization.tokenizer"):
        Checkpointer(TiedLM(16), vocab_ids=14, model_config={"vocab_size": 16}).load(path, weights_only=True)
    # Without the tokenizer's size nothing is taken for padding.
    with pytest.raises(UsageError, match="another model shape"):
        Checkpointer(TiedLM(16)).load(path, weights_only=True)


def test_shape_refusal_names_the_model_cfg_key():
    msg = shape_refusal("emb.weight", (8064, 64), (8064, 32), 8000,
                        {"vocab_size": 8064, "hidden_size": 32, "ffn_hidden_size": 128})
    assert "model.cfg.hidden_size=32 gives 32 where it has 64" in msg
    assert "another model shape; make model.cfg match it" in shape_refusal("x", (3,), (5,), None, {"hidden_size": 4})
    assert vocab_padding_differs((8192, 64), (8064, 64), 8000, 8064)
    assert not vocab_padding_differs((8192, 32), (8064, 64), 8000, 8064)
    assert not vocab_padding_differs((7000, 64), (8064, 64), 8000, 8064)
