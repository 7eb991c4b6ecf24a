"""The parameter servers' messages, one typed value each (transport/message.py), routed on a server
by one table (`KVServer`'s, server/server.py; the sparse ops by `SparseTables`', server/sparse.py).

What each one does is told where it is handled (server/server.py's and server/sparse.py's module
docstrings); here is only its form. Dense requests address slices by parallel lists (`keys`,
`starts`, `stops`: slice i is elements [starts[i], stops[i]) of keys[i]), each slice one flat
tensor of the payload. The frames sent most (init, push, pull, pushpull) are keyword-only, their
fields declared in the order they travel, and leave fields at their defaults off the wire
(`omit_defaults`): a push carries only what it sets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paratrain.transport.message import Message


class Slices:
    """What the dense requests share: parallel lists of slices."""

    __slots__ = ()
    keys: list
    starts: list[int]
    stops: list[int]

    def ident(self, i: int) -> tuple[Any, int, int]:
        """(key, start, stop) of slice i."""
        return self.keys[i], self.starts[i], self.stops[i]


# -- configuration (worker 0, before any init) ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Configure(Message, op="configure"):
    mode: str
    """The consistency policy's name (consistency.py's registry)."""
    members: list[int]
    params: dict | None = None
    """The policy's own fields (Bounded: {"staleness": s})."""
    average: bool = False
    replication: int = 1
    servers: list[list] | None = None
    """Every server's [host, port], with replication."""


@dataclass(frozen=True, slots=True)
class SetOptimizer(Message, op="set_optimizer"):
    path: str
    hyper: dict


@dataclass(frozen=True, slots=True)
class SetHyper(Message, op="set_hyper"):
    """New values of some hyperparameters of the optimizer of `keys` (a parameter group's keys: an
    LR schedule's step, or a group's own weight decay)."""

    keys: list
    hyper: dict


@dataclass(frozen=True, slots=True)
class ClipByNorm(Message, op="clip_by_norm"):
    """From worker 0, before any round: each sync round's mean waits on the servers, unapplied,
    for the scale that clips it by the global norm (`clip_scale`)."""


@dataclass(frozen=True, slots=True)
class NormShare(Message, op="norm_share"):
    """The squared L2 norm of round `clock`'s mean over this server's slices; answered once each
    of them has the round complete."""

    clock: int


@dataclass(frozen=True, slots=True)
class ClipScale(Message, op="clip_scale"):
    """Round `clock`'s mean is multiplied by `scale` (min(1, c / (norm + 1e-6))), then applied."""

    clock: int
    scale: float


@dataclass(frozen=True, slots=True)
class CheckOverflow(Message, op="check_overflow"):
    """From worker 0, before any round: each sync round waits on the servers, unapplied, until
    every worker's overflow check of it has arrived (`overflow`; server/overflow.py)."""


@dataclass(frozen=True, slots=True)
class Overflow(Message, op="overflow"):
    """Whether worker `rank`'s pushes of round `clock` held inf or NaN (fp16); answered
    {overflowed} once every worker's flag is in: the round is dropped everywhere if any is set."""

    clock: int
    rank: int
    found: bool


@dataclass(frozen=True, slots=True)
class Join(Message, op="join"):
    rank: int


@dataclass(frozen=True, slots=True)
class Leave(Message, op="leave"):
    rank: int


