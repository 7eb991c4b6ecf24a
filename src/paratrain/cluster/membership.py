"""Who is in the job: the scheduler's table of registered nodes and its live workers.

Membership is the live workers: registered, not finished, not dropped. Servers and the scheduler
are never dropped from it (a lost server is replication's business: scheduler.py).

Elastic membership (JobConfig.elastic = ElasticConfig(min_workers, max_workers)). Once the job has
started, a worker that dies (its connection closes, it sends no heartbeat for heartbeat_timeout_s,
or a peer reports it lost) is dropped instead of failing the job: its rank is freed, its barrier
entries are taken back (barriers.py), the barriers it held up complete, and the generation goes up.
Below min_workers the job is aborted naming the worker that died, as without elasticity. A worker
process that registers into a running job gets a rank (the rank it asks for, else the lowest free
one below max_workers; a rank still held by a worker not yet declared dead waits for it) and its
reply at once; it is a joiner: `joiners` lists the live workers that registered after the start
(servers let a joiner into rounds from its first push).

    generation  an int, 0 at the start, +1 at each change: a worker dropped, joined or finished
    workers     the live worker ranks, sorted
    joiners     the live workers that joined the running job (a subset of workers)

A process reads it with `SchedulerLink.members()` (a round trip) or `.membership` (the last notice),
waits for a change with `SchedulerLink.wait_members(generation, timeout_s)`, and is called back
with `SchedulerLink.on_members(callback)`; a worker's `Context.members()` is the same.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from paratrain import version
from paratrain.cluster.config import JobConfig, config_differences
from paratrain.cluster.protocol import Membership, Register, Roster
from paratrain.cluster.spec import ClusterSpec
from paratrain.errors import RegistrationError
from paratrain.transport.connection import Connection


@dataclass
class Node:
    role: str
    rank: int
    host: str
    port: int
    pid: int
    conn: Connection
    last_seen: float = field(default_factory=time.monotonic)
    last_seen_wall: float = field(default_factory=time.time)
    finished: bool = False
    failed: bool = False
    stopped: bool = False
    """It left after the job was aborted (a consequence, not a cause)."""
    joined_wall: float = field(default_factory=time.time)
    joiner: bool = False
    """It registered into the running job (elastic)."""
    lost: bool = False
    """It died and was dropped from an elastic job's membership."""

    def describe(self) -> str:
        return f"{self.role} {self.rank} (host {self.host}, pid {self.pid})"

    def state(self, job_started: bool) -> str:
        if self.failed:
            return "failed"
        if self.lost:
            return "lost"
        if self.finished:
            return "finished"
        if self.stopped:
            return "stopped"
        return "running" if job_started else "waiting"


class Members:
    """The registered nodes by (role, rank) and by connection, and the workers dropped from the job.

    Not thread-safe: the scheduler calls every method with its lock held.
    """

    def __init__(self, spec: ClusterSpec, config: JobConfig) -> None:
        self.spec = spec
        self.config = config
        self.max_workers = spec.num_workers
        if config.elastic is not None and config.elastic.max_workers is not None:
            self.max_workers = max(spec.num_workers, config.elastic.max_workers)
        self.nodes: dict[tuple[str, int], Node] = {}
        self.by_conn: dict[Connection, Node] = {}
        self.lost: list[Node] = []
        """Workers dropped from the membership (the dashboard still lists them)."""
        self.generation = 0
        """+1 at each change (elastic jobs notify every node of it)."""

    def check(self, register: Register) -> tuple[str, int | None]:
        """(role, requested rank) of a registration whose version and JobConfig match the job's."""
        who = register.describe()
        if register.version != version.__version__:
            raise RegistrationError(
                f"{who} runs paratrain {register.version!r} but the scheduler runs {version.__version__!r}"
            )
        if register.config_digest != self.config.digest():
            diffs = config_differences(self.config.as_dict(), register.config or {})
            raise RegistrationError(f"{who} has a different JobConfig: {'; '.join(diffs) or 'digest only'}")
        if register.role not in ("server", "worker"):
            raise RegistrationError(f"{who}: role {register.role!r} cannot register")
        return register.role, register.rank

    def admit(self, conn: Connection, register: Register) -> Node:
        """A registration before the start: its rank (the one asked for, else the lowest free one)."""
        role, rank = self.check(register)
        count = self.spec.num_servers if role == "server" else self.max_workers
        if rank is None:
            taken = {r for (ro, r) in self.nodes if ro == role}
            rank = min((r for r in range(count) if r not in taken), default=count)
        if not 0 <= rank < count:
            raise RegistrationError(
                f"{register.describe()}: rank {rank!r} is outside 0..{count - 1} for {count} {role}s"
            )
        if (role, rank) in self.nodes:
            raise RegistrationError(f"{register.describe()}: {role} {rank} is already registered")
        return self.add(conn, register, rank)

    def add(self, conn: Connection, register: Register, rank: int, joiner: bool = False) -> Node:
        node = Node(register.role, rank, register.host, register.port, register.pid, conn)
        node.joiner = joiner
        old = self.nodes.get((register.role, rank))
        if old is not None:  # a rejoining server: a frozen one's connection, if open, is no longer it
            self.by_conn.pop(old.conn, None)
        self.nodes[register.role, rank] = node
        self.by_conn[conn] = node
        return node

    def drop(self, node: Node) -> None:
        """Take a dead worker out: its rank is free, the dashboard still lists it as lost."""
        del self.nodes["worker", node.rank]
        self.by_conn.pop(node.conn, None)
        node.lost = True
        self.lost.append(node)

    def missing(self, lost: set[int] | frozenset[int] = frozenset()) -> list[str]:
        """The nodes the job starts with that have not registered yet, but for the `lost`
        servers: ["server 1", ...]."""
        wanted = [("server", r) for r in range(self.spec.num_servers) if r not in lost]
        wanted += [("worker", r) for r in range(self.spec.num_workers)]
        return [f"{role} {rank}" for role, rank in wanted if (role, rank) not in self.nodes]

    def live_workers(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.role == "worker" and not n.finished]

    def all_finished(self) -> bool:
        return all(n.finished for n in self.nodes.values() if n.role == "worker")

    def snapshot(self) -> Membership:
        """The membership now: see the module docstring."""
        live = self.live_workers()
        workers = tuple(sorted(n.rank for n in live))
        return Membership(self.generation, workers, tuple(sorted(n.rank for n in live if n.joiner)))

    def free_rank(self, wanted: int | None) -> int | None:
        """The rank a joiner gets: `wanted` or the lowest free one below max_workers; None while
        none is free. Raises RegistrationError for a rank that can never be."""
        live = {r for (role, r) in self.nodes if role == "worker"}
        if wanted is None:
            return min((r for r in range(self.max_workers) if r not in live), default=None)
        if not 0 <= wanted < self.max_workers:
            raise RegistrationError(f"rank {wanted!r} is outside 0..{self.max_workers - 1} (max_workers)")
        return None if wanted in live else wanted

    def roster(self) -> Roster:
        """Where the servers listen and which pid each worker is, in rank order."""
        nodes = sorted(self.nodes.values(), key=lambda n: (n.role, n.rank))
        servers = {n.rank: [n.host, n.port] for n in nodes if n.role == "server"}
        return Roster(  # a server lost before it registered: nowhere (replication)
            servers=[servers.get(rank, ["", 0]) for rank in range(self.spec.num_servers)],
            workers=[[n.host, n.pid] for n in nodes if n.role == "worker"],
        )
