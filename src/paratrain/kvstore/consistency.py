"""The consistency models, one policy object each: the only place that knows what sync, async and
bounded(s) mean, on both sides of the wire.

    worker side   min_version(clock): the version a pull waits for after `clock` pushes of its key
    server side   on_push(state, push): join the push's round (applied once complete) or apply it now

A worker's n-th push of a key joins round n in the round-based models (`rounds`: sync, bounded); a
round is applied once every member pushed to it, rounds in order, and the key's version becomes n+1.
Without an optimizer a round's sum (or mean) becomes the value. In `async` each push is applied on
arrival, added to the value without an optimizer, and pulls never wait.

A new consistency model is one more class here and its name in POLICIES: KVStoreConfig and
Strategy take their vocabulary from POLICIES, the servers build theirs from the name the workers
send (`configure`), and the shard state (server/shard.py, server/sparse_table.py) asks the policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from paratrain.kvstore.server.rules import Push
    from paratrain.kvstore.server.shard import ShardState


class Policy(Protocol):
    name: ClassVar[str]
    rounds: ClassVar[bool]
    """Pushes join numbered rounds (applied once every member pushed); else each applies on arrival."""

    def min_version(self, clock: int) -> int:
        """The version a pull waits for, after this worker pushed its key `clock` times."""
        ...

    def on_push(self, state: ShardState, push: Push) -> None:
        """What a server does with a checked push to `state`."""
        ...


@dataclass(frozen=True)
class Sync:
    """Bulk synchronous: every round waits for all members; a pull sees this worker's last round."""

    name: ClassVar[str] = "sync"
    rounds: ClassVar[bool] = True

    def min_version(self, clock: int) -> int:
        return clock

    def on_push(self, state: ShardState, push: Push) -> None:
        state.join_round(push)


@dataclass(frozen=True)
class Bounded(Sync):
    """Stale synchronous: rounds as in sync, but a pull may lag `staleness` rounds behind this
    worker's clock, so a worker runs at most `staleness` steps ahead of the slowest."""

    name: ClassVar[str] = "bounded"
    staleness: int = 0

    def min_version(self, clock: int) -> int:
        return max(0, clock - self.staleness)


@dataclass(frozen=True)
class Async:
    """Each push is applied on arrival (one optimizer step, or added to the value); pulls never wait."""

    name: ClassVar[str] = "async"
    rounds: ClassVar[bool] = False

    def min_version(self, clock: int) -> int:
        return 0

    def on_push(self, state: ShardState, push: Push) -> None:
        state.apply_now(push)


POLICIES: dict[str, type[Sync] | type[Bounded] | type[Async]] = {
    "sync": Sync,
    "async": Async,
    "bounded": Bounded,
}
NAMES = tuple(POLICIES)


def policy(name: str, staleness: int = 0) -> Policy:
    """The policy called `name` ("rounds", the older wire name, is sync)."""
    name = "sync" if name == "rounds" else name
    if name not in POLICIES:
        raise ValueError(f"consistency {name!r} is not one of {NAMES}")
    return Bounded(staleness) if name == "bounded" else POLICIES[name]()
