"""GPT-2 style decoder-only language model, built from libai_lite's parallel-aware layers.

Read top to bottom: embeddings -> transformer layers -> final layer norm -> tied LM head,
then the pretraining wrapper that adds the loss. Every piece is a direct attribute so a
pipeline splitter can delete what a stage does not own (torchtitan style) and the
forward still runs on what is left.
"""
from typing import Any, Mapping, Optional

import torch
from torch import nn

from libai_lite.layers import (
    Embedding,
    LayerNorm,
    Linear1D,
    ParallelCrossEntropyLoss,
    TransformerLayer,
    VocabEmbedding,
    init_method_normal,
    scaled_init_method_normal,
)

# LiBai GPT config keys that name kernel fusions or fp16 tricks with no numerical effect
# here; accepted so LiBai configs load unchanged.
_IGNORED_CFG_KEYS = frozenset(
    {
        "bias_gelu_fusion",
        "bias_dropout_fusion",
        "scale_mask_softmax_fusion",
        "apply_query_key_layer_scaling",
        "amp_enabled",
    }
)


class GPTEmbedding(nn.Module):
    """Token embedding (vocab-parallel) + learned position embedding (replicated) + dropout."""

    def __init__(self, vocab_size, hidden_size, max_seq_length, embedding_dropout_prob, init_method, pad_token_id=None):
        super().__init__()
        self.token_embeddings = VocabEmbedding(vocab_size, hidden_size, padding_idx=pad_token_id, init_method=init_method)
        self.position_embeddings = Embedding(max_seq_length, hidden_size, init_method=init_method)
        self.dropout = nn.Dropout(embedding_dropout_prob)
        self.layer_idx = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_length = input_ids.shape[1]
        if seq_length > self.position_embeddings.num_embeddings:
            raise ValueError(
                f"sequence length {seq_length} exceeds max_seq_length {self.position_embeddings.num_embeddings}"
            )
        position_ids = torch.arange(seq_length, device=input_ids.device)
        return self.dropout(self.token_embeddings(input_ids) + self.position_embeddings(position_ids))


