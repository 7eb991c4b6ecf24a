"""The scheduler's messages, one typed value each (transport/message.py): what nodes ask the
scheduler (scheduler.py's `Routes`), what it answers, and the notices it sends them (agent.py's).

Requests carry an id and get a reply; heartbeats and `peer_lost` are one-way. What each one means
is told where it is handled (scheduler.py's module docstring); here is only its form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paratrain.transport.message import Message

# -- requests to the scheduler -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Register(Message, op="register"):
    """A node joins the job (or a running one); replied with `Registered` once the job starts."""

    role: str
    host: str
    pid: int
    version: str
    config_digest: str
    rank: int | None = None
    """The rank it asks for; None: the lowest free one."""
    port: int = 0
    """Where it listens (servers)."""
    config: dict | None = None
    """Its JobConfig, flattened: the scheduler names the fields that differ from its own."""

    def describe(self) -> str:
        """`worker 2 (host h, pid 123)`, before it has a node."""
        return f"{self.role} {'?' if self.rank is None else self.rank} (host {self.host}, pid {self.pid})"


@dataclass(frozen=True, slots=True)
class Heartbeat(Message, op="heartbeat"):
    report: dict | None = None
    """This process's figures, for the dashboard's board."""


@dataclass(frozen=True, slots=True)
class Clock(Message, op="clock"):
    """Asks the scheduler's wall clock (replied with `Time`), which traces are aligned on."""


@dataclass(frozen=True, slots=True)
class PeerLost(Message, op="peer_lost"):
    """This node lost its connection to that one."""

    role: str
    rank: int
    error: str = "closed"


@dataclass(frozen=True, slots=True)
class Exited(Message, op="exited"):
    """From the launcher: a process of the job died and the job goes on (a replicated server it
    does not restart); one that never registered is then lost at once, not after the start
    timeout. Replied `{}`."""

    role: str
    rank: int
    reason: str


@dataclass(frozen=True, slots=True)
class StacksWanted(Message, op="stacks_wanted"):
    """A wait passed its warning time here: every process should write its stacks (cluster/stacks.py)."""

    why: str = ""
    awaited: list[int] = field(default_factory=list)
    """The workers the wait is for (those that have not pushed its round), where known."""


@dataclass(frozen=True, slots=True)
class StackReport(Message, op="stack_report"):
    """The answer to `DumpStacks`: the top frames of this process's main thread in the user's code."""

    frames: list[str]
    why: str = ""


@dataclass(frozen=True, slots=True)
class Barrier(Message, op="barrier"):
    """Wait for the group; replied with `Gathered` (every worker's `data`)."""

    group: str = "workers"
    name: str = ""
    data: Any = None


@dataclass(frozen=True, slots=True)
class Finish(Message, op="finish"):
    """A worker is done."""


@dataclass(frozen=True, slots=True)
class RosterQuery(Message, op="roster"):
    """From a client that is no node (a serving process): replied with `Roster`."""


@dataclass(frozen=True, slots=True)
class MembersQuery(Message, op="members"):
    """Replied with `Membership`."""


@dataclass(frozen=True, slots=True)
class CaughtUp(Message, op="caught_up"):
    """A restarted server holds its copies again."""


# -- replies -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Membership(Message, op="members"):
    """The job's live workers (membership.py): `generation` goes up by one at each change;
    `workers` are the live ranks, sorted; `joiners` those that joined the running job. Also the
    notice that the membership changed (elastic jobs)."""

    generation: int
    workers: tuple[int, ...]
    joiners: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Roster(Message, op="roster"):
    """Where the servers listen, [host, port] by rank, and each worker's [host, pid] by rank."""

    servers: list[list]
    workers: list[list]


@dataclass(frozen=True, slots=True)
class Registered(Message, op="registered"):
    """The reply to `Register`: this node's rank and where everyone is."""

    rank: int
    servers: list[list]
    workers: list[list]
    membership: Membership | None = None
    joined: bool = False
    """A worker registered into a running elastic job, or a server into a running replicated one."""
    lost: tuple[int, ...] = ()
    """The servers lost now: for a rejoining server the others; at the start those lost before it
    (one that never registered has ["", 0] in `servers`)."""


@dataclass(frozen=True, slots=True)
class Gathered(Message, op="gathered"):
    """The reply to `Barrier`: [[rank, data], ...] in rank order."""

    data: list[list]


@dataclass(frozen=True, slots=True)
class Time(Message, op="time"):
    """The reply to `Clock`: the scheduler's time.time()."""

    time: float


# -- notices from the scheduler ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Abort(Message, op="abort"):
    """Some node failed: stop now."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class Shutdown(Message, op="shutdown"):
    """Every worker finished: servers exit cleanly."""


@dataclass(frozen=True, slots=True)
class DumpStacks(Message, op="dump_stacks"):
    """Write every thread's stack to your log, and answer with a `StackReport`."""

    why: str = ""


@dataclass(frozen=True, slots=True)
class Dropped(Message, op="dropped"):
    """The job went on without this node (it must not rejoin as itself)."""

    role: str
    rank: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ServerLost(Message, op="server_lost"):
    """A server is lost and the job goes on without it (replication)."""

    rank: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ServerBack(Message, op="server_back"):
    """A restarted server caught up; it listens here now."""

    rank: int
    host: str
    port: int
