"""Pipeline schedules as plain data: for every stage, the ordered list of its actions.

An action is the forward `F` or the backward `B` of one micro-batch on that stage. The runtime
executes these lists literally (runtime.py): a forward first receives its input from the previous
stage, a backward first receives its output's gradient from the next stage, and sends never block.
So a schedule is correct when, on every stage, each micro-batch runs forward once and then backward
once, neighbour stages take the micro-batches in the same order (messages carry no index), and the
cross-stage dependencies (F on stage s needs F on s-1; B on stage s needs B on s+1)
can be met in the listed orders without a deadlock: `check_schedule` replays them to make sure.

    gpipe(2, 3)       stage 0: F0 F1 F2 B0 B1 B2      stage 1: F0 F1 F2 B0 B1 B2
    one_f_one_b(2, 3) stage 0: F0 F1 B0 F2 B1 B2      stage 1: F0 B0 F1 B1 F2 B2

`simulate` gives the ideal timeline for given action costs; with equal stages both schedules leave
each stage idle (p - 1) / (m + p - 1) of the time (`ideal_bubble`), and 1F1B holds at most p - s
micro-batches in flight on stage s where GPipe holds m.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule: the forward or the backward of one micro-batch."""

    kind: str
    """FORWARD ("F") or BACKWARD ("B")."""
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


Schedule = list[list[Action]]
"""Per stage (index = stage), that stage's actions in execution order."""


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """Fill and drain: every forward, then every backward (in micro-batch order)."""
    _check_sizes(stages, micro_batches)
    forwards = [Action(FORWARD, i) for i in range(micro_batches)]
    backwards = [Action(BACKWARD, i) for i in range(micro_batches)]
    return [forwards + backwards for _ in range(stages)]


def one_f_one_b(stages: int, micro_batches: int) -> Schedule:
    """PipeDream-flush 1F1B: stage s runs min(p - s - 1, m) warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards."""
    _check_sizes(stages, micro_batches)
    schedule = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, micro_batches)
        actions = [Action(FORWARD, i) for i in range(warmup)]
        for i in range(micro_batches - warmup):
            actions += [Action(FORWARD, warmup + i), Action(BACKWARD, i)]
        actions += [Action(BACKWARD, i) for i in range(micro_batches - warmup, micro_batches)]
        schedule.append(actions)
    return schedule


SCHEDULE_BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build_schedule(name: str, stages: int, micro_batches: int) -> Schedule:
    """The schedule called `name` ("gpipe" or "1f1b"), checked."""
    if name not in SCHEDULE_BUILDERS:
        raise ValueError(f"schedule {name!r} is not one of {tuple(SCHEDULE_BUILDERS)}")
    schedule = SCHEDULE_BUILDERS[name](stages, micro_batches)
    check_schedule(schedule, micro_batches)
    return schedule


def _check_sizes(stages: int, micro_batches: int) -> None:
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"stages={stages} and micro_batches={micro_batches} must be >= 1")


def check_schedule(schedule: Schedule, micro_batches: int) -> None:
    """Raises ValueError unless every stage runs each micro-batch's forward once before its backward
    once, and the stages' orders can all run to the end (no deadlock)."""
    for stage, actions in enumerate(schedule):
        expected = {Action(kind, i) for kind in (FORWARD, BACKWARD) for i in range(micro_batches)}
        if len(actions) != len(expected) or set(actions) != expected:
            raise ValueError(
                f"stage {stage} must run F and B of micro-batches 0..{micro_batches - 1} once each"
            )
        for action in actions:
            if action.kind == BACKWARD and actions.index(Action(FORWARD, action.micro_batch)) > actions.index(
                action
            ):
                raise ValueError(f"stage {stage} runs {action} before F{action.micro_batch}")
    # Messages between two stages arrive in the order they were sent and carry no micro-batch index:
    # neighbours must run their forwards (and their backwards) in the same micro-batch order.
    for kind in (FORWARD, BACKWARD):
        orders = [[a.micro_batch for a in actions if a.kind == kind] for actions in schedule]
        for stage in range(1, len(orders)):
            if orders[stage] != orders[stage - 1]:
                raise ValueError(
                    f"stages {stage - 1} and {stage} run their {kind} actions in different micro-batch "
                    f"orders ({orders[stage - 1]} and {orders[stage]})"
                )
    simulate(schedule)  # raises on a deadlock


def peak_in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward ran and whose backward had not, at any point of `actions`."""
    live, peak = 0, 0
    for action in actions:
        live += 1 if action.kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def ideal_bubble(stages: int, micro_batches: int) -> float:
    """The idle share of each stage for equal stages and free communication: (p-1) / (m+p-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


@dataclass(frozen=True)
class Timeline:
    """When each action ran in a simulation: `spans[stage][i]` = (start, end) of schedule[stage][i]."""

    spans: list[list[tuple[float, float]]]

    @property
    def makespan(self) -> float:
        return max(end for spans in self.spans for _, end in spans)

    def bubble(self, stage: int) -> float:
        """The share of the makespan stage `stage` was idle."""
        busy = sum(end - start for start, end in self.spans[stage])
        return 1.0 - busy / self.makespan


def simulate(schedule: Schedule, forward_s: float = 1.0, backward_s: float = 2.0) -> Timeline:
    """Replays `schedule` with every forward costing `forward_s` and every backward `backward_s` on
    every stage, communication free. Raises ValueError if the stages deadlock."""
    stages = len(schedule)
    done: dict[tuple[int, Action], float] = {}
    spans: list[list[tuple[float, float]]] = [[] for _ in range(stages)]
    position, clock = [0] * stages, [0.0] * stages
    while any(position[s] < len(schedule[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(schedule[s]):
                action = schedule[s][position[s]]
                ready = _ready_at(action, s, stages, done)
                if ready is None:
                    break
                start = max(clock[s], ready)
                clock[s] = start + (forward_s if action.kind == FORWARD else backward_s)
                done[(s, action)] = clock[s]
                spans[s].append((start, clock[s]))
                position[s] += 1
                progressed = True
        if not progressed:
            waiting = {
                s: str(schedule[s][position[s]]) for s in range(stages) if position[s] < len(schedule[s])
            }
            raise ValueError(f"schedule deadlocks: stages wait at {waiting}")
    return Timeline(spans)


def _ready_at(action: Action, stage: int, stages: int, done: dict[tuple[int, Action], float]) -> float | None:
    """When `action`'s input from a neighbour stage is there (0 if it needs none), None if not yet."""
    if action.kind == FORWARD:
        needs = (stage - 1, action) if stage > 0 else None
    else:
        needs = (stage + 1, action) if stage < stages - 1 else (stage, Action(FORWARD, action.micro_batch))
    if needs is None:
        return 0.0
    return done.get(needs)


def format_schedule(schedule: Schedule) -> str:
    """One line per stage, e.g. "stage 0: F0 F1 B0 F2 B1 B2"."""
    return "\n".join(f"stage {s}: " + " ".join(map(str, actions)) for s, actions in enumerate(schedule))
