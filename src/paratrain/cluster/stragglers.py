"""Stragglers: live workers whose steps take much longer than the others', named with the phase that grew.

Pure logic, fed by the scheduler with each worker's heartbeat report (metrics/telemetry.py: cumulative
steps and seconds per phase). Between two reports of one worker, its time per step is the difference
of its counters over the difference of its steps (a worker's first interval, which holds its first
step's one-off work, is not compared). What is compared is a worker's *own* time per step, data
loading plus compute: in a synchronous job every worker's wall time per step is the slowest one's
(the others wait for it in the round), so the wall time would hide the straggler, while the fast
workers' extra time shows up in their waiting. Communication is left out of the comparison (it is
still named when it grew the most): handing gradients to a busy server varies by milliseconds from
step to step on a loaded machine, which on short steps is as much as the step.

A worker whose own time per step is >= `ratio` times the median of the other workers' for `steps`
consecutive steps, seen slow at two heartbeats at least (one pause inside one heartbeat's interval
is not a straggler), is reported once (a `StragglerEvent` with `slow=True`), and again once its time
falls back below that (`slow=False`). The phase named is the one (data, compute, communication,
waiting) whose time per step exceeds the others' median by the most.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

PHASES = ("data", "compute", "communication", "waiting")
OWN = ("data", "compute")
"""The phases a worker spends on its own work (not waiting for the others)."""
MIN_BEATS = 2
"""Heartbeats a worker must be seen slow at before it is reported."""


@dataclass(frozen=True)
class StragglerConfig:
    """When the scheduler calls a worker a straggler (JobConfig.stragglers)."""

    ratio: float = 1.5
    """A worker is slow while its own time per step (data + compute) is at least this many times
    the median of the other workers'."""
    steps: int = 10
    """It is reported once it has been slow for this many consecutive steps."""
    min_excess_s: float = 0.005
    """Nor is a worker slow whose steps take less than this longer than the others' median: on
    steps of a few milliseconds, a loaded machine's scheduling alone doubles some of them."""

    def __post_init__(self) -> None:
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not self.ratio > 1:
            raise ValueError(f"StragglerConfig.ratio={self.ratio!r} must be a number > 1")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"StragglerConfig.steps={self.steps!r} must be an int >= 1")
        excess = self.min_excess_s
        if isinstance(excess, bool) or not isinstance(excess, (int, float)) or not excess >= 0:
            raise ValueError(f"StragglerConfig.min_excess_s={excess!r} must be a number >= 0")


@dataclass(frozen=True)
class StragglerEvent:
    """A worker became a straggler (`slow`) or recovered."""

    rank: int
    host: str
    slow: bool
    step: int
    """The worker's step count when it was decided."""
    ratio: float
    """Its own time per step over the others' median."""
    phase: str
    """The phase whose time per step grew the most over the others' (one of PHASES)."""
    seconds_per_step: dict[str, float]
    """Its time per step by phase, over the last heartbeat interval."""
    others_seconds_per_step: dict[str, float]
    """The median of the other workers' times per step by phase."""

    def describe(self) -> str:
        if not self.slow:
            return f"worker {self.rank} (host {self.host}) is no longer a straggler at step {self.step}"
        mine = self.seconds_per_step[self.phase] * 1e3
        theirs = self.others_seconds_per_step[self.phase] * 1e3
        return (
            f"worker {self.rank} (host {self.host}) is a straggler at step {self.step}: its steps take "
            f"{self.ratio:.1f}x the other workers' median; phase {self.phase} grew ({mine:.1f} ms per "
            f"step against {theirs:.1f} ms)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "host": self.host,
            "slow": self.slow,
            "step": self.step,
            "ratio": self.ratio,
            "phase": self.phase,
            "seconds_per_step": dict(self.seconds_per_step),
            "others_seconds_per_step": dict(self.others_seconds_per_step),
        }


@dataclass
class _Worker:
    host: str
    steps: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    per_step: dict[str, float] | None = None
    """Time per step by phase over the last interval with steps; None before it."""
    slow_steps: int = 0
    slow_beats: int = 0
    reported: bool = False
    ratio: float = 0.0


class StragglerDetector:
    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self._workers: dict[int, _Worker] = {}

    def observe(self, rank: int, host: str, report: dict[str, Any]) -> StragglerEvent | None:
        """One heartbeat report of worker `rank`; an event when it became a straggler or recovered."""
        steps, seconds = report.get("steps"), report.get("seconds")
        if not isinstance(steps, int) or not isinstance(seconds, dict):
            return None
        worker = self._workers.get(rank)
        if worker is None:  # its first interval holds its start: only its counters are kept
            self._workers[rank] = _Worker(host, steps, {ph: float(seconds.get(ph, 0.0)) for ph in PHASES})
            return None
        done = steps - worker.steps
        if done <= 0:
            return None
        previous = worker.seconds
        worker.per_step = {
            ph: max(0.0, float(seconds.get(ph, 0.0)) - previous.get(ph, 0.0)) / done for ph in PHASES
        }
        worker.steps, worker.seconds = steps, {ph: float(seconds.get(ph, 0.0)) for ph in PHASES}
        others = [w.per_step for r, w in self._workers.items() if r != rank and w.per_step is not None]
        if not others:
            return None
        median = {ph: statistics.median(o[ph] for o in others) for ph in PHASES}
        return self._judge(rank, worker, median, done)

    def _judge(
        self, rank: int, worker: _Worker, median: dict[str, float], done: int
    ) -> StragglerEvent | None:
        assert worker.per_step is not None
        mine, theirs = _own(worker.per_step), _own(median)
        worker.ratio = mine / theirs if theirs > 0 else 1.0
        slow = worker.ratio >= self.config.ratio and mine - theirs >= self.config.min_excess_s
        worker.slow_steps = worker.slow_steps + done if slow else 0
        worker.slow_beats = worker.slow_beats + 1 if slow else 0
        due = worker.slow_steps >= self.config.steps and worker.slow_beats >= MIN_BEATS
        if slow and not worker.reported and due:
            worker.reported = True
        elif not slow and worker.reported:
            worker.reported = False
        else:
            return None
        phase = max(PHASES, key=lambda ph: worker.per_step[ph] - median[ph])  # type: ignore[index]
        return StragglerEvent(
            rank,
            worker.host,
            worker.reported,
            worker.steps,
            worker.ratio,
            phase,
            dict(worker.per_step),
            median,
        )

    def slow(self) -> dict[int, float]:
        """The workers reported slow now, with their latest ratio."""
        return {rank: w.ratio for rank, w in self._workers.items() if w.reported}

    def ratios(self) -> dict[int, float]:
        """Every compared worker's latest ratio of its own time per step to the others' median."""
        return {rank: w.ratio for rank, w in self._workers.items() if w.ratio}

    def forget(self, rank: int) -> None:
        """A worker left the job (elastic): it is no one's peer any more."""
        self._workers.pop(rank, None)


def _own(per_step: dict[str, float]) -> float:
    return sum(per_step[ph] for ph in OWN)
