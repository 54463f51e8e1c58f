"""The memory planner: each rank's memory (parameters, gradients, optimizer state, activations, the peak)
before a job is queued.

It asks the model instead of a formula written for one architecture: static bytes are counted on the model
built on the meta device and divided as the layout divides them (tp splits, experts, pipeline stages, ZeRO
shards); activations come from one forward and backward traced under ``FakeTensorMode`` and replayed with
this rank's share. ``suggest`` tries the cheapest changes that make a run fit. docs/architecture.md ("The
memory planner") has the whole method.
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
