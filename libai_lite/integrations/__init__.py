"""Adapters that plug libai_lite into outside tools (lm-evaluation-harness: `lm_eval`).

They stand above the engine: each builds a run through `libai_lite.engine` and hands it to the
tool, and nothing in the core imports them (the tool's own extra may be missing). Import the
module itself; this package re-exports nothing.
"""
