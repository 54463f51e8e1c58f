"""What decides memory per rank (``PlanSettings``), the planner's answer (``MemoryEstimate``) and how it is printed."""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

import torch

from ..utils.distributed import Layout
from ..utils.errors import UsageError
from ..utils.parallel_dims import ParallelDims

GiB = 2**30

_DTYPE_NAMES = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class PlanSettings(ParallelDims):
    """Everything besides the model and its sample that decides memory per rank: a layout (``ParallelDims``, whose
    fields it has) and what the run's spec adds to it."""

    activation_checkpoint_every: int = 0  # 0: off; N: every N-th transformer layer
    activation_checkpoint_mode: str = "full"  # or "selective" (libai_lite.converters.activation_checkpoint)
    micro_batch_size: int = 1
    num_microbatches: int = 1  # gradient accumulation steps: a pipeline schedule's micro-batches
    amp_dtype: torch.dtype | None = None
    # On "cpu" training runs in host memory, so offload moves nothing.
    device: str = "cuda"

    @classmethod
    def from_dims(cls, dims: ParallelDims, **rest) -> PlanSettings:
        """The settings of a run's ``ParallelDims`` (sizes, ZeRO, pipeline options); ``rest``: the others (batch
        sizes, precision, activation checkpointing, device kind)."""
        return cls(**{f.name: getattr(dims, f.name) for f in fields(ParallelDims)}, **rest)

    def layout(self) -> Layout:
        """These settings as a ``Layout`` of rank 0 without a process group: what the trainer's checks read."""
        return Layout.of(self, device=torch.device(self.device))

    def describe(self) -> str:
        """The layout and the memory-relevant switches, in one line."""
        cp = f" cp={self.context_parallel_size}" if self.context_parallel_size > 1 else ""
        parts = [f"pp={self.pipeline_parallel_size} {self.describe_dp()}{cp} tp={self.tensor_parallel_size}"]
        if self.sequence_parallel:
            parts.append("sequence parallel")
        parts.append(f"ZeRO-{self.zero_stage}{' + offload' if self.offload else ''}" if self.zero_stage else "no ZeRO")
        if self.activation_checkpoint_every:
            every = self.activation_checkpoint_every
            parts.append(f"{self.activation_checkpoint_mode} activation checkpointing"
                         + (f" every {every} layers" if every > 1 else ""))
        parts.append(f"micro-batch {self.micro_batch_size}")
        parts.append(_DTYPE_NAMES.get(self.amp_dtype, str(self.amp_dtype)))
        return ", ".join(parts)


@dataclass
class MemoryEstimate:
    """Bytes on the fullest rank (the pipeline stage with the largest peak).

    ``params``, ``grads`` and ``optimizer`` are what the rank keeps between steps (in host memory under
    offload, then also counted in ``host``); ``activations`` what the forward keeps for backward, for every
    micro-batch a pipeline schedule holds at once; ``peak`` the device high-water mark of a training step.
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    peak: int
    host: int = 0
    stage: int = 0
    num_parameters: int = 0
    settings: PlanSettings = field(default_factory=PlanSettings)
    notes: tuple[str, ...] = ()

    @property
    def static(self) -> int:
        """Parameters + gradients + optimizer state on the rank."""
        return self.params + self.grads + self.optimizer


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"16 GB"``, ``"512MiB"``, ``"1e9"`` -> bytes (GB/MB are decimal, GiB/MiB binary)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([KMGT]i?B?|B)?\s*", str(text), flags=re.IGNORECASE)
    if re.fullmatch(r"\s*-.*", str(text)) or (m and float(m.group(1)) == 0):
        raise UsageError(f"device memory {text!r} is not positive; give one device's memory, like 80GiB or 16GB")
    if not m:
        raise UsageError(f"device memory {text!r} is not a size; write it like 80GiB, 16GB or 512MiB")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper().rstrip("B") or "B"
    scale = {"B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(value * scale)


def gib(n: float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{n / GiB:.2f} GiB"



def format_estimate(est: MemoryEstimate) -> str:
    """The table ``tools/estimate_memory.py`` prints: GiB per rank, one row per kind of memory."""
    rows = [("parameters", est.params), ("gradients", est.grads), ("optimizer state", est.optimizer),
            ("activations", est.activations), ("peak (device)", est.peak)]
    if est.host:
        rows.append(("host (offloaded)", est.host))
    where = f" (pipeline rank {est.stage}, the fullest)" if est.settings.pipeline_parallel_size > 1 else ""
    lines = [f"{est.num_parameters / 1e6:.1f}M parameters per rank before ZeRO sharding{where}; {est.settings.describe()}",
             f"{'per rank':18s}{'GiB':>10s}"]
    lines += [f"{name:18s}{value / GiB:10.3f}" for name, value in rows]
    lines += [f"note: {n}" for n in est.notes]
    if est.settings.device != "cpu":
        lines.append("note: the peak counts tensors (torch.cuda.max_memory_allocated); the CUDA context and the "
                     "allocator's cache take some of the device besides")
    return "\n".join(lines)


def startup_line(est: MemoryEstimate) -> str:
    """The one line the trainer logs at start-up."""
    s = est.settings
    return (f"Memory estimate per rank ({s.describe()}): params {gib(est.params)}, grads {gib(est.grads)}, "
            f"optimizer {gib(est.optimizer)}, activations {gib(est.activations)}, peak {gib(est.peak)}"
            + (f", offloaded to host {gib(est.host)}" if est.host else "") + " (tools/estimate_memory.py)")
