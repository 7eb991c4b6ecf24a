"""What a server's dense shards (shard.py) and sparse tables (sparse_table.py) share: the rules
every one of them follows (Rules), one worker's push (Push), and the clocks of the async pushes
applied (Clocks), by which replicated servers drop a repeat."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paratrain.kvstore.consistency import Policy, Sync


@dataclass
class Rules:
    """What every shard (and sparse table) of one server follows; set by the workers' `configure`
    and changed when a worker leaves. Its fields are replaced, never mutated in place, so readers
    need no lock."""

    policy: Policy = field(default_factory=Sync)
    members: frozenset[int] = frozenset()
    """The workers a round waits for (the scheduler's membership, as the workers sent it)."""
    average: bool = False
    """A round's update is the mean of its pushes (over the workers they stand for), not the sum."""
    joiners: frozenset[int] = frozenset()
    """Elastic jobs: live workers that joined the running job. A round waits for one only from its
    first push to the shard on (ShardState.admit), so a joiner never holds back a round it missed."""
    clip: bool = False
    """Sync rounds wait, complete but unapplied, for the scale that clips them by the global norm
    (ShardState.norm_share and set_scale): every server's share of the norm is needed first."""
    overflow: bool = False
    """Sync rounds wait, complete but unapplied, until every member's overflow check of its pushed
    gradient has arrived (fp16's loss scaling, server/overflow.py); a round any of them found
    inf or NaN in is dropped (ShardState.set_verdict)."""


@dataclass
class Push:
    """One worker's push to one shard."""

    rank: int
    clock: int
    """The round it joins: how many times this worker pushed the key before."""
    grad: torch.Tensor | None
    """The payload; None where the worker added it into the round's shared buffer itself."""
    owned: bool = True
    """The payload is this push's own buffer (else it views the shared-memory ring: copy it)."""
    weight: int = 1
    """How many workers' gradients the payload sums (a host's leader pushes its host's sum)."""


@dataclass
class Clocks:
    """The clocks of one worker's async pushes applied to a shard (replicated servers drop a
    repeat): every clock below `below`, and those in `ahead` (a push that failed over may arrive
    after a later one)."""

    below: int = 0
    ahead: set[int] = field(default_factory=set)

    def has(self, clock: int) -> bool:
        return clock < self.below or clock in self.ahead

    def add(self, clock: int) -> None:
        self.ahead.add(clock)
        while self.below in self.ahead:
            self.ahead.remove(self.below)
            self.below += 1
