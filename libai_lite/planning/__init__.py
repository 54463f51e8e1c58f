"""The memory planner: memory per rank before a job is queued (parameters, gradients, optimizer state,
activations, the peak).

Megatron-LM's ``report_theoretical_memory`` and DeepSpeed's ``estimate_zero*`` answer "will it fit" from a
formula written for one architecture. This planner asks the model instead, so a new project needs nothing:

- **static bytes** (parameters, gradients, optimizer state) are counted on the model built on the meta
  device: each parameter's shape and dtype, divided over tensor-parallel ranks where its layer declares a
  split (``libai_lite.sbp``), over expert-parallel ranks for MoE experts, kept on the pipeline
  stages the splitter gives its ``layer_idx`` (``libai_lite.parallel.pipeline_split``), and sharded over
  data-parallel ranks as the ZeRO stage does it: FSDP2's dim-0 shards (ZeRO-2/3), and for ZeRO-1
  ``ZeroRedundancyOptimizer``'s own greedy partition of whole parameters. Optimizer state per parameter
  byte is measured by stepping the configured optimizer once on a small tensor (AdamW: 2).
- **activations** are measured, not modelled: one forward and backward of the model at the configured
  micro-batch, sequence, autocast dtype and activation checkpointing runs under ``FakeTensorMode`` (shapes
  only: no memory, no arithmetic), and every storage it allocates or frees is recorded with the pipeline
  layer, the transformer layer (FSDP unit) and whether it lies in a tensor-parallel split region.
  Replaying that record with this rank's share (1/tp inside split regions, or everywhere under sequence
  parallelism; only its pipeline stage's layers) gives what the forward keeps for backward and the
  high-water mark of forward+backward. Values that decide a size at run time (a boolean mask's
  selection) take their largest size.

The replay adds what data parallelism holds at each moment: gradients as the backward produces them
(DDP's buckets hold them from the start), and FSDP's gathered parameters (ZeRO-2: every layer from its
forward to the end of backward; ZeRO-3: the layer running and, in backward, the one FSDP2 prefetches, the
last layer from forward to backward, the root's parameters while they are used). The optimizer step's own
temporaries are measured the same way, on fake parameters of the rank's shapes. ``offload`` (ZeRO-2/3) moves parameters, gradients and
optimizer state to host memory, reported as ``host`` beside the device peak. ``suggest`` tries the
cheapest changes in turn (ZeRO stage up, activation checkpointing on, a smaller micro-batch, more tensor
then pipeline parallelism), each checked against the world size and the model and re-estimated.
"""
from .config import plan_settings, planner_from_config, resolve_for_plan, settings_from_config, startup_estimate
from .estimate import MemoryPlanner, optimizer_state_ratio
from .settings import GiB, MemoryEstimate, PlanSettings, format_estimate, gib, parse_bytes, startup_line
from .suggest import candidate_changes, suggest
from .trace import ActivationTrace, optimizer_step_temporaries, trace_activations

__all__ = ["ActivationTrace", "GiB", "MemoryEstimate", "MemoryPlanner", "PlanSettings", "candidate_changes",
           "format_estimate", "gib", "optimizer_state_ratio", "optimizer_step_temporaries", "parse_bytes",
           "plan_settings", "planner_from_config", "resolve_for_plan", "settings_from_config", "startup_estimate", "startup_line", "suggest",
           "trace_activations"]
