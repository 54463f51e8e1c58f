"""Embeddings that declare their tensor-parallel intent."""
from typing import Optional

from torch import nn

from .init_methods import InitMethod


class _IntentEmbedding(nn.Embedding):
    """``nn.Embedding`` with a pluggable initialiser and the intent attributes the parallel step reads."""

    parallel = "data"

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        init_method: Optional[InitMethod] = None,
        layer_idx: int = 0,
        device=None,
        dtype=None,
    ):
        # nn.Embedding.__init__ calls reset_parameters(), which needs init_method already set.
        self.init_method = init_method
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx, device=device, dtype=dtype)
        self.layer_idx = layer_idx

    def reset_parameters(self) -> None:
        """(Re)initialise the table; the padding row stays zero as in ``nn.Embedding``."""
        if self.init_method is None:
            super().reset_parameters()
            return
        self.init_method(self.weight)
        self._fill_padding_idx_with_zero()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parallel={self.parallel}, layer_idx={self.layer_idx}"


class VocabEmbedding(_IntentEmbedding):
    """Token embedding whose table is split over the vocabulary (SBP ``split(0)``) under tensor parallelism.

    ``parallel = "vocab"`` is read by the parallel step (``RowwiseParallel`` on an
    embedding masks out-of-shard ids and sums the partial lookups). The module itself
    is a plain ``nn.Embedding`` and never communicates.
    """

    parallel = "vocab"


class Embedding(_IntentEmbedding):
    """Replicated embedding (SBP ``broadcast``), e.g. learned positions: small tables are not worth splitting."""

    parallel = "data"
