"""T5 (v1.0) and mT5 / T5 v1.1 encoder-decoder models on libai_lite's parallel layers.

Read top to bottom: config -> shared token embedding -> encoder layers -> encoder final norm -> decoder
layers (self-attention, cross-attention, feed-forward) -> decoder final norm -> LM head, then the
pretraining wrapper. What every encoder-decoder shares (forward, head, loss, generation, protocol) is
``libai_lite.lm.seq2seq``'s; this file keeps T5's architecture. ``model_type="t5"``: ReLU feed-forward,
LM head tied to the embedding and the decoder output scaled by ``hidden_size ** -0.5``; ``"mt5"``:
gated-GELU (``gelu_new``) and an untied, unscaled, column-parallel head (``tie_word_embeddings``
overrides, as in Hugging Face). Dropout after the embedding, on attention probabilities and on every
residual branch, not inside the feed-forward (as LiBai).
"""
from __future__ import annotations

import difflib
import functools
from dataclasses import MISSING, dataclass, fields
from typing import Any, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from libai_lite.config.validate import COUNT, COUNT_OR_NULL, SWITCH
from libai_lite.layers import Linear1D, MoEConfig, RMSLayerNorm, VocabEmbedding, init_method_normal
from libai_lite.layers.attention import KVCache
from libai_lite.layers.flex_attention import AttentionMask, flex_enabled
from libai_lite.lm.seq2seq import Seq2SeqLM, Seq2SeqLMForPreTraining
from libai_lite.utils.errors import UsageError

from .relative_position import RelativePositionBias
from .transformer_layer import FEED_FORWARD, MT5TransformerLayer

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
        embedding_dropout_prob, hidden_dropout_prob, attention_probs_dropout_prob: after the embedding,
            on every residual branch and stack output, on attention probabilities (Hugging Face's
            ``dropout_rate`` for all three).
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


class MT5Model(Seq2SeqLM):
    """The T5/mT5 encoder-decoder; ``forward`` returns logits ``[batch, dec_seq, vocab]``.

    Built as ``MT5Model(cfg)`` from a mapping of ``MT5Config`` keys (LiBai's ``LazyCall(MT5Model)(cfg=cfg)``)
    or an ``MT5Config``. Pre-LN blocks with RMS norm, no biases, no ``1/sqrt(d_kv)`` score scaling (T5 folds
    it into q's init) and a head width ``head_size`` apart from ``hidden_size / heads``. No absolute
    positions: each stack's first layer owns a learned bias per (bucketed relative distance, head), adds it
    to its self-attention scores and hands it to the layers after it (bidirectional in the encoder, causal
    in the decoder; none on cross-attention). Both stacks' layers form one sequence of ``2 * hidden_layers``
    indices (encoder ``"0".."L-1"``, decoder ``"L".."2L-1"``), the keys of ``encoder_layers`` and
    ``decoder_layers``, so checkpoint names do not depend on the pipeline layout.
    """

    def __init__(self, cfg: Union[Mapping[str, Any], MT5Config]):
        super().__init__()
        cfg = cfg if isinstance(cfg, MT5Config) else MT5Config.from_mapping(cfg)
        self.cfg = cfg
        num_layers = cfg.hidden_layers
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.fused_cross_entropy = cfg.fused_cross_entropy
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
        """One pipeline stage (the whole model is one): what ``PipelineStage`` runs, through ``PipelineForward``.

        A stage keeps the pieces whose ``layer_idx`` it owns (``embedding`` 0, ``encoder_final_layernorm``
        L-1, ``decoder_final_layernorm`` and ``lm_head`` 2L-1). The first stage takes ``(encoder_input_ids,
        decoder_input_ids)`` and embeds both; the others take what the previous one returned:
        ``(encoder_hidden, decoder_hidden)`` plus, while a stack is in progress, its position bias (with
        its gradient back to the table; an absent bias is an absent element, as ``PipelineStage`` sends
        tensors only). A stage holding encoder layers is mid-encoder, so a carried bias is the encoder's.
        Masks are keyword arguments the schedule gives every stage; the last stage ends in ``head``.
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
            return self.head(self.final_hidden(decoder_hidden), skip_lm_head, lm_labels)
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

    def final_hidden(self, decoder_hidden: torch.Tensor) -> torch.Tensor:
        """The decoder's last states as the head multiplies them: normed, dropped out and, tied, scaled."""
        hidden = self.hidden_dropout(self.decoder_final_layernorm(decoder_hidden))
        return hidden * self.hidden_size**-0.5 if self.tie_word_embeddings else hidden

    def word_embedding(self):
        """The token embedding (None on a pipeline stage without it): ``embedding_parameters`` reads it."""
        return self.embedding

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
        return self.lm_head(self.final_hidden(hidden))

class MT5ForPreTraining(Seq2SeqLMForPreTraining):
    """MT5Model plus its loss; LiBai configs build it as ``LazyCall(MT5ForPreTraining)(cfg=cfg)``.

    ``forward``, the loss and the model protocol are ``libai_lite.lm.seq2seq.Seq2SeqLMForPreTraining``'s.
    """

    # LiBai's bias_dropout_fusion is a switch, though its name matches the dropout probabilities' pattern.
    config_ranges = {**Seq2SeqLMForPreTraining.config_ranges, "intermediate_size": COUNT_OR_NULL,
                     "num_layers": COUNT, "bias_dropout_fusion": SWITCH}

    def __init__(self, cfg: Union[Mapping[str, Any], MT5Config]):
        # "mt5_model" is the prefix of every checkpoint key (and the Hugging Face mapping's ``inner``).
        super().__init__(MT5Model(cfg), "mt5_model")

    @staticmethod
    def special_token_ids(tokenizer) -> dict:
        """``eos``, ``pad`` and ``decoder_start`` as the span-corruption data uses them (``t5_special_ids``)."""
        from ..data.t5_dataset import t5_special_ids

        ids = t5_special_ids(tokenizer)
        return {k: ids[k] for k in ("eos", "pad", "decoder_start")}
