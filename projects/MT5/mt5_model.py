"""T5 (v1.0) and mT5 / T5 v1.1 encoder-decoder models on libai_lite's parallel layers.

Read top to bottom: config -> shared token embedding -> encoder layers -> encoder final norm
-> decoder layers (self-attention, cross-attention, feed-forward) -> decoder final norm ->
LM head, then the pretraining wrapper that adds the loss. The choices that make it T5:

* Pre-LN blocks with RMS layer norm (scale only: no bias, no mean subtraction), no biases
  anywhere, no ``1/sqrt(d_kv)`` score scaling (T5 folds it into q's initialisation), and a
  per-head attention width ``head_size`` (``d_kv``) decoupled from ``hidden_size / heads``
  (mT5-small: 6 heads of 64 on a 512-wide model).
* No absolute positions: a learned bias per (bucketed relative distance, head) is added to
  the self-attention scores. 32 buckets, exact up to 8 (per direction) then logarithmic up to
  a distance of 128; bidirectional in the encoder, causal in the decoder. Each stack's first
  layer owns the ``[num_buckets, heads]`` table (as in Hugging Face), computes the bias once
  and hands it to the layers after it. Cross-attention has no position bias.
* ``model_type="t5"`` (T5 v1.0): ReLU feed-forward; the LM head is the token embedding
  (encoder input, decoder input and output share one matrix) and the decoder output is
  scaled by ``hidden_size ** -0.5`` before it. ``model_type="mt5"`` (mT5, T5 v1.1):
  gated-GELU feed-forward (``gelu_new``, the tanh approximation) and an untied,
  column-parallel LM head with no scaling, so tensor parallelism splits its 250k-entry
  vocabulary. ``tie_word_embeddings`` overrides the tie (and with it the scaling), as in
  Hugging Face.
* Dropout: ``embedding_dropout_prob`` after the embedding, ``attention_probs_dropout_prob``
  on attention probabilities, ``hidden_dropout_prob`` on every residual branch's output and
  after each stack's final norm. (Hugging Face also drops inside the feed-forward, between
  the activation and ``wo``; LiBai does not, nor do we.)

Pipeline parallelism. The layers of both stacks form one sequence of ``2 * hidden_layers``
global indices (encoder ``0..L-1``, decoder ``L..2L-1``: ``pipeline_num_layers``), so a stage is a
contiguous range of them. The generic splitter (``libai_lite.parallel.pipeline_split``) keeps on a
stage the pieces whose ``layer_idx`` it owns (``embedding`` 0, ``encoder_final_layernorm`` L-1,
``decoder_final_layernorm`` and ``lm_head`` 2L-1) and sets the others to None;
``encoder_layers`` / ``decoder_layers`` are keyed by global index, so checkpoint names do not
depend on the layout. A stage runs ``pipeline_forward``. The first stage (it owns
``embedding``, layer 0) embeds both the encoder and the decoder ids; encoder stages advance the
encoder states and pass the embedded decoder input through; the stage owning layer ``L-1``
applies ``encoder_final_layernorm`` and from then on the encoder states are the encoder output
every decoder stage reads for cross-attention; decoder stages advance the decoder states; the
last stage returns logits. A position bias is computed by its stack's first layer and must reach
later layers of that stack, so it travels with the stage outputs (with its gradient, back to the
table). The padding masks are keyword inputs the schedule gives every stage. With T5's tied head
the last stage shares the embedding matrix with the first, as GPT's does.
"""
from __future__ import annotations

import difflib
import functools
from dataclasses import MISSING, dataclass, fields
from typing import Any, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from libai_lite.layers import (
    Linear1D,
    MoEConfig,
    RMSLayerNorm,
    VocabEmbedding,
    collect_moe_outputs,
    fusable_head_weight,
    init_method_normal,
    linear_cross_entropy,
)
from libai_lite.layers.attention import KVCache
from libai_lite.layers.flex_attention import AttentionMask, flex_enabled
from libai_lite.layers.moe import MOE_METRICS, moe_layers
from libai_lite.model import LOSS, MEAN
from libai_lite.utils.errors import UsageError

from .layers import FEED_FORWARD, MT5Loss, MT5TransformerLayer, RelativePositionBias

