"""fp16's skipped step with the optimizer on the servers: every worker's overflow check of a sync
round, agreed on each server before any of its slices applies the round.

A worker scales its loss, unscales each gradient as it pushes it, and notes whether any pushed value
held inf or NaN. After its last push of round r it sends every server `overflow {clock: r, rank,
found}` on the same connection (so its pushes of the round came first). Each server collects one
flag per member; once it has them all, the round is dropped on every slice if any flag is set (no
value changes, no optimizer state: ShardState.set_verdict), else applied, and every worker's request
is answered `{overflowed}`, by which each worker's loss scale halves or not. Every worker sends
every server its flag, so every server reaches the same verdict on its own: no message between
servers, and no round trip the round's pulls did not already wait for (the verdict comes before
the round's new values can be pulled).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from paratrain.kvstore.api import KVError

logger = logging.getLogger(__name__)

KEPT = 4
"""Decided rounds whose verdict is kept for the workers still to read it (each reads its own at
once: only the round being decided and its predecessor are ever read)."""


class Verdicts:
    """One server's overflow flags per round and the verdicts they made. `members()`: the workers
    a round waits for; `decided(clock, overflowed)`: tells every slice (and serves the pulls)."""

    def __init__(self, members: Callable[[], frozenset[int]], decided: Callable[[int, bool], None]) -> None:
        self._members, self._decided = members, decided
        self._flags: dict[int, dict[int, bool]] = {}
        self._verdicts: dict[int, bool] = {}
        self._cond = threading.Condition()

    def report(self, clock: int, rank: int, found: bool, timeout_s: float | None = None) -> bool:
        """Worker `rank`'s flag for round `clock`; returns the round's verdict (whether it is
        dropped) once every member's flag is in. Blocks this worker's connection meanwhile: its
        next round's pushes wait for this answer anyway."""
        with self._cond:
            if clock in self._verdicts:
                raise KVError(
                    f"worker {rank}'s overflow check of round {clock} came after the round was decided"
                )
            self._flags.setdefault(clock, {})[rank] = bool(found)
        self.check()
        with self._cond:
            if not self._cond.wait_for(lambda: clock in self._verdicts, timeout_s):
                missing = sorted(self._members() - self._flags.get(clock, {}).keys())
                raise KVError(f"round {clock}'s overflow check: no flag from worker(s) {missing}")
            return self._verdicts[clock]

    def check(self) -> None:
        """Decide every round whose members have all reported (also after a member left)."""
        members = self._members()
        with self._cond:
            ready = sorted(c for c, flags in self._flags.items() if members <= flags.keys())
            for clock in ready:
                flags = self._flags.pop(clock)
                self._verdicts[clock] = any(flags.values())
                for old in [c for c in self._verdicts if c <= clock - KEPT]:
                    del self._verdicts[old]
        for clock in ready:
            overflowed = self._verdicts.get(clock, False)
            if overflowed:
                logger.info("round %d dropped: a worker's gradient held inf or NaN", clock)
            self._decided(clock, overflowed)
        if ready:
            with self._cond:
                self._cond.notify_all()

    def reset(self) -> None:
        """The rounds start again from 0 (a loaded state)."""
        with self._cond:
            self._flags, self._verdicts = {}, {}
