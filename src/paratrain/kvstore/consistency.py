"""The consistency models, one policy value each: `Sync()`, `Async()`, `Bounded(2)`. A policy is the
configuration (KVStoreConfig.consistency, Strategy.consistency) and the only place that knows what
its model means, on both sides of the wire: every decision that differs between models is a method
here, and the shard state (server/shard.py, server/sparse_table.py) and the stores (worker/) call it.

    worker side   min_version(clock): the version a pull waits for after `clock` pushes of its key;
                  how a single-process store applies a push (local_update); what pushes carry
    server side   on_push / on_table_push: join the push's round (applied once complete) or apply it
                  now; check, repeat and admit a push; what a push's staleness and its durable
                  version are

A worker's n-th push of a key joins round n in the round-based models (Sync, Bounded); a round is
applied once every member pushed to it, rounds in order, and the key's version becomes n+1. Without
an optimizer a round's sum (or mean) becomes the value. In Async each push is applied on arrival,
added to the value without an optimizer, and pulls never wait.

`Backup(b)` is sync with backup workers: a round applies once all but b of its workers pushed,
and a push to a round already applied is dropped (docs/concepts/backup_workers.md).

A new consistency model is one class (a subclass of RoundPolicy or ArrivalPolicy overrides what
differs) and one `register` line. Users may write a policy's name where they write configuration
(`consistency="bounded"` with `staleness=2`, "dist_async"): `parse` turns it into a value at that
edge. On the wire a policy is its name and its fields (`to_wire` / `from_wire`): worker 0 sends it
to the servers in `configure` (protocol.py).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Set
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from paratrain.kvstore.server.rules import Push
    from paratrain.kvstore.server.shard import ShardState
    from paratrain.kvstore.server.sparse_table import SparseTable


class Policy:
    """The base of every consistency model; see the module docstring. Subclasses are frozen
    dataclasses whose fields are the model's parameters."""

    name: ClassVar[str] = ""

    def check_job(self, workers: int, replication: int) -> None:
        """Refuse a job of `workers` pushing workers and servers kept `replication` times that
        this model cannot run (ValueError naming the field and the value)."""

    # -- worker side -------------------------------------------------------------------------------
    def min_version(self, clock: int) -> int:
        """The version a pull waits for, after this worker pushed its key `clock` times."""
        raise NotImplementedError

    def local_update(self, value: torch.Tensor, update: torch.Tensor) -> None:
        """A push to a single-process store without an optimizer (worker/local.py, reference.py)."""
        raise NotImplementedError

    def cuts_keys(self) -> bool:
        """Whether one key may be cut into slices sent in separate frames: only where a pull always
        gives every slice at one version."""
        return False

    def adds_in_place(self) -> bool:
        """Whether a same-host worker may add its push into the round's shared buffer itself, and
        pulls read round sums (compressed pulls of sums: compressed.py)."""
        raise NotImplementedError

    def pushes_everywhere(self) -> bool:
        """Whether a worker's push of a sparse table goes to every server, rows or not (a round
        waits for every member's push)."""
        raise NotImplementedError

    # -- server side: dense shards -----------------------------------------------------------------
    def on_push(self, state: ShardState, push: Push) -> None:
        """What a server does with a checked push to `state`."""
        raise NotImplementedError

    def check(self, state: ShardState, push: Push) -> None:
        """Refuse a push that cannot join `state` (KVError)."""
        raise NotImplementedError

    def repeated(self, state: ShardState, push: Push) -> bool:
        """Whether `push` was applied (or joined its round) already (a fail-over sends it again)."""
        raise NotImplementedError

    def admit(self, state: ShardState, push: Push) -> Push:
        """A push in the shard's clocks (a joiner's are shifted in round models)."""
        return push

    def update(self, state: ShardState, grad: torch.Tensor, weight: int, buffer: int | None) -> None:
        """The one update of the value (holds state.cond)."""
        raise NotImplementedError

    def round_complete(self, pushed: Set[int], waits: Set[int]) -> bool:
        """Round models: whether a round that the workers `pushed` joined applies, `waits` being the
        workers it waits for."""
        raise NotImplementedError

    def joins(self, clock: int, read: int) -> int:
        """Round models: the round a push joins, from its clock (in the shard's clocks) and the
        version its worker last pulled (`read`)."""
        return clock

    def drops_late(self) -> bool:
        """Round models: whether a push to a round already applied is dropped (else refused)."""
        return False

    def lends(self, state: ShardState) -> bool:
        """Whether backups may hold the value as it is, in the primary's memory (mirror.py)."""
        return False

    def round_buffers(self, wanted: int) -> int:
        """Shared buffers a same-host shard keeps for rounds besides its value."""
        return 0

    def pushed_at(self, clock: int, version: int) -> int:
        """The version a push counts from, for its staleness (report.py)."""
        raise NotImplementedError

    def durable_after(self, clock: int, version: int) -> int:
        """The version that holds push `clock`, once applied: replication acknowledges it then."""
        raise NotImplementedError

    # -- server side: sparse tables ----------------------------------------------------------------
    def holds_pushes(self) -> bool:
        """Whether a sparse table keeps a push past its request (until its round completes)."""
        raise NotImplementedError

    def on_table_push(self, table: SparseTable, rank: int, clock: int, entry: tuple, apply: bool) -> bool:
        """A push to a sparse table: join round `clock` or apply now. True: it joined a round that
        the caller applies once complete (where `apply` is False)."""
        raise NotImplementedError

    # -- the wire and the vocabulary ---------------------------------------------------------------
    def to_wire(self) -> tuple[str, dict[str, Any]]:
        """(name, fields): `configure`'s mode and params."""
        return self.name, dataclasses.asdict(self)  # type: ignore[call-overload]

    def describe(self) -> str:
        """`sync`, `async`, `bounded(2)`."""
        values = [str(v) for v in dataclasses.asdict(self).values()]  # type: ignore[call-overload]
        return self.name + (f"({', '.join(values)})" if values else "")

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True)
class RoundPolicy(Policy):
    """Models whose pushes join numbered rounds, applied once every member pushed to them."""

    def local_update(self, value: torch.Tensor, update: torch.Tensor) -> None:
        value.copy_(update)  # the round's sum (here: the one push) becomes the value

    def adds_in_place(self) -> bool:
        return True

    def pushes_everywhere(self) -> bool:
        return True

    def on_push(self, state: ShardState, push: Push) -> None:
        state.join_round(push)

    def check(self, state: ShardState, push: Push) -> None:
        state.check_round(push)

    def repeated(self, state: ShardState, push: Push) -> bool:
        return state.in_round(push)

    def admit(self, state: ShardState, push: Push) -> Push:
        return state.admit_joiner(push)

    def update(self, state: ShardState, grad: torch.Tensor, weight: int, buffer: int | None) -> None:
        state.apply_round(grad, weight, buffer)

    def round_complete(self, pushed: Set[int], waits: Set[int]) -> bool:
        return waits <= pushed

    def lends(self, state: ShardState) -> bool:
        return state.lending and state.region is not None and state.optimizer is None

    def round_buffers(self, wanted: int) -> int:
        return wanted

    def pushed_at(self, clock: int, version: int) -> int:
        return clock

    def durable_after(self, clock: int, version: int) -> int:
        return clock + 1

    def holds_pushes(self) -> bool:
        return True

    def on_table_push(self, table: SparseTable, rank: int, clock: int, entry: tuple, apply: bool) -> bool:
        table.join_round(rank, clock, entry)
        return True


