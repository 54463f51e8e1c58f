"""GPT and Llama take the decoder-only protocol from the core (libai_lite.lm.decoder) and keep their checkpoint keys."""
import pytest
import torch

from libai_lite.lm.decoder import CausalLMLoss, DecoderLM, DecoderLMForPreTraining
from projects.GPT.modeling import GPTForPreTraining
from projects.Llama.modeling import LlamaForPreTraining

TINY = dict(hidden_layers=2, vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, max_seq_length=16)
# The protocol a project must not write again: the base's methods and properties.
PROTOCOL = ("forward", "output_metrics", "tokens_per_sample", "flops_per_sample", "max_seq_length",
            "pipeline_num_layers", "pipeline_module", "pipeline_batch", "pipeline_loss_fn", "num_parameters",
            "flops_per_token", "generate")


@pytest.mark.parametrize("cls, prefix", [(GPTForPreTraining, "GPT_model"), (LlamaForPreTraining, "llama")])
def test_the_wrapper_is_the_cores_and_keeps_its_checkpoint_prefix(cls, prefix):
    assert issubclass(cls, DecoderLMForPreTraining)
    assert not set(PROTOCOL) & set(vars(cls)), "the project repeats protocol code the core holds"
    model = cls(TINY)
    assert isinstance(model.decoder, DecoderLM) and model.decoder is getattr(model, prefix)
    assert {k.split(".")[0] for k in model.state_dict()} == {prefix}
    assert isinstance(model.loss_func, CausalLMLoss)
    for name in ("generate", "fuses_cross_entropy", "norm_and_head"):
        assert name not in vars(type(model.decoder)), name
    # FLOPs stay the project's: both count the same MoE-aware quantity under one name.
    assert model.decoder.active_parameters == model.num_parameters(non_embedding=True)
    assert model.flops_per_sample({"input_ids": [0] * 8}) == 8 * model.flops_per_token(8)


def test_a_wrapper_whose_decoder_attribute_is_replaced_reaches_the_new_one():
    model = GPTForPreTraining(TINY)
    other = GPTForPreTraining(TINY).GPT_model
    model.GPT_model = other
    assert model.pipeline_module() is other
    ids = torch.randint(0, 64, (1, 4))
    assert model.generate(ids, max_new_tokens=2).shape == (1, 6)
