"""Embeddings that declare the SBP of their table and of what they look up."""
from typing import Optional

from torch import nn

from ..sbp import Shorthand, broadcast, declare, hidden, partial_sum, split
from .init_methods import InitMethod

# "vocab" splits the rows and sums the partial lookups; "col" splits the columns, as for a per-head table.
# A replicated table's output joins the hidden states, so it takes their layout.
SBP_SHORTHAND = {
    "data": declare(weight=broadcast, input=broadcast, output=hidden),
    "vocab": declare(weight=split(0), input=broadcast, output=partial_sum, counts="vocab_size"),
    "col": declare(weight=split(1), input=broadcast, output=split(-1)),
}


class _SBPEmbedding(Shorthand, nn.Embedding):
    """``nn.Embedding`` with a pluggable initialiser and an SBP declaration (``sbp``) from ``parallel``."""

    SBP_SHORTHAND = SBP_SHORTHAND
    default_parallel = "data"

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 init_method: Optional[InitMethod] = None, layer_idx: int = 0, parallel: Optional[str] = None,
                 device=None, dtype=None):
        self.parallel = self.default_parallel if parallel is None else parallel
        # nn.Embedding.__init__ calls reset_parameters(), which needs init_method already set.
        self.init_method = init_method
        super().__init__(num_embeddings, embedding_dim, padding_idx=padding_idx, device=device, dtype=dtype)
        self.layer_idx = layer_idx

    def reset_parameters(self) -> None:
        """(Re)initialise the table; the padding row stays zero as in ``nn.Embedding``."""
        if self.init_method is None:
            return super().reset_parameters()
        self.init_method(self.weight)
        self._fill_padding_idx_with_zero()


class VocabEmbedding(_SBPEmbedding):
    """Token embedding whose table is split over the vocabulary under tensor parallelism (``"vocab"``:
    each rank looks up the ids in its shard and the plan sums the lookups)."""

    default_parallel = "vocab"


class Embedding(_SBPEmbedding):
    """Replicated embedding (``"data"``), e.g. learned positions: small tables are not worth splitting.
    ``parallel="col"`` splits it over ``embedding_dim`` instead (a per-head table)."""