@dataclass(frozen=True)
class ArrivalPolicy(Policy):
    """Models whose pushes apply one by one as they arrive."""

    def local_update(self, value: torch.Tensor, update: torch.Tensor) -> None:
        value.add_(update)  # pushes add up

    def adds_in_place(self) -> bool:
        return False

    def pushes_everywhere(self) -> bool:
        return False

    def on_push(self, state: ShardState, push: Push) -> None:
        state.apply_now(push)

    def check(self, state: ShardState, push: Push) -> None:
        state.check_arrival(push)

    def repeated(self, state: ShardState, push: Push) -> bool:
        return state.was_applied(push)

    def update(self, state: ShardState, grad: torch.Tensor, weight: int, buffer: int | None) -> None:
        state.apply_arrival(grad)

    def pushed_at(self, clock: int, version: int) -> int:
        return version

    def durable_after(self, clock: int, version: int) -> int:
        return version

    def holds_pushes(self) -> bool:
        return False

    def on_table_push(self, table: SparseTable, rank: int, clock: int, entry: tuple, apply: bool) -> bool:
        table.apply([entry], clock, add=True)
        return False


@dataclass(frozen=True)
class Sync(RoundPolicy):
    """Bulk synchronous: every round waits for all members; a pull sees this worker's last round."""

    name: ClassVar[str] = "sync"

    def min_version(self, clock: int) -> int:
        return clock

    def cuts_keys(self) -> bool:
        return True


@dataclass(frozen=True)
class Bounded(RoundPolicy):
    """Stale synchronous: rounds as in sync, but a pull may lag `staleness` rounds behind this
    worker's clock, so a worker runs at most `staleness` steps ahead of the slowest."""

    name: ClassVar[str] = "bounded"
    staleness: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.staleness, int) or isinstance(self.staleness, bool) or self.staleness < 0:
            raise ValueError(f"Bounded.staleness={self.staleness!r} must be an int >= 0")

    def min_version(self, clock: int) -> int:
        return max(0, clock - self.staleness)


@dataclass(frozen=True)
class Async(ArrivalPolicy):
    """Each push is applied on arrival (one optimizer step, or added to the value); pulls never wait."""

    name: ClassVar[str] = "async"

    def min_version(self, clock: int) -> int:
        return 0


