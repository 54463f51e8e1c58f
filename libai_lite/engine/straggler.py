"""Naming a rank that is persistently slower than the others, from host timers only.

Each rank's mean step time outside backward is gathered at the log period over the "control" gloo group.
Outside backward, because data parallelism's gradient reduction inside it makes every rank wait for the
slowest, so whole step times come out alike. Ranks are compared within their pipeline stage, as stages
differ in work by design.
"""
from __future__ import annotations

from statistics import median_low

from ..utils.distributed import all_reduce_sum


class StragglerWatch:
    """Compares the ranks' step times each log period; a rank over ``ratio`` x its stage's median rank, and
    ``min_seconds`` or more over it, for ``periods`` log periods running is named in one line (each period
    while it stays slow)."""

    def __init__(self, ratio: float, periods: int, world_size: int, rank: int, pipeline_parallel_size: int = 1,
                 min_seconds: float = 0.0):
        self.ratio, self.periods, self.min_seconds = float(ratio), int(periods), float(min_seconds)
        self.world_size, self.rank = int(world_size), int(rank)
        # The mesh's outermost dimension is pp: a stage's ranks are contiguous.
        per_stage = max(self.world_size // max(int(pipeline_parallel_size), 1), 1)
        self.stages = [list(range(s, min(s + per_stage, self.world_size)))
                       for s in range(0, self.world_size, per_stage)]
        self._slow = [0] * self.world_size

    @classmethod
    def for_run(cls, log, layout) -> StragglerWatch | None:
        """The watch ``LogSettings`` ask for on ``layout``'s ranks; None when off or in a world of one."""
        if log.straggler_ratio is None or layout.world_size < 2:
            return None
        return cls(log.straggler_ratio, log.straggler_periods, layout.world_size, layout.rank,
                   layout.pipeline_parallel_size, log.straggler_min_seconds)

    def observe(self, mean_time: float, steps: int) -> str | None:
        """Gather every rank's ``mean_time`` over ``steps`` (a collective: every rank calls it at each log
        line) and return the warning naming the stragglers, or None. A world of one gathers nothing."""
        if self.world_size < 2 or steps < 1:
            return None
        # One slot per rank, summed: every rank learns all the times in one host collective.
        slots = [0.0] * self.world_size
        slots[self.rank] = float(mean_time)
        return self.judge(all_reduce_sum(slots), steps)

    def judge(self, times: list[float], steps: int) -> str | None:
        """Update the count of periods each rank has been slow from this period's ``times`` (seconds per step,
        by rank) and return the line naming those slow for ``periods`` running, or None."""
        named = []
        for ranks in self.stages:
            if len(ranks) < 2:
                continue
            middle = median_low([times[r] for r in ranks])
            for r in ranks:
                slow = middle > 0 and times[r] > self.ratio * middle and times[r] - middle >= self.min_seconds
                self._slow[r] = self._slow[r] + 1 if slow else 0
                if self._slow[r] >= self.periods:
                    named.append(f"rank {r} took {times[r] / middle:.1f}x the median step time "
                                 f"({times[r]:.2f} s vs {middle:.2f} s) over the last {steps} steps, "
                                 f"{self._slow[r]} log periods running")
        if not named:
            return None
        return f"straggler: {'; '.join(named)} (host time per step outside backward)"