# LiBai MT5/T5 cfg keys with no effect here, accepted so LiBai configs load unchanged: kernel
# fusion and fp16 flags, generation ids, and padding_idx (T5's decoder start token is the pad
# id, so its embedding must stay trainable: it is not made a frozen nn.Embedding padding row).
_IGNORED_CFG_KEYS = frozenset(
    {
        "amp_enabled",
        "padding_idx",
        "eos_token_id",
        "decoder_start_token_id",
        "is_encoder_decoder",
        "bias_gelu_fusion",
        "bias_dropout_fusion",
        "scale_mask_softmax_fusion",
        "apply_query_key_layer_scaling",
    }
)


@dataclass
class MT5Config:
    """Model settings under LiBai's MT5 cfg names (Hugging Face's name in brackets).

    Args:
        vocab_size: token ids (``vocab_size``); the trainer replaces it with the tokenizer's padded size.
        hidden_size: model width (``d_model``).
        hidden_layers: layers in EACH of the encoder and decoder (``num_layers``).
        num_attention_heads: heads per attention (``num_heads``).
        intermediate_size: feed-forward width (``d_ff``).
        head_size: per-head width (``d_kv``); None means ``hidden_size // num_attention_heads``.
        embedding_dropout_prob, hidden_dropout_prob, attention_probs_dropout_prob: see the
            module docstring (Hugging Face uses ``dropout_rate`` for all three).
        relative_attention_num_buckets, relative_attention_max_distance: the relative bias buckets.
        initializer_range: multiplies every weight's T5 init std (``initializer_factor``; 1.0 as
            in T5, not a std like GPT's 0.02).
        layernorm_eps: RMS norm epsilon (``layer_norm_epsilon``).
        model_type: ``"mt5"`` (gated-GELU, untied head) or ``"t5"`` (ReLU, tied and scaled head).
        tie_word_embeddings: None follows ``model_type``; True/False ties (and scales) or not.
        moe: mixture-of-experts feed-forward layers (``libai_lite.layers.MoEConfig`` keys; off
            when None or ``enabled=False``); ``every_n_layers`` counts within each stack.
        fused_cross_entropy: the training loss computes the LM head and the cross entropy in one
            step (``libai_lite.layers.linear_cross_entropy``), without the logits.
    """

    vocab_size: int
    hidden_size: int
    hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    head_size: Optional[int] = None
    embedding_dropout_prob: float = 0.1
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    initializer_range: float = 1.0
    layernorm_eps: float = 1e-6
    model_type: str = "mt5"
    tie_word_embeddings: Optional[bool] = None
    moe: Optional[Any] = None
    fused_cross_entropy: bool = True

    def __post_init__(self):
        if self.model_type not in FEED_FORWARD:
            raise UsageError(f"model.cfg.model_type={self.model_type!r} is not supported; use 'mt5' or 't5'")
        for name in ("vocab_size", "hidden_size", "hidden_layers", "num_attention_heads", "intermediate_size"):
            if int(getattr(self, name)) < 1:
                raise UsageError(f"model.cfg.{name}={getattr(self, name)} must be a positive integer")
        if self.head_size is None:
            if self.hidden_size % self.num_attention_heads:
                raise UsageError(
                    f"model.cfg.hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set model.cfg.head_size (mT5 uses 64)"
                )
            self.head_size = self.hidden_size // self.num_attention_heads
        if self.tie_word_embeddings is None:
            self.tie_word_embeddings = self.model_type == "t5"

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> "MT5Config":
        """Build from a dict or OmegaConf DictConfig; LiBai-only keys are ignored, unknown keys refused."""
        known = {f.name for f in fields(cls)}
        given = dict(cfg)
        unknown = sorted(set(given) - known - _IGNORED_CFG_KEYS)
        if unknown:
            hints = [
                f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, known, n=1)) else repr(k)
                for k in unknown
            ]
            raise UsageError(
                f"unknown model.cfg keys for MT5: {', '.join(hints)}; valid keys: {', '.join(sorted(known))}"
            )
        missing = [f.name for f in fields(cls) if f.name not in given and f.default is MISSING]
        if missing:
            raise UsageError(f"model.cfg for MT5 is missing {', '.join(missing)}")
        return cls(**{k: v for k, v in given.items() if k in known})