@dataclass(frozen=True)
class Backup(RoundPolicy):
    """Sync with backup workers (Chen et al., "Revisiting Distributed Synchronous SGD", 2016;
    TensorFlow's SyncReplicasOptimizer): a round applies once all but `backup_workers` of the
    workers it waits for pushed to it, with the mean over the pushes that made it. A push to a
    round already applied is dropped and counted (`late`), never added to a later round: its
    worker's pull gets the newest value, and its next push joins the round of the version it
    pulled (ShardState.catch_up), so the gradient of a round is always one of that round's
    weights. Each slice closes its rounds on its own (as TensorFlow's per-variable accumulators
    do): one worker's push may make a round on one slice and miss it on another."""

    name: ClassVar[str] = "backup"
    backup_workers: int = 1

    def __post_init__(self) -> None:
        b = self.backup_workers
        if not isinstance(b, int) or isinstance(b, bool) or b < 1:
            raise ValueError(f"Backup.backup_workers={b!r} must be an int >= 1")

    def check_job(self, workers: int, replication: int) -> None:
        if self.backup_workers >= workers:
            raise ValueError(
                f"Backup.backup_workers={self.backup_workers} needs more workers than that: the job "
                f"has {workers} pushing, and a round needs at least one"
            )
        if replication > 1:
            raise ValueError(
                f"Backup.backup_workers={self.backup_workers} with JobConfig.replication={replication}: "
                "replicated servers do not tell a late push from one sent again after a fail-over"
            )

    def min_version(self, clock: int) -> int:
        return clock  # its own round applied, or a later one

    def adds_in_place(self) -> bool:
        return False  # a worker's clock need not be its round: the server places every push

    def admit(self, state: ShardState, push: Push) -> Push:
        return state.catch_up(state.admit_joiner(push))

    def check(self, state: ShardState, push: Push) -> None:
        state.check_round(push, late=True)

    def on_push(self, state: ShardState, push: Push) -> None:
        state.join_or_drop(push)

    def round_complete(self, pushed: Set[int], waits: Set[int]) -> bool:
        made = len(pushed & waits)
        return waits <= pushed or made >= max(1, len(waits) - self.backup_workers)

    def joins(self, clock: int, read: int) -> int:
        return max(clock, read)

    def drops_late(self) -> bool:
        return True


POLICIES: dict[str, type[Policy]] = {}
"""The registry: name -> policy class."""


def register(cls: type[Policy]) -> type[Policy]:
    """Add a consistency model to the vocabulary (its `name`); returns the class."""
    if not cls.name or cls.name in POLICIES and POLICIES[cls.name] is not cls:
        raise ValueError(f"consistency name {cls.name!r} is empty or taken")
    POLICIES[cls.name] = cls
    return cls


for _cls in (Sync, Async, Bounded, Backup):
    register(_cls)


def names() -> tuple[str, ...]:
    return tuple(POLICIES)


def parse(
    value: Policy | str,
    staleness: int | None = None,
    owner: str = "KVStoreConfig",
    backup_workers: int | None = None,
) -> Policy:
    """A policy from what a user wrote (`owner`'s fields `consistency`, `staleness` and
    `backup_workers`): a policy value as it is, or a name ("rounds", the older wire name, is
    sync); `staleness` goes to a policy with that field (Bounded); `backup_workers` makes sync
    Backup. ValueError names the field and the value."""
    for field, number in (("staleness", staleness), ("backup_workers", backup_workers)):
        if number is not None and (not isinstance(number, int) or isinstance(number, bool) or number < 0):
            raise ValueError(f"{owner}.{field}={number!r} must be an int >= 0")
    if isinstance(value, str):
        name = "sync" if value == "rounds" else value
        if name not in POLICIES:
            choices = ", ".join(names())
            raise ValueError(f"{owner}.consistency={value!r} is not one of {choices}{_near(value)}")
        value = POLICIES[name]()
    elif not isinstance(value, Policy):
        raise ValueError(f"{owner}.consistency={value!r} is not a consistency policy or one of {names()}")
    if backup_workers:
        if value.name not in (Sync.name, Backup.name):
            raise ValueError(
                f"{owner}.backup_workers={backup_workers!r} needs consistency='sync', not {value}"
            )
        value = Backup(backup_workers)
    if not staleness:
        return value
    if not _has_staleness(type(value)):
        takers = " or ".join(repr(n) for n, c in POLICIES.items() if _has_staleness(c))
        raise ValueError(f"{owner}.staleness={staleness!r} needs consistency={takers}, not {value.name!r}")
    return dataclasses.replace(value, staleness=staleness)  # type: ignore[type-var]


def _has_staleness(cls: type[Policy]) -> bool:
    return "staleness" in {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]


def _near(word: str) -> str:
    nearest = difflib.get_close_matches(word, names(), n=1, cutoff=0.6)
    return f"; did you mean {nearest[0]!r}?" if nearest else ""


def from_wire(name: str, params: dict[str, Any] | None = None) -> Policy:
    """The policy a `configure` message names (to_wire's inverse)."""
    name = "sync" if name == "rounds" else name
    if name not in POLICIES:
        raise ValueError(f"consistency {name!r} is not one of {names()}")
    try:
        return POLICIES[name](**(params or {}))
    except TypeError as exc:
        raise ValueError(f"consistency {name!r} does not take {params!r}: {exc}") from None