class GPTModel(nn.Module):
    """GPT-2: pre-LN causal transformer whose LM head shares the token-embedding weight.

    ``forward(input_ids)`` returns logits ``[batch, seq, vocab]``. On a pipeline stage
    that lacks pieces: with ``embeddings`` set to None the input is taken to be hidden
    states; with ``final_layernorm`` and/or ``lm_head`` None the corresponding step is
    skipped and hidden states come out.

    ``bias_gelu_fusion`` and the other LiBai fusion flags are accepted and ignored.
    ``activation`` is ``"gelu_tanh"`` for GPT-2 (``gelu_new``) or ``"gelu"``/``"relu"``.
    """

    def __init__(
        self,
        hidden_layers: int,
        vocab_size: int,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        max_seq_length: int = 1024,
        embedding_dropout_prob: float = 0.1,
        attention_dropout_prob: float = 0.1,
        output_dropout_prob: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_scaled_init_for_output_weights: bool = True,
        apply_residual_post_layernorm: bool = False,
        activation: str = "gelu_tanh",
        pad_token_id: Optional[int] = None,
        **ignored_fusion_flags,
    ):
        super().__init__()
        unknown = set(ignored_fusion_flags) - _IGNORED_CFG_KEYS
        if unknown:
            raise TypeError(f"GPTModel got unknown arguments {sorted(unknown)}")
        self.hidden_layers = hidden_layers
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.max_seq_length = max_seq_length

        init_method = init_method_normal(initializer_range)
        output_layer_init_method = (
            scaled_init_method_normal(initializer_range, hidden_layers)
            if use_scaled_init_for_output_weights
            else init_method
        )

        self.embeddings = GPTEmbedding(
            vocab_size, hidden_size, max_seq_length, embedding_dropout_prob, init_method, pad_token_id
        )
        # A dict keyed by the global index keeps layer names stable when a pipeline
        # stage drops the layers it does not own, so checkpoints line up across layouts.
        self.layers = nn.ModuleDict(
            {
                str(i): TransformerLayer(
                    hidden_size,
                    ffn_hidden_size,
                    num_attention_heads,
                    attention_dropout_prob=attention_dropout_prob,
                    output_dropout_prob=output_dropout_prob,
                    layernorm_epsilon=layernorm_epsilon,
                    init_method=init_method,
                    output_layer_init_method=output_layer_init_method,
                    activation=activation,
                    attn_mask_type="causal",
                    apply_residual_post_layernorm=apply_residual_post_layernorm,
                    layer_idx=i,
                )
                for i in range(hidden_layers)
            }
        )
        self.final_layernorm = LayerNorm(hidden_size, eps=layernorm_epsilon, layer_idx=hidden_layers - 1)
        # logits = h @ wte.T: a column-parallel (vocab-split) Linear1D sharing the very
        # Parameter of the vocab-parallel token embedding. Both are split(0), so one
        # placement serves both, and the head keeps the weight when a pipeline stage
        # drops the embeddings. Its own weight is built on meta (it is replaced at
        # once), and it gets the embedding's init so reset_parameters() in any module
        # order draws the shared weight from the same distribution.
        self.lm_head = Linear1D(
            hidden_size,
            vocab_size,
            bias=False,
            parallel="col",
            init_method=init_method,
            layer_idx=hidden_layers - 1,
            device="meta",
        )
        self.tie_weights()

    def tie_weights(self) -> None:
        """Point the LM head at the token-embedding Parameter.

        Anything that swaps parameters module by module unties them: ``to_empty()``
        after a meta-device build, ``parallelize_module`` (it distributes each use
        separately). Call this afterwards; it is a no-op on a pipeline stage that lacks
        either piece, and a tensor-parallel model stays correct because both are split(0).
        """
        if self.embeddings is not None and self.lm_head is not None:
            self.lm_head.weight = self.embeddings.token_embeddings.weight

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "GPTModel":
        """Build from a LiBai-style model cfg (dict or OmegaConf DictConfig of constructor arguments)."""
        return cls(**dict(cfg))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` ``[batch, seq]`` (or hidden states on a stage without embeddings) -> logits or hidden states."""
        hidden_states = self.embeddings(input_ids) if self.embeddings is not None else input_ids
        for layer in self.layers.values():
            hidden_states = layer(hidden_states)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        if self.lm_head is not None:
            return self.lm_head(hidden_states)
        return hidden_states

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Count parameters present on this module (the tied embedding/head once).

        ``non_embedding=True`` drops the position embeddings only, as nanoGPT does: the
        token embedding stays counted because it is also the LM head's weight, whose
        matmul costs compute on every token. Call it on the whole model, before any
        pipeline split; on a DTensor-sharded model it still counts global sizes.
        """
        total = sum(p.numel() for p in self.parameters())
        if non_embedding and self.embeddings is not None:
            total -= self.embeddings.position_embeddings.weight.numel()
        return total

    def flops_per_token(self, seq_length: int) -> int:
        """Training FLOPs per token, forward plus backward: ``6 N + 12 L H T``.

        ``N`` is ``num_parameters(non_embedding=True)`` (every weight matmul costs 2
        FLOPs per parameter forward and 4 backward); ``12 L H T`` adds attention's
        score and context matmuls (PaLM appendix B, as in nanoGPT's MFU estimate).
        """
        n = self.num_parameters(non_embedding=True)
        return 6 * n + 12 * len(self.layers) * self.hidden_size * seq_length


class GPTLoss(nn.Module):
    """Token-averaged LM loss plus the sums needed for token-weighted perplexity across ranks.

    Labels equal to ``ignore_index`` (-100) do not count; ``loss_mask`` (1 keep / 0 drop,
    or fractional weights) multiplies each token's loss. Returns ``lm_loss`` (to
    back-propagate), ``num_tokens`` (LongTensor count of tokens with non-zero weight)
    and ``nll_sum`` (detached weighted sum of token NLLs): perplexity over many batches
    or ranks is ``exp(sum(nll_sum) / sum(num_tokens))`` for 0/1 masks.
    """

    def __init__(self, ignore_index: int = -100):
        super().__init__()
        self.ignore_index = ignore_index
        self.cross_entropy = ParallelCrossEntropyLoss()

    def forward(self, logits: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor] = None) -> dict:
        per_token = self.cross_entropy(logits, labels, ignore_index=self.ignore_index)
        weights = (labels != self.ignore_index).to(per_token.dtype)
        if loss_mask is not None:
            weights = weights * loss_mask.to(per_token.dtype)
        nll_sum = (per_token * weights).sum()
        # A batch with nothing to predict yields 0, not NaN (0 / tiny == 0).
        lm_loss = nll_sum / weights.sum().clamp(min=torch.finfo(weights.dtype).tiny)
        return {"lm_loss": lm_loss, "num_tokens": (weights != 0).sum(), "nll_sum": nll_sum.detach()}


class GPTForPreTraining(nn.Module):
    """GPT language model with its pretraining loss; LiBai configs build it as ``LazyCall(GPTForPreTraining)(cfg=cfg)``.

    ``forward(input_ids, labels=None, loss_mask=None)``: with labels returns
    ``{"lm_loss", "num_tokens", "nll_sum"}`` (see ``GPTLoss``); without, ``{"logits"}``.
    Labels are already shifted (``labels[:, t]`` is the token after ``input_ids[:, t]``),
    as the GPT dataset produces them.
    """

    def __init__(self, cfg: Mapping[str, Any]):
        super().__init__()
        self.GPT_model = GPTModel.from_config(cfg)
        self.loss_func = GPTLoss()

    def forward(
        self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, loss_mask: Optional[torch.Tensor] = None
    ) -> dict:
        logits = self.GPT_model(input_ids)
        if labels is None:
            return {"logits": logits}
        return self.loss_func(logits, labels, loss_mask)

    def pipeline_module(self) -> nn.Module:
        """The module ``libai_lite.parallel.pipeline`` cuts into stages."""
        return self.GPT_model

    def pipeline_loss_fn(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token loss (labels of -100 ignored) of the last pipeline stage's logits: the schedule's loss_fn."""
        return self.loss_func(output, labels)["lm_loss"]

    def num_parameters(self, non_embedding: bool = False) -> int:
        """See ``GPTModel.num_parameters``."""
        return self.GPT_model.num_parameters(non_embedding)

    def flops_per_token(self, seq_length: int) -> int:
        """See ``GPTModel.flops_per_token``."""
        return self.GPT_model.flops_per_token(seq_length)