def _attention_mask(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Padding mask in a shape ``MultiheadAttention`` broadcasts: ``[b, k]`` or ``[b, q, k]`` (LiBai's) or 4-D."""
    if mask is None or mask.dim() in (2, 4):
        return mask
    if mask.dim() == 3:
        return mask[:, None]
    raise ValueError(f"attention masks are [batch, key], [batch, query, key] or 4-D; got shape {tuple(mask.shape)}")


def _shared_mask(mask: Optional[torch.Tensor], q_len: int, k_len: int, causal: bool, device,
                 flex: bool) -> AttentionMask:
    """One ``AttentionMask`` for every layer of a stack (padding as ``_attention_mask`` takes it), its
    FlexAttention block mask or dense form built here, once per batch, outside any compiled layer."""
    mask = _attention_mask(mask)
    padding, keep = (mask, None) if mask is not None and mask.dim() == 2 else (None, mask)
    return AttentionMask(q_len, k_len, causal=causal, key_padding=padding, keep=keep, device=device).prepare(flex)


class MT5Model(nn.Module):
    """The T5/mT5 encoder-decoder; ``forward`` returns logits ``[batch, dec_seq, vocab]``.

    Built as ``MT5Model(cfg)`` from a mapping of ``MT5Config`` keys (LiBai's
    ``LazyCall(MT5Model)(cfg=cfg)``) or an ``MT5Config``. Attributes a pipeline splitter
    acts on: ``embedding``, ``encoder_layers`` (keys ``"0".."L-1"``),
    ``encoder_final_layernorm``, ``decoder_layers`` (keys ``"L".."2L-1"``),
    ``decoder_final_layernorm``, ``lm_head``; see the module docstring for what a stage carries.
    """

    def __init__(self, cfg: Union[Mapping[str, Any], MT5Config]):
        super().__init__()
        cfg = cfg if isinstance(cfg, MT5Config) else MT5Config.from_mapping(cfg)
        self.cfg = cfg
        num_layers = cfg.hidden_layers
        self.hidden_size = cfg.hidden_size
        self.tie_word_embeddings = bool(cfg.tie_word_embeddings)
        embedding_init = init_method_normal(cfg.initializer_range * 1.0)

        self.embedding = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, init_method=embedding_init, layer_idx=0)
        self.embedding_dropout = nn.Dropout(cfg.embedding_dropout_prob)
        self.hidden_dropout = nn.Dropout(cfg.hidden_dropout_prob)
        # MoE layers are counted within each stack: every_n_layers=2 makes layers 1, 3, ... of both.
        moe = MoEConfig.from_mapping(cfg.moe)
        layer = functools.partial(
            MT5TransformerLayer,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_attention_heads,
            cfg.head_size,
            relative_attention_num_buckets=cfg.relative_attention_num_buckets,
            relative_attention_max_distance=cfg.relative_attention_max_distance,
            attention_dropout_prob=cfg.attention_probs_dropout_prob,
            output_dropout_prob=cfg.hidden_dropout_prob,
            layernorm_epsilon=cfg.layernorm_eps,
            model_type=cfg.model_type,
            initializer_range=cfg.initializer_range,
        )
        self.encoder_layers = nn.ModuleDict(
            {
                str(i): layer(is_decoder=False, has_relative_attention_bias=i == 0, layer_idx=i,
                              moe=moe if moe.is_moe_layer(i) else None)
                for i in range(num_layers)
            }
        )
        self.encoder_final_layernorm = RMSLayerNorm(cfg.hidden_size, eps=cfg.layernorm_eps, layer_idx=num_layers - 1)
        self.decoder_layers = nn.ModuleDict(
            {
                str(i): layer(is_decoder=True, has_relative_attention_bias=i == num_layers, layer_idx=i,
                              moe=moe if moe.is_moe_layer(i - num_layers) else None)
                for i in range(num_layers, 2 * num_layers)
            }
        )
        last = 2 * num_layers - 1
        self.decoder_final_layernorm = RMSLayerNorm(cfg.hidden_size, eps=cfg.layernorm_eps, layer_idx=last)
        if self.tie_word_embeddings:
            # Built on meta and replaced by the embedding's Parameter at once (see GPTModel); it
            # gets the embedding's init so reset_parameters() in any module order agrees.
            self.lm_head = Linear1D(
                cfg.hidden_size, cfg.vocab_size, bias=False, parallel="vocab",
                init_method=embedding_init, layer_idx=last, device="meta",
            )
            self.tie_weights()
        else:
            # Hugging Face draws the untied head with std 1.0, which (with no output scaling)
            # starts mT5 at logits of std sqrt(d_model) and a loss in the tens; d_model^-1/2
            # starts it near log(vocab) like the tied, scaled T5 head.
            self.lm_head = Linear1D(
                cfg.hidden_size, cfg.vocab_size, bias=False, parallel="vocab",
                init_method=init_method_normal(cfg.initializer_range * cfg.hidden_size**-0.5), layer_idx=last,
            )

    @property
    def pipeline_num_layers(self) -> int:
        """Layers the pipeline splitter places: encoder and decoder together, ``2 * hidden_layers``."""
        return 2 * self.cfg.hidden_layers

    @property
    def pipeline_tied(self) -> Optional[Tuple[str, str]]:
        """The weight the first and last pipeline stage share (T5's tied head), or None (mT5)."""
        return ("embedding.weight", "lm_head.weight") if self.tie_word_embeddings else None

    def pipeline_forward(
        self,
        *carried: torch.Tensor,
        encoder_attn_mask: Optional[torch.Tensor] = None,
        decoder_attn_mask: Optional[torch.Tensor] = None,
        encoder_decoder_attn_mask: Optional[torch.Tensor] = None,
        skip_lm_head: bool = False,
        lm_labels: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, ...]]:
        """One pipeline stage: what ``PipelineStage`` runs (through ``PipelineForward``).

        The first stage takes ``(encoder_input_ids, decoder_input_ids)``; every other stage
        takes what the previous one returned: ``(encoder_hidden, decoder_hidden)`` plus the
        position bias of the stack in progress, when a layer after this stack's first one
        still needs it (``PipelineStage`` sends tensors only, so an absent bias is an absent
        element, never None). Which stack a carried bias belongs to follows from the stage's
        own layers: a stage holding encoder layers is mid-encoder. Masks come as keyword
        arguments, which the schedule gives every stage. The last stage returns logits; with
        ``skip_lm_head`` the hidden states the head would multiply (normed, and scaled when tied);
        with ``lm_labels`` and a head that can fuse, ``[batch, dec_seq, 2]``: each token's loss and
        whether its label was the top-1 prediction (1.0 or 0.0; ``pipeline_metrics`` turns it into
        the token accuracy).
        """
        if self.embedding is not None:
            encoder_input_ids, decoder_input_ids = carried
            encoder_hidden = self.embedding_dropout(self.embedding(encoder_input_ids))
            decoder_hidden = self.embedding_dropout(self.embedding(decoder_input_ids))
            bias = None
        else:
            encoder_hidden, decoder_hidden, *rest = carried
            bias = rest[0] if rest else None
        mid_encoder = len(self.encoder_layers) > 0 or self.encoder_final_layernorm is not None
        encoder_bias, decoder_bias = (bias, None) if mid_encoder else (None, bias)

        if encoder_decoder_attn_mask is None and encoder_attn_mask is not None and encoder_attn_mask.dim() == 2:
            encoder_decoder_attn_mask = encoder_attn_mask
        # Each mask is built once here for all layers of this stage (FlexAttention's block mask on a GPU).
        enc_len, dec_len, device = encoder_hidden.shape[1], decoder_hidden.shape[1], decoder_hidden.device
        flex = flex_enabled(device, self.cfg.attention_probs_dropout_prob if self.training else 0.0)
        if len(self.encoder_layers):
            encoder_attn_mask = _shared_mask(encoder_attn_mask, enc_len, enc_len, False, device, flex)
        if len(self.decoder_layers):
            decoder_attn_mask = _shared_mask(decoder_attn_mask, dec_len, dec_len, True, device, flex)
            encoder_decoder_attn_mask = _shared_mask(encoder_decoder_attn_mask, dec_len, enc_len, False, device, flex)
        for layer in self.encoder_layers.values():
            encoder_hidden, encoder_bias = layer(encoder_hidden, encoder_attn_mask, position_bias=encoder_bias)
        if self.encoder_final_layernorm is not None:
            encoder_hidden = self.hidden_dropout(self.encoder_final_layernorm(encoder_hidden))
            encoder_bias = None
        for layer in self.decoder_layers.values():
            decoder_hidden, decoder_bias = layer(
                decoder_hidden, decoder_attn_mask, position_bias=decoder_bias,
                encoder_states=encoder_hidden, encoder_attention_mask=encoder_decoder_attn_mask,
            )
        if self.lm_head is not None:
            decoder_hidden = self.hidden_dropout(self.decoder_final_layernorm(decoder_hidden))
            if self.tie_word_embeddings:
                decoder_hidden = decoder_hidden * self.hidden_size**-0.5
            if skip_lm_head:
                return decoder_hidden
            if lm_labels is not None and self.fuses_cross_entropy():
                per_token, correct = linear_cross_entropy(decoder_hidden, self.lm_head.weight, lm_labels,
                                                          return_top1=True)
                # A stage hands the schedule one tensor: the top-1 hits ride along, without gradient.
                return torch.stack((per_token, correct.to(per_token.dtype)), dim=-1)
            return self.lm_head(decoder_hidden)
        carried_bias = encoder_bias if encoder_bias is not None else decoder_bias
        # Point-to-point sends need contiguous tensors; the bias is a permuted view of its table lookup.
        carried = (encoder_hidden, decoder_hidden) + ((carried_bias,) if carried_bias is not None else ())
        return tuple(t.contiguous() for t in carried)

    def tie_weights(self) -> None:
        """Point a tied LM head at the embedding Parameter (after ``to_empty()`` or ``parallelize_module``).

        A no-op for an untied head or on a pipeline stage lacking either piece.
        """
        if self.tie_word_embeddings and self.embedding is not None and self.lm_head is not None:
            self.lm_head.weight = self.embedding.weight

    def forward(
        self,
        encoder_input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        encoder_attn_mask: Optional[torch.Tensor] = None,
        decoder_attn_mask: Optional[torch.Tensor] = None,
        encoder_decoder_attn_mask: Optional[torch.Tensor] = None,
        skip_lm_head: bool = False,
    ) -> torch.Tensor:
        """Encode, decode and project to the vocabulary: logits ``[batch, dec_seq, vocab]``.

        Args:
            encoder_input_ids, decoder_input_ids: ``[batch, enc_seq]`` / ``[batch, dec_seq]`` ids.
            encoder_attn_mask: encoder padding mask, 1/True = real token: ``[batch, enc_seq]``
                (or LiBai's ``[batch, enc_seq, enc_seq]``, or 4-D).
            decoder_attn_mask: decoder padding mask; causality is added here.
            encoder_decoder_attn_mask: which encoder positions the decoder may attend to
                (``[batch, enc_seq]`` or ``[batch, dec_seq, enc_seq]``); when None a 2-D
                ``encoder_attn_mask`` is used, as Hugging Face does.

        The whole model is its own single pipeline stage, so this is ``pipeline_forward``.
        """
        return self.pipeline_forward(
            encoder_input_ids, decoder_input_ids, encoder_attn_mask=encoder_attn_mask,
            decoder_attn_mask=decoder_attn_mask, encoder_decoder_attn_mask=encoder_decoder_attn_mask,
            skip_lm_head=skip_lm_head,
        )

    def fuses_cross_entropy(self) -> bool:
        """Whether the training loss may skip the logits (``linear_cross_entropy``; see ``GPTModel``)."""
        return self.cfg.fused_cross_entropy and self.lm_head is not None and fusable_head_weight(self.lm_head.weight)

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Parameters present on this module, a tied matrix once; global sizes even when sharded.

        ``non_embedding=True`` drops what costs no matmul FLOPs: the relative bias tables and
        the input embedding when it is not also the LM head (mT5). Call it on the whole model.
        """
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            for module in self.modules():
                if isinstance(module, RelativePositionBias):
                    total -= module.weight.numel()
            if self.embedding is not None and not self.tie_word_embeddings:
                total -= self.embedding.weight.numel()
        return total

    def flops_per_token(self, seq_length: int, decoder_seq_length: Optional[int] = None) -> float:
        """Training FLOPs (forward + backward = 3 x forward) per encoder token.

        The trainer multiplies this by ``batch * seq_length`` tokens, so it is the FLOPs of one
        sample divided by ``S = seq_length`` (the encoder length); ``T = decoder_seq_length``
        defaults to ``S`` (span corruption makes it shorter: pass the dataset's decoder length).
        With ``d = hidden_size``, ``a = heads * head_size``, ``f = intermediate_size``,
        ``m = 3`` matrices in a gated feed-forward (2 otherwise), ``L`` layers per stack and
        ``V = vocab_size``, one sample's forward costs (2 FLOPs per multiply-add)::

            encoder   2 L S (4 d a + m d f)                 projections and feed-forward
                      4 L S^2 a                             scores and context
            decoder   2 L T (6 d a + m d f) + 2 L S (2 d a)  self, cross (k, v read the S encoder
                                                            positions) and feed-forward
                      4 L (T^2 + T S) a                     self and cross scores and context
            LM head   2 T d V

        Norms, softmax, embedding lookups and the relative bias are not counted; the causal
        mask is not discounted (PaLM's convention). ``tests/projects/test_mt5_model.py`` checks this
        against ``torch.utils.flop_counter`` on a real forward and backward. An MoE layer's
        feed-forward counts ``top_k`` experts plus its router (``d E``) instead of one MLP;
        tokens dropped by capacity are not discounted.
        """
        c = self.cfg
        s = seq_length
        t = s if decoder_seq_length is None else decoder_seq_length
        d, f, v, n = c.hidden_size, c.intermediate_size, c.vocab_size, c.hidden_layers
        a = c.num_attention_heads * c.head_size
        m = 3 if FEED_FORWARD[c.model_type][1] else 2
        moe = MoEConfig.from_mapping(c.moe)
        n_moe = sum(moe.is_moe_layer(i) for i in range(n))
        # Multiply-adds per token of one stack's feed-forwards.
        ffn = (n - n_moe) * m * d * f + n_moe * (moe.top_k * m * d * f + d * moe.num_experts)
        encoder = 2 * s * (n * 4 * d * a + ffn) + 4 * n * s * s * a
        decoder = 2 * t * (n * 6 * d * a + ffn) + 2 * n * s * 2 * d * a + 4 * n * (t * t + t * s) * a
        head = 2 * t * d * v
        return 3.0 * (encoder + decoder + head) / s

    def encode(self, encoder_input_ids: torch.Tensor, encoder_attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The encoder output ``[batch, enc_seq, hidden]`` (the whole model only; generation runs it once)."""
        hidden, bias = self.embedding_dropout(self.embedding(encoder_input_ids)), None
        flex = flex_enabled(hidden.device, self.cfg.attention_probs_dropout_prob if self.training else 0.0)
        mask = _shared_mask(encoder_attn_mask, hidden.shape[1], hidden.shape[1], False, hidden.device, flex)
        for layer in self.encoder_layers.values():
            hidden, bias = layer(hidden, mask, position_bias=bias)
        return self.hidden_dropout(self.encoder_final_layernorm(hidden))

    def decode(
        self,
        decoder_input_ids: torch.Tensor,
        encoder_hidden: torch.Tensor,
        encoder_decoder_attn_mask: Optional[torch.Tensor] = None,
        kv_caches: Optional[Mapping[str, KVCache]] = None,
        cross_kv_caches: Optional[Mapping[str, KVCache]] = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Decoder logits over ``encode``'s output, for incremental decoding.

        With ``kv_caches`` / ``cross_kv_caches`` (a ``KVCache`` per key of ``decoder_layers``)
        ``decoder_input_ids`` are only the positions after the cached ones, and the encoder's
        keys and values are projected on the first call only. ``logits_to_keep`` > 0 returns
        the logits of that many last positions.
        """
        mask = _attention_mask(encoder_decoder_attn_mask)
        hidden, bias = self.embedding_dropout(self.embedding(decoder_input_ids)), None
        for name, layer in self.decoder_layers.items():
            hidden, bias = layer(
                hidden, None, position_bias=bias, encoder_states=encoder_hidden, encoder_attention_mask=mask,
                kv_cache=kv_caches[name] if kv_caches is not None else None,
                cross_kv_cache=cross_kv_caches[name] if cross_kv_caches is not None else None,
            )
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        hidden = self.hidden_dropout(self.decoder_final_layernorm(hidden))
        if self.tie_word_embeddings:
            hidden = hidden * self.hidden_size**-0.5
        return self.lm_head(hidden)

    @torch.no_grad()
    def generate(
        self,
        encoder_input_ids: torch.Tensor,
        encoder_attn_mask: Optional[torch.Tensor] = None,
        decoder_start_token_id: int = 0,
        max_new_tokens: int = 20,
        use_cache: bool = True,
        vocab_size: Optional[int] = None,
        **options,
    ):
        """Decode from ``decoder_start_token_id`` (T5's pad id, 0) given the encoder input; returns
        the decoder ids ``[batch, 1 + new]``, start token first, as Hugging Face does.

        ``encoder_input_ids`` of different lengths are right-padded with ``encoder_attn_mask`` 0
        on the padding. The encoder runs once; with ``use_cache`` each decoder step feeds one
        token, its self-attention keys and values are cached (the relative position bias is
        computed for the new position only) and the encoder's keys and values are projected
        once per layer. ``vocab_size`` and ``options`` (``do_sample``, ``temperature``, ...) are as in
        ``libai_lite.decoder_lm.DecoderLM.generate`` and ``libai_lite.inference.decode``.
        """
        from libai_lite.inference import decode, eval_mode, gather_logits, tensor_parallel_group

        pieces = (self.embedding, self.encoder_final_layernorm, self.decoder_final_layernorm, self.lm_head)
        if any(p is None for p in pieces):
            raise UsageError("generate needs the whole MT5 model; build it without pipeline parallelism")
        batch = encoder_input_ids.shape[0]
        start = torch.full((batch, 1), int(decoder_start_token_id), dtype=torch.long, device=encoder_input_ids.device)
        capacity = 1 + int(max_new_tokens)
        caches = {name: KVCache(capacity) for name in self.decoder_layers} if use_cache else None
        cross = {name: KVCache() for name in self.decoder_layers} if use_cache else None
        seen = {"ids": start[:, :0]}

        with eval_mode(self):
            encoder_hidden = self.encode(encoder_input_ids, encoder_attn_mask)

            def step(tokens: torch.Tensor) -> torch.Tensor:
                seen["ids"] = torch.cat([seen["ids"], tokens], dim=1)
                ids = tokens if use_cache else seen["ids"]
                logits = self.decode(ids, encoder_hidden, encoder_attn_mask, caches, cross, logits_to_keep=1)
                return gather_logits(logits)[:, -1]

            return decode(step, start, max_new_tokens=int(max_new_tokens), vocab_size=vocab_size or self.cfg.vocab_size,
                          sync_group=tensor_parallel_group(self), **options)


class MT5ForPreTraining(nn.Module):
    """MT5Model plus its loss; LiBai configs build it as ``LazyCall(MT5ForPreTraining)(cfg=cfg)``.

    ``forward`` takes the span-corruption batch as keyword arguments. With ``labels``
    (``[batch, dec_seq]``, -100 where nothing is predicted) it returns ``{"lm_loss",
    "num_tokens", "nll_sum", "token_acc"}`` (see ``MT5Loss``), plus ``moe_aux_loss``,
    ``moe_dropped_frac`` and ``moe_load_max`` with MoE layers; without, ``{"logits"}``.
    """

    def __init__(self, cfg: Union[Mapping[str, Any], MT5Config]):
        super().__init__()
        self.mt5_model = MT5Model(cfg)
        self.loss_func = MT5Loss()

    def forward(
        self,
        encoder_input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        encoder_attn_mask: Optional[torch.Tensor] = None,
        decoder_attn_mask: Optional[torch.Tensor] = None,
        encoder_decoder_attn_mask: Optional[torch.Tensor] = None,
    ) -> dict:
        model = self.mt5_model
        if labels is not None and model.fuses_cross_entropy():
            hidden = model(encoder_input_ids, decoder_input_ids, encoder_attn_mask, decoder_attn_mask,
                           encoder_decoder_attn_mask, skip_lm_head=True)
            outputs = self.loss_func.from_hidden(hidden, model.lm_head.weight, labels)
            outputs.update(collect_moe_outputs(model))
            return outputs
        logits = model(
            encoder_input_ids, decoder_input_ids, encoder_attn_mask, decoder_attn_mask, encoder_decoder_attn_mask
        )
        if labels is None:
            return {"logits": logits}
        outputs = self.loss_func(logits, labels)
        outputs.update(collect_moe_outputs(self.mt5_model))
        return outputs

    # ------------------------------------------------------------------ the model protocol (libai_lite.model)
    @staticmethod
    def special_token_ids(tokenizer) -> dict:
        """``eos``, ``pad`` and ``decoder_start`` as the span-corruption data uses them (``t5_special_ids``)."""
        from .data.t5_dataset import t5_special_ids

        ids = t5_special_ids(tokenizer)
        return {k: ids[k] for k in ("eos", "pad", "decoder_start")}

    def output_metrics(self) -> dict:
        """``lm_loss`` is back-propagated, ``token_acc`` logged; MoE layers add their loss and statistics."""
        return {"lm_loss": LOSS, "token_acc": MEAN, **(MOE_METRICS if moe_layers(self.mt5_model) else {})}

    @staticmethod
    def tokens_per_sample(sample: Mapping) -> int:
        """Tokens one span-corruption sample feeds the model: encoder plus decoder input."""
        return len(sample["encoder_input_ids"]) + len(sample["decoder_input_ids"])

    def flops_per_sample(self, sample: Mapping) -> float:
        """Training FLOPs of one sample (see ``MT5Model.flops_per_token``)."""
        enc, dec = len(sample["encoder_input_ids"]), len(sample["decoder_input_ids"])
        return float(self.mt5_model.flops_per_token(enc, decoder_seq_length=dec)) * enc

    @property
    def pipeline_num_layers(self) -> int:
        """See ``MT5Model.pipeline_num_layers``."""
        return self.mt5_model.pipeline_num_layers

    def pipeline_module(self) -> nn.Module:
        """The module ``libai_lite.parallel.pipeline`` cuts into stages."""
        return self.mt5_model

    def pipeline_batch(self, batch: dict) -> tuple[tuple, dict, torch.Tensor]:
        """A span-corruption batch as ``(first-stage inputs, masks every stage takes, labels)``."""
        masks = {k: batch[k] for k in ("encoder_attn_mask", "decoder_attn_mask", "encoder_decoder_attn_mask")
                 if batch.get(k) is not None}
        if self.mt5_model.cfg.fused_cross_entropy:
            # The last stage then returns per-token losses from the fused head.
            masks["lm_labels"] = batch["labels"]
        return (batch["encoder_input_ids"], batch["decoder_input_ids"]), masks, batch["labels"]

    # What pipeline_metrics returns, known on every pipeline rank (only the last stage computes it).
    pipeline_metric_names = ("token_acc",)

    def _pipeline_loss_dict(self, output: torch.Tensor, labels: torch.Tensor) -> dict:
        if self.mt5_model.fuses_cross_entropy():  # the fused head's per-token loss and top-1 hits
            return self.loss_func.reduce(output[..., 0], output[..., 1] > 0.5, labels)
        return self.loss_func(output, labels)

    def pipeline_loss_fn(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token loss (labels of -100 ignored) of the last stage's output: the schedule's loss_fn.

        The output is the per-token loss and top-1 hits (``[*labels.shape, 2]``) when the stage
        fused its head, else logits (``model.cfg.fused_cross_entropy=False``).
        """
        return self._pipeline_loss_dict(output, labels)["lm_loss"]

    @torch.no_grad()
    def pipeline_metrics(self, output: torch.Tensor, labels: torch.Tensor) -> dict:
        """The logged scalars other than the loss (``pipeline_metric_names``) of the last stage's output."""
        out = self._pipeline_loss_dict(output, labels)
        return {k: out[k] for k in self.pipeline_metric_names}

    def num_parameters(self, non_embedding: bool = False) -> int:
        """See ``MT5Model.num_parameters``."""
        return self.mt5_model.num_parameters(non_embedding)

    def flops_per_token(self, seq_length: int, decoder_seq_length: Optional[int] = None) -> float:
        """See ``MT5Model.flops_per_token``."""
        return self.mt5_model.flops_per_token(seq_length, decoder_seq_length)

    def generate(self, encoder_input_ids: torch.Tensor, encoder_attn_mask: Optional[torch.Tensor] = None, **options):
        """Decode for the encoder input; ``MT5Model.generate`` lists the options (``max_new_tokens``, ...)."""
        return self.mt5_model.generate(encoder_input_ids, encoder_attn_mask, **options)