# -- dense keys ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Init(Slices, Message, op="init", omit_defaults=True):
    keys: list
    starts: list[int]
    stops: list[int]
    rank: int = -1
    shapes: list[list[int]]
    dtypes: list[str]
    numels: list[int]
    chain: list[int] | None = None
    """With replication: the servers holding these slices, primary first."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Push(Slices, Message, op="push", omit_defaults=True):
    keys: list
    starts: list[int]
    stops: list[int]
    rank: int
    clocks: list[int]
    min_versions: list[int] | None = None
    more: bool = False
    """More frames of this push follow (server/outbox.py)."""
    weight: int = 1
    """How many workers' gradients each slice sums (a host's leader pushes its host's sum)."""
    compression: dict | None = None
    added: list[bool] | None = None
    """Per slice: the worker added it into the round's shared buffer itself (no payload)."""
    pull_compression: dict | None = None
    read: list[bool] | None = None
    dead: list[int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PushPull(Push, op="pushpull"):
    """A push and a pull of the same slices in one frame: the versions the pull waits for are
    required (`read`: per slice, the worker copies it out of shared memory itself, and the reply
    carries none)."""

    min_versions: list[int]


@dataclass(frozen=True, slots=True, kw_only=True)
class Pull(Slices, Message, op="pull", omit_defaults=True):
    keys: list
    starts: list[int]
    stops: list[int]
    rank: int = -1
    min_versions: list[int]
    pull_compression: dict | None = None
    read: list[bool] | None = None
    dead: list[int] | None = None


@dataclass(frozen=True, slots=True)
class Waiting(Slices, Message, op="waiting"):
    """From a worker whose call waits long: what holds each slice back."""

    keys: list
    starts: list[int]
    stops: list[int]
    min_versions: list[int]
    rank: int


@dataclass(frozen=True, slots=True)
class GetState(Message, op="get_state"):
    pass


@dataclass(frozen=True, slots=True)
class SetState(Message, op="set_state"):
    shards: list[dict]
    """Per shard: {key, start, stop, state: [names]}; the payload: its value, then its state."""


@dataclass(frozen=True, slots=True)
class Ping(Message, op="ping"):
    """Echoed back whole, tensors included (the transport benchmarks)."""

    data: Any = None


@dataclass(frozen=True, slots=True)
class Stats(Message, op="stats"):
    pass


# -- replication (server to server) ----------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Replicate(Message, op="replicate"):
    """A slice's state from its primary to a backup (server/replica.py), or several lent ones
    (`slices`: each a Replicate's map without `sender`, server/mirror.py)."""

    key: Any = None
    start: int | None = None
    stop: int | None = None
    version: int | None = None
    applied: Any = None
    """[[worker, below, [clocks ahead]], ...]: the async pushes applied (rules.Clocks)."""
    state: list[str] | None = None
    """The optimizer state tensors' names, in the payload after the value."""
    sender: int | None = None
    lent: list | None = None
    """The value is this buffer of the primary's memory (server/mirror.py, Borrowed.value)."""
    buffer: int | None = None
    """The value is in this set of the backup's own buffers (server/mirror.py)."""
    mirrored: list[str] | None = None
    """The state tensors in that set too, not in the payload."""
    slices: list[dict] | None = None


@dataclass(frozen=True, slots=True)
class Mirror(Message, op="mirror"):
    key: Any
    start: int
    stop: int
    count: int | None = None


@dataclass(frozen=True, slots=True)
class Borrow(Message, op="borrow"):
    arena: Any


@dataclass(frozen=True, slots=True)
class Rejoin(Message, op="rejoin"):
    rank: int
    address: list
    dead: list[int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Install(Message, op="install"):
    """A slice's whole state, to a restarted server (made there if new): what `replicate` carries,
    and where the slice lies."""

    key: Any
    start: int
    stop: int
    version: int
    applied: Any = None
    state: list[str] | None = None
    numel: int
    shape: list[int]
    dtype: str
    chain: list[int]
    optimizer: list | None = None
    """[path, hyperparameters] of the servers' optimizer, with the slice's own; [] for none."""


# -- sparse tables ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SparseInit(Message, op="sparse_init"):
    key: Any
    dim: int
    config: dict
    chains: list[list[int]] | None = None


@dataclass(frozen=True, slots=True)
class SparsePull(Message, op="sparse_pull"):
    key: Any
    clock: int
    min_version: int
    train: bool
    rank: int | None = None
    primary: int | None = None
    dead: list[int] | None = None


@dataclass(frozen=True, slots=True)
class SparsePush(Message, op="sparse_push"):
    key: Any
    clock: int
    rank: int
    primary: int | None = None
    dead: list[int] | None = None


@dataclass(frozen=True, slots=True)
class SparseOptimizer(Message, op="sparse_optimizer"):
    key: Any
    path: str
    hyper: dict
    primary: int | None = None


@dataclass(frozen=True, slots=True)
class SparseStats(Message, op="sparse_stats"):
    key: Any
    primary: int | None = None


@dataclass(frozen=True, slots=True)
class SparseGetState(Message, op="sparse_get_state"):
    key: Any = None
    full: bool = True
    primary: int | None = None


@dataclass(frozen=True, slots=True)
class SparseSetState(Message, op="sparse_set_state"):
    key: Any
    names: list[str]
    primary: int | None = None


@dataclass(frozen=True, slots=True)
class SparseWaiting(Message, op="sparse_waiting"):
    key: Any
    min_version: int
    rank: int | None = None
    primary: int | None = None


@dataclass(frozen=True, slots=True)
class SparseReplicate(Message, op="sparse_replicate"):
    key: Any
    primary: int
    version: int | None = None


@dataclass(frozen=True, slots=True)
class SparseInstall(Message, op="sparse_install"):
    key: Any
    dim: int
    config: dict
    chain: list[int]
    optimizer: list | None = None
    own_optimizer: bool = False
