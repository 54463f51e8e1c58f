"""What decoder-only and encoder-decoder language models share: the fused-loss switch and the pretraining
wrapper's half of the model protocol.

``LMForPreTraining`` holds the network under a project-chosen attribute, which prefixes its checkpoint
keys, and delegates to it; ``decoder`` and ``seq2seq`` add the forward, loss and batch of their kind.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch
from torch import nn

from ..config.validate import COUNT, FRACTION, NON_NEGATIVE, POSITIVE, Range
from ..layers import fusable_head_weight
from ..layers.moe import MOE_METRICS, collect_moe_outputs, moe_layers
from ..model import LOSS, Metric


class LanguageModel(nn.Module):
    """Base of a language model's network (what a pipeline cuts): the switch of the fused LM head and loss."""

    def fuses_cross_entropy(self) -> bool:
        """Whether the training loss may skip the logits (``linear_cross_entropy``): configured so, on a
        stage with the head, and the head plain or split on the vocabulary over the tensor-parallel ranks."""
        return self.fused_cross_entropy and self.lm_head is not None and fusable_head_weight(self.lm_head.weight)

    def embedding_parameters(self) -> list:
        """The input word embedding's and the LM head's weights on this stage, a tied one once: what
        ``optim.params.decoupled_lr`` trains. A subclass gives ``word_embedding()``, the token lookup module."""
        weights = [m.weight for m in (self.word_embedding(), self.lm_head) if m is not None]
        return list({id(w): w for w in weights}.values())


class LMForPreTraining(nn.Module):
    """A ``LanguageModel`` with its pretraining loss: the protocol methods that only delegate to it.

    ``loss_metrics`` are the loss's outputs the trainer reads (MoE layers add theirs); a subclass gives
    ``last_stage_outputs(output, labels)``, the loss dict of a pipeline's last-stage output.
    """

    loss_metrics: Mapping[str, Metric] = {"lm_loss": LOSS}
    # model.cfg's ranges (``*`` matches any run of characters), checked with the run's settings before anything
    # is built (run_sections.check_settings); a project adds the keys of its own.
    config_ranges: Mapping[str, Range] = {
        "hidden_size": COUNT, "hidden_layers": COUNT, "num_attention_heads": COUNT, "max_seq_length": COUNT,
        "layernorm_epsilon": POSITIVE, "initializer_range": NON_NEGATIVE, "*dropout*": FRACTION,
    }

    def __init__(self, model: LanguageModel, name: str, loss_func: nn.Module):
        super().__init__()
        self.inner_name = name
        setattr(self, name, model)
        self.loss_func = loss_func

    @property
    def inner(self) -> LanguageModel:
        """The network (looked up by name: a wrapper may replace the attribute, as compilation does)."""
        return getattr(self, self.inner_name)

    def with_moe_outputs(self, outputs: dict) -> dict:
        """``outputs`` plus the MoE layers' auxiliary loss and statistics (``collect_moe_outputs``)."""
        outputs.update(collect_moe_outputs(self.inner))
        return outputs

    def output_metrics(self) -> dict:
        """The loss's outputs (``loss_metrics``); MoE layers add their auxiliary loss and statistics."""
        return {**self.loss_metrics, **(MOE_METRICS if moe_layers(self.inner) else {})}

    @property
    def pipeline_num_layers(self) -> int:
        """Layers the pipeline places (see the network's ``pipeline_num_layers``)."""
        return self.inner.pipeline_num_layers

    def pipeline_module(self) -> nn.Module:
        """The module ``libai_lite.parallel.pipeline_split`` cuts into stages by its pieces' ``layer_idx``."""
        return self.inner

    def pipeline_loss_fn(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token loss (labels of -100 ignored) of the last stage's output: the schedule's loss_fn."""
        return self.last_stage_outputs(output, labels)["lm_loss"]

    def embedding_parameters(self) -> list:
        """See the network's ``embedding_parameters``."""
        return self.inner.embedding_parameters()

    def num_parameters(self, non_embedding: bool = False) -> int:
        """See the network's ``num_parameters``."""
        return self.inner.num_parameters(non_embedding)

    def flops_per_token(self, seq_length: int, *args, **kwargs) -> float:
        """See the network's ``flops_per_token``."""
        return self.inner.flops_per_token(seq_length, *args, **kwargs)

    def generate(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, **options):
        """See the network's ``generate`` (``max_new_tokens``, ``do_sample``, ...)."""
        return self.inner.generate(input_ids, attention_mask, **options)
