"""SBP, LiBai's placement vocabulary: what layers declare, and the DTensor placements ``tensor_parallel`` makes.

=====================  ==================  ===============================================
SBP                    DTensor             meaning on one mesh dimension
=====================  ==================  ===============================================
``split(d)``           ``Shard(d)``        each rank holds one slice of dimension ``d``
``broadcast``          ``Replicate()``     every rank holds the whole tensor
``partial_sum``        ``Partial()``       the tensor is the sum of the ranks' tensors
``hidden``             ``Shard(1)`` or     the residual stream between blocks: split over
                       ``Replicate()``     the sequence under sequence parallelism, else whole
=====================  ==================  ===============================================

An ``nd_sbp(dp, tp)`` is the 2-D SBP ``[dp_sbp, tp_sbp]`` on the ``("dp", "tp")`` sub-mesh; ``declare``
fills the dp entry (parameters broadcast, activations split over the batch).
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .utils.errors import UsageError

broadcast = Replicate()
partial_sum = Partial()


def split(dim: int) -> Shard:
    """SBP ``split(dim)``: each rank holds one slice of ``dim`` (negative counts from the end)."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise UsageError(f"split() takes a tensor dimension (an int), got {dim!r}")
    return Shard(dim)


class _Hidden:
    """The SBP of hidden states between blocks, which only the parallel plan can resolve."""

    def __repr__(self) -> str:
        return "hidden"

    def __reduce__(self):
        # One instance, kept through deepcopy and pickling (a model copied for pipeline stages).
        return "hidden"


# Layers cannot know whether sequence parallelism is on, so they name the residual stream
# instead of its placement; ``placements`` resolves it when the plan is built.
hidden = _Hidden()

NdSbp = Tuple[object, object]
ND_DIMS = ("dp", "tp")


def nd_sbp(dp, tp) -> NdSbp:
    """The 2-D SBP ``[dp_sbp, tp_sbp]``: placements on the ``("dp", "tp")`` sub-mesh, in that order."""
    for which, s in (("dp", dp), ("tp", tp)):
        if not isinstance(s, (Placement, _Hidden)):
            raise UsageError(f"nd_sbp's {which} entry must be split(d), broadcast, partial_sum or hidden, got {s!r}")
    return (dp, tp)


def placements(sbp: NdSbp, dims: Sequence[str] = ("tp",), sequence_parallel: bool = False) -> Tuple[Placement, ...]:
    """DTensor placements of ``sbp`` on a mesh whose dimensions are named ``dims`` (some of ``("dp", "tp")``);
    ``hidden`` is ``Shard(1)`` (the sequence) with ``sequence_parallel``, else ``Replicate()``."""
    unknown = [d for d in dims if d not in ND_DIMS]
    if unknown:
        raise UsageError(f"an nd_sbp has entries for the mesh dimensions {ND_DIMS}, not {unknown}")
    stream = Shard(1) if sequence_parallel else broadcast
    return tuple(stream if isinstance(s, _Hidden) else s for s in (sbp[ND_DIMS.index(d)] for d in dims))


@dataclass(frozen=True)
class LayerSBP:
    """What a layer declares: the nd_sbp of its parameters and of the activations it takes and gives.

    ``weight`` and ``bias`` are None for a block whose sublayers declare their own. ``input`` is the layout
    the layer needs its ``args`` in, by default its first forward argument; ``output`` is the layout it
    gives. A column split taking ``hidden`` is an LM head, whose vocab-sharded logits stay a DTensor for
    ``loss_parallel``. A split dimension is cut in whole blocks of ``unit``, and ``counts`` names the
    constructor argument giving their number, for error messages.
    """

    weight: Optional[NdSbp]
    bias: Optional[NdSbp]
    input: NdSbp
    output: NdSbp
    args: Tuple[str, ...] = ()
    unit: int = 1
    counts: Optional[str] = None

    def arg_positions(self, forward) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
        """Positional indices and names under which ``forward`` takes the declared ``args``."""
        params = list(inspect.signature(forward).parameters)
        names = self.args or tuple(params[:1])
        missing = [n for n in names if n not in params]
        if missing:
            raise UsageError(f"the declared SBP names inputs {missing} that {forward.__qualname__} does not take")
        return tuple(params.index(n) for n in names), names


def declare(weight=None, bias=None, input=broadcast, output=broadcast, args: Sequence[str] = (), unit: int = 1,
            counts: Optional[str] = None) -> LayerSBP:
    """A ``LayerSBP`` from tp SBPs: parameters are broadcast over dp, activations split over the batch."""
    param = (lambda s: None if s is None else nd_sbp(broadcast, s))
    return LayerSBP(param(weight), param(bias), nd_sbp(split(0), input), nd_sbp(split(0), output), tuple(args),
                    unit, counts)


def shorthand(table: Mapping[str, LayerSBP], parallel: str, layer: str) -> LayerSBP:
    """The declaration ``parallel`` stands for in ``layer``'s ``table``; an unknown word is refused in one line."""
    if parallel not in table:
        words = [repr(k) for k in table]
        raise UsageError(f"{layer} parallel must be {', '.join(words[:-1])} or {words[-1]}, got {parallel!r}")
    return table[parallel]


class Shorthand:
    """Mixin for a layer whose ``parallel`` word (LiBai's shorthand) stands for its ``sbp`` in ``SBP_SHORTHAND``.

    ``split_unit`` and ``split_counts`` fill the declaration's ``unit`` and ``counts``.
    """

    SBP_SHORTHAND: Mapping[str, LayerSBP] = {}
    split_unit: int = 1
    split_counts: Optional[str] = None

    @property
    def parallel(self) -> str:
        """The shorthand word; assigning it re-declares ``sbp``."""
        return self._parallel

    @parallel.setter
    def parallel(self, value: str) -> None:
        decl = shorthand(self.SBP_SHORTHAND, value, type(self).__name__)
        self.sbp = dataclasses.replace(decl, unit=self.split_unit, counts=self.split_counts or decl.counts)
        self._parallel = value

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parallel={self.parallel}, layer_idx={self.layer_idx}"
