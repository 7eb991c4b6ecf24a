"""The scheduler: registration and ranks, the address book, barriers, heartbeats, job end.

Protocol (each message a typed value in protocol.py, routed by one table, `Routes`; requests
carry an id and get a reply; heartbeats are one-way):

    register  {role, rank?, host, port, pid, version, config}  -> replied once every node has
              registered (but servers lost meanwhile): {rank, servers: [[host, port]...],
              workers: [[host, pid]...], membership: {generation, workers, joiners}, joined,
              lost: the servers lost (one that never registered is ["", 0] in servers)}
    heartbeat {report?}                                        (one-way, every interval; the
              report, this process's figures, goes to the observer: the dashboard's board; a
              worker's also to the straggler detector, stragglers.py)
    stacks_wanted {why}                                        (one-way) a wait passed its warning
              time: every node hears `dump_stacks {why}`, writes its threads' stacks to its log and
              answers `stack_report {frames, why}`, which is logged (stacks.py)
    clock     {}                                               -> {time}: the scheduler's clock,
              which traces are aligned on
    peer_lost {role, rank, error}                              (one-way) this node lost its
              connection to that one: the job is aborted naming that one
    exited    {role, rank, reason}                             -> {}: from the launcher, a process
              died and the job goes on (a replicated server not restarted); one that never
              registered is lost now: the job starts without it, or ends at once naming it
    barrier   {group: "workers" | "all", name, data?}          -> replied when the group arrived,
              with every worker's data: {data: [[rank, data], ...]} (a small all-gather)
    finish    {}                                               a worker is done; replied at once
    roster    {}                                               from a read-only client that is no
              node (a serving process): {servers, workers} once the job started; no membership

    members   {}                                               -> {generation, workers, joiners}
    caught_up {}                                               a restarted server that registered
              into its lost rank (replication; the reply to its register has `joined` and `lost`,
              the other servers lost) holds its copies again: it counts again, and every node
              hears `server_back {rank, host, port}` (kvstore/server/rejoin.py)

and, from the scheduler, one-way notices: `abort {reason}` (some node failed: stop now),
`shutdown {}` (every worker finished: servers exit cleanly) and, in an elastic job,
`members {generation, workers, joiners}` to every node each time the membership changes. With
elasticity or replication the job goes on without a node it lost, which may still be alive behind a
partition; then: `dropped {role, rank, reason}` to that node, at once and again at each heartbeat
it sends later (it exits saying why: it must not rejoin as itself), and `server_lost {rank,
reason}` to every other node when a server is lost (workers fail over from it without waiting for
its connection to break, servers stop copying to it and refuse its copies: fencing, see
kvstore/server/fence.py).

Membership (the live workers, and elastic jobs' generations and joiners) is membership.py's; the
barriers are barriers.py's. Without elasticity (JobConfig.elastic None) a node that disconnects
before finishing, or that sends no heartbeat for `heartbeat_timeout_s`, aborts the job with a
message naming it; with it, a worker that dies after the start is dropped instead (membership.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

from paratrain.cluster import protocol as p
from paratrain.cluster import stacks
from paratrain.cluster.barriers import Barriers, Released
from paratrain.cluster.config import JobConfig
from paratrain.cluster.membership import Members, Node
from paratrain.cluster.spec import EXIT_ABORTED, ClusterSpec
from paratrain.cluster.stragglers import StragglerDetector, StragglerEvent
from paratrain.errors import RegistrationError
from paratrain.transport.connection import Connection
from paratrain.transport.message import Message, Routes
from paratrain.transport.rpc import Handler, Request, RpcServer, listen

logger = logging.getLogger(__name__)


class Observer(Protocol):
    """What the scheduler tells a watcher of the job (the dashboard's board, passed in by node.py)."""

    def record(self, role: str, rank: int, report: dict[str, Any]) -> None: ...


STACKS_EVERY_S = 10.0
"""The least time between two requests for every process's stacks (each waiting worker asks)."""
STRAGGLERS_FILE = "stragglers.jsonl"
"""In the job's log folder: one JSON line per straggler event (cluster/stragglers.py)."""


class Scheduler(Handler):
    def __init__(
        self,
        spec: ClusterSpec,
        config: JobConfig,
        observer: Observer | None = None,
        log_dir: str | None = None,
    ) -> None:
        """`log_dir`: the job's log folder (PARATRAIN_LOG_DIR), where straggler events are kept."""
        self.spec = spec
        self.config = config
        self.observer = observer
        self.started_wall = time.time()
        self.failures: list[dict[str, Any]] = []
        """{role, rank, reason, time} of the node that failed the job (the dashboard shows it)."""
        self._lock = threading.Lock()
        self.members = Members(spec, config)
        self._waiting: list[tuple[Request, Node]] = []
        self._routes = Routes(
            {
                p.Heartbeat: self._heartbeat,
                p.Clock: lambda request, _: request.reply(p.Time(time.time()).to_meta()),
                p.Register: self._register,
                p.Barrier: self._barrier,
                p.Finish: self._finish,
                p.PeerLost: self._peer_lost,
                p.Exited: self._exited,
                p.RosterQuery: self._roster_query,
                p.MembersQuery: self._members,
                p.CaughtUp: self._caught_up,
                p.StacksWanted: self._stacks_wanted,
                p.StackReport: self._stack_report,
            }
        )
        self._started = False
        self._barriers = Barriers()
        self._done = threading.Event()
        self._refused: deque[tuple[str, str]] = deque(maxlen=16)
        """(address, reason) of the last refused registrations."""
        self.outcome: str | None = None  # None while running; "" on success, else the reason
        self.lost_servers: set[int] = set()
        """Servers that died while their backups held copies (JobConfig.replication): the job goes on."""
        self.elastic = config.elastic
        self._joining: list[tuple[Request, p.Register]] = []
        """Registrations into the running job that wait for their rank to be freed."""
        self._fenced: dict[Connection, p.Dropped] = {}
        """Connections of nodes the job went on without: the `dropped` notice each one gets."""
        self._stragglers = StragglerDetector(config.stragglers)
        self.straggler_events: deque[dict[str, Any]] = deque(maxlen=100)
        """The latest straggler events, with their time (the dashboard shows them)."""
        self._stragglers_path = os.path.join(log_dir, STRAGGLERS_FILE) if log_dir else None
        self._stacks_asked = -STACKS_EVERY_S
        self._stacks_awaited: frozenset[int] = frozenset()
        """The workers the last wait that asked for stacks was for (their reports are marked)."""
        sock = listen_socket(spec)
        self.server = RpcServer(spec.secret, self, sock=sock, config=config.transport, name="scheduler")

    # -- lifecycle -------------------------------------------------------------------------------
    def run(self) -> int:
        """Serve until the job ends; returns the process exit status (0: every worker finished)."""
        self.server.start()
        logger.info("scheduler listening on %s:%d", self.server.host, self.server.port)
        monitor = threading.Thread(target=self._monitor, name="scheduler-monitor", daemon=True)
        monitor.start()
        self._done.wait()
        self._wait_for_servers()
        self.server.close()
        if self.outcome:
            # The node that failed is the cause the launcher should name; where it did not exit
            # (a frozen node), every node's stderr carries this reason.
            try:
                print(f"paratrain: job aborted: {self.outcome}", file=sys.stderr, flush=True)
            except OSError:
                pass  # stderr is a pipe to a launcher that is gone: the exit status still says it
            return EXIT_ABORTED
        return 0

    def _wait_for_servers(self) -> None:
        if self.outcome:
            return
        deadline = time.monotonic() + self.config.finish_timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                servers = [n for n in self.members.by_conn.values() if n.role == "server"]
                if all(n.conn in self._fenced for n in servers):
                    return
            time.sleep(0.02)
        logger.warning("servers still connected %.0f s after the job ended", self.config.finish_timeout_s)

    def abort(self, reason: str, culprit: Node | None = None) -> None:
        with self._lock:
            if self.outcome is not None:
                return
            self.outcome = reason
            if culprit is not None:
                culprit.failed = True
                self.failures.append(
                    {"role": culprit.role, "rank": culprit.rank, "reason": reason, "time": time.time()}
                )
            conns = list(self.members.by_conn)
            waiting = [r for r, _ in self._waiting]
            waiting += self._barriers.waiting()
        logger.error("aborting the job: %s", reason)
        # The notice goes first: a node's reader sees it before the failed reply to its barrier,
        # so the node exits with EXIT_ABORTED (a consequence) rather than raising (a cause).
        for conn in conns:
            _notify(conn, p.Abort(reason))
        for request in waiting:
            _quietly(request.fail, f"job aborted: {reason}")
        self._done.set()

    def _finish_job(self) -> None:
        with self._lock:
            if self.outcome is not None:
                return
            self.outcome = ""
            servers = [n.conn for n in self.members.by_conn.values() if n.role == "server"]
        logger.info("every worker finished; stopping %d server(s)", len(servers))
        for conn in servers:
            _notify(conn, p.Shutdown())
        self._done.set()

    def _monitor(self) -> None:
        start = time.monotonic()
        tick = min(0.5, self.config.heartbeat_interval_s / 2)
        launcher = self.spec.launcher_pid
        while not self._done.wait(tick):
            if launcher is not None and os.getppid() != launcher:
                self.abort(f"the launcher (pid {launcher}) is gone")
                continue
            now = time.monotonic()
            with self._lock:
                late = [
                    n
                    for n in self.members.nodes.values()
                    if not n.finished and now - n.last_seen > self.config.heartbeat_timeout_s
                ]
                missing = self.members.missing(self.lost_servers) if not self._started else []
            late = [
                n for n in late if not self._survivable(n, f"sent no heartbeat for {now - n.last_seen:.1f} s")
            ]
            if late:
                node = late[0]
                heard = datetime.fromtimestamp(node.last_seen_wall).strftime("%H:%M:%S.%f")[:-3]
                self._failed(
                    node,
                    f"{node.describe()} sent no heartbeat for {now - node.last_seen:.1f} s "
                    f"(last heard at {heard}; timeout {self.config.heartbeat_timeout_s} s)",
                )
            elif missing and now - start > self.config.start_timeout_s:
                self.abort(
                    f"{', '.join(missing)} did not register within {self.config.start_timeout_s} s"
                    f"{self._refusals()}"
                )

    def _refusals(self) -> str:
        """What was refused meanwhile: connections without the secret, refused registrations."""
        refused = self.server.refused() + list(self._refused)
        if not refused:
            return "; no connection was refused meanwhile"
        shown = "; ".join(f"{peer} ({reason})" for peer, reason in refused[-8:])
        more = f" (the last 8 of {len(refused)})" if len(refused) > 8 else ""
        return f"; refused meanwhile{more}: {shown}"

    # -- requests --------------------------------------------------------------------------------
    def handle(self, request: Request) -> None:
        self._routes.serve(request)

    def _members(self, request: Request, _: p.MembersQuery) -> None:
        with self._lock:
            request.reply(self.members.snapshot().to_meta())

    def _heartbeat(self, request: Request, beat: p.Heartbeat) -> None:
        node = self.members.by_conn.get(request.conn)
        fenced = self._fenced.get(request.conn)
        if fenced is not None:  # it is back from a partition: say again that it was dropped
            _notify(request.conn, fenced)
        elif node is not None:
            node.last_seen, node.last_seen_wall = time.monotonic(), time.time()
            if beat.report is not None and self.observer is not None:
                self.observer.record(node.role, node.rank, beat.report)
            if beat.report is not None and node.role == "worker":
                with self._lock:
                    event = self._stragglers.observe(node.rank, node.host, beat.report)
                if event is not None:
                    self._straggler(event)

    def _straggler(self, event: StragglerEvent) -> None:
        """Say it on the launcher's output, keep it for the dashboard, add it to the job's file."""
        logger.warning("%s", event.describe())
        record = {"time": time.time(), **event.as_dict()}
        with self._lock:
            self.straggler_events.append(record)
        if self._stragglers_path is None:
            return
        try:
            with open(self._stragglers_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as exc:
            logger.warning("could not write %s: %s", self._stragglers_path, exc)

    # -- a stuck job's stacks (cluster/stacks.py) ---------------------------------------------------
    def _stacks_wanted(self, request: Request, wanted: p.StacksWanted) -> None:
        """A wait passed its warning time: every process writes its stacks to its log and tells
        where its main thread is (`_stack_report`)."""
        asker = self.members.by_conn.get(request.conn)
        with self._lock:
            now = time.monotonic()
            if now - self._stacks_asked < STACKS_EVERY_S:
                return
            self._stacks_asked = now
            conns = list(self.members.by_conn)
            self._stacks_awaited = frozenset(wanted.awaited)
        who = asker.describe() if asker is not None else "a node"
        awaited = ", ".join(map(str, sorted(wanted.awaited)))
        for_whom = f" (it waits for worker(s) {awaited})" if awaited else ""
        logger.warning("%s asks every process for its stacks%s: %s", who, for_whom, wanted.why)
        for conn in conns:
            _notify(conn, p.DumpStacks(wanted.why))
        stacks.dump(wanted.why)

    def _stack_report(self, request: Request, report: p.StackReport) -> None:
        node = self.members.by_conn.get(request.conn)
        if node is None:
            return
        where = " <- ".join(report.frames) or "not in the user's code"
        awaited = node.role == "worker" and node.rank in self._stacks_awaited
        mark = " (the worker the others wait for)" if awaited else ""
        logger.warning("%s%s: main thread at %s", node.describe(), mark, where)

    # -- what the dashboard reads -------------------------------------------------------------------
    def roles(self) -> list[dict[str, Any]]:
        """Every registered process: role, rank, host, pid, state, last heartbeat, uptime."""
        now = time.time()
        with self._lock:
            nodes = sorted(self.members.nodes.values(), key=lambda n: (n.role != "server", n.role, n.rank))
            nodes += list(self.members.lost)
            started = self._started
        return [
            {
                "role": n.role,
                "rank": n.rank,
                "host": n.host,
                "pid": n.pid,
                "state": n.state(started),
                "last_heartbeat": n.last_seen_wall,
                "heartbeat_age_s": now - n.last_seen_wall,
                "uptime_s": now - n.joined_wall,
            }
            for n in nodes
        ]

    def job(self) -> dict[str, Any]:
        """The job's state (starting, running, finished, failed), size, uptime and failures."""
        outcome = self.outcome
        state = "starting" if not self._started else "running"
        if outcome is not None:
            state = "failed" if outcome else "finished"
        with self._lock:
            slow = self._stragglers.slow()
            ratios = self._stragglers.ratios()
            events = list(self.straggler_events)
        return {
            "state": state,
            "outcome": outcome,
            "stragglers": [{"rank": rank, "ratio": ratio} for rank, ratio in sorted(slow.items())],
            "slowdown": [[rank, ratio] for rank, ratio in sorted(ratios.items())],
            "straggler_events": events,
            "failures": list(self.failures)
            or ([{"role": "job", "rank": "", "reason": outcome}] if outcome else []),
            "workers": self.spec.num_workers,
            "servers": self.spec.num_servers,
            "scheduler": self.spec.scheduler_address,
            "uptime_s": time.time() - self.started_wall,
        }

    def _register(self, request: Request, register: p.Register) -> None:
        if self._started and self.elastic is not None and register.role == "worker":
            self._join(request, register)
            return
        if self._started and register.role == "server":
            self._rejoin(request, register)
            return
        try:
            with self._lock:
                node = self.members.admit(request.conn, register)
                self._waiting.append((request, node))
        except RegistrationError as exc:
            self._refuse(request, exc)
            return
        logger.info("registered %s", node.describe())
        self._start_if_ready()

    def _start_if_ready(self) -> None:
        """Once every node registered (but servers lost meanwhile), each gets its reply: the job starts."""
        with self._lock:
            if self._started or self.outcome is not None or self.members.missing(self.lost_servers):
                return
            self._started = True
            waiting, self._waiting = self._waiting, []
            roster, membership = self.members.roster(), self.members.snapshot()
            lost = tuple(sorted(self.lost_servers))
        for waiter, member in waiting:
            reply = p.Registered(member.rank, roster.servers, roster.workers, membership, lost=lost)
            _quietly(waiter.reply, reply.to_meta())

    # -- elastic membership ------------------------------------------------------------------------
    def _notify(self, membership: p.Membership) -> None:
        """Tell every node the new membership (elastic jobs only)."""
        with self._lock:
            conns = list(self.members.by_conn)
        logger.info("membership generation %d: workers %s", membership.generation, list(membership.workers))
        for conn in conns:
            _notify(conn, membership)

    def _failed(self, node: Node, reason: str) -> None:
        """A node died: an elastic job drops a worker that died after the start; else abort."""
        if self.elastic is not None and node.role == "worker" and self._started and not node.finished:
            self._drop(node, reason)
        else:
            self.abort(reason, node)

    def _drop(self, node: Node, reason: str) -> None:
        """Take a dead worker out of the membership: free its rank, take back what it brought to
        barriers, release the barriers it held up, admit a joiner waiting for a rank."""
        assert self.elastic is not None
        with self._lock:
            if self.outcome is not None or self.members.nodes.get(("worker", node.rank)) is not node:
                return
            self.members.drop(node)
            self._barriers.forget(node)
            self._stragglers.forget(node.rank)
            left = len(self.members.live_workers())
            below = left < self.elastic.min_workers
            if not below:
                self.members.generation += 1
                released = self._complete_barriers()
                membership = self.members.snapshot()
                done = self._all_finished()
        if below:
            self.abort(
                f"{reason}; {left} worker(s) left, fewer than min_workers={self.elastic.min_workers}", node
            )
            return
        logger.warning("dropped %s from the membership: %s", node.describe(), reason)
        # A worker declared dead that is still there (frozen, cut off) must not come back as itself.
        self._fence(node, reason)
        self._release(released)
        self._notify(membership)
        self._admit_joiners()
        if done:
            self._finish_job()

    def _all_finished(self) -> bool:
        """Every worker finished (and the job started); called with the lock held."""
        return self._started and self.members.all_finished()

    def _join(self, request: Request, register: p.Register) -> None:
        """A worker registering into the running elastic job: a rank now, or once one is freed."""
        try:
            with self._lock:
                self.members.check(register)
                self._joining.append((request, register))
        except RegistrationError as exc:
            self._refuse(request, exc)
            return
        self._admit_joiners()

    def _admit_joiners(self) -> None:
        """Give each waiting joiner whose rank is free its rank and the roster."""
        admitted, refused = [], []
        with self._lock:
            if self.outcome is not None:
                return
            for entry in list(self._joining):
                request, register = entry
                try:
                    rank = self.members.free_rank(register.rank)
                except RegistrationError as exc:
                    self._joining.remove(entry)
                    refused.append((request, f"{register.describe()}: {exc}"))
                    continue
                if rank is None:
                    continue
                self._joining.remove(entry)
                admitted.append((request, self.members.add(request.conn, register, rank, joiner=True)))
                self.members.generation += 1
            membership = self.members.snapshot()
        for request, why in refused:
            _quietly(request.fail, why)
        if not admitted:
            return
        roster = self._roster()
        for request, node in admitted:
            logger.warning("%s joined the running job", node.describe())
            reply = p.Registered(node.rank, roster.servers, roster.workers, membership, joined=True)
            _quietly(request.reply, reply.to_meta())
        self._notify(membership)

    def _roster(self) -> p.Roster:
        with self._lock:
            return self.members.roster()

    def _roster_query(self, request: Request, _: p.RosterQuery) -> None:
        """Where the servers are, for a client that reads from them without joining the job: it
        takes no rank, is in no barrier or round, and its disconnecting ends nothing."""
        if not self._started:
            request.fail("the job has not started: not every node has registered yet")
            return
        request.reply(self._roster().to_meta())

    def _barrier(self, request: Request, barrier: p.Barrier) -> None:
        group, name = barrier.group, barrier.name
        if group not in ("workers", "all"):
            request.fail(f"barrier group {group!r} is not 'workers' or 'all'")
            return
        node = self.members.by_conn.get(request.conn)
        if node is None:
            request.fail("barrier from a node that did not register")
            return
        with self._lock:
            self._barriers.arrive((group, name), request, node, barrier.data)
            released = self._complete_barriers()
        self._release(released)

    def _complete_barriers(self) -> list[Released]:
        """Barriers that every live worker has reached; called with the lock held."""
        return self._barriers.complete(len(self.members.live_workers()))

    @staticmethod
    def _release(released: list[Released]) -> None:
        Barriers.release(released, lambda waiter, data: _quietly(waiter.reply, p.Gathered(data).to_meta()))

    def _finish(self, request: Request, _: p.Finish) -> None:
        node = self.members.by_conn.get(request.conn)
        if node is None:
            request.fail("finish from a node that did not register")
            return
        with self._lock:
            node.finished = True
            done = self._all_finished()
            released = self._complete_barriers()
            if self.elastic is not None:
                self.members.generation += 1
                membership = self.members.snapshot()
        self._release(released)
        request.reply({})
        if self.elastic is not None and not done:
            self._notify(membership)
        logger.info("%s finished", node.describe())
        if done:
            self._finish_job()

    def _peer_lost(self, request: Request, notice: p.PeerLost) -> None:
        """A node lost its connection to another (a worker to a server): the other is the cause
        of what follows, whichever disconnect reaches the scheduler first."""
        reporter = self.members.by_conn.get(request.conn)
        lost = self.members.nodes.get((notice.role, notice.rank))
        if reporter is None or lost is None or self.outcome is not None:
            return
        if self._survivable(lost, f"is unreachable from {reporter.describe()}"):
            return
        self._failed(
            lost,
            f"{lost.describe()} is unreachable: {reporter.describe()} lost its connection to it "
            f"({notice.error})",
        )

    def _exited(self, request: Request, exited: p.Exited) -> None:
        """The launcher saw a process die and goes on (a replicated server it does not restart).
        One that registered is handled by its closed connection; one that never did is lost now:
        the job starts without it where its copies allow (every node is told), else ends now
        naming it, never after start_timeout_s."""
        request.reply({})
        with self._lock:
            known = (exited.role, exited.rank) in self.members.nodes or exited.rank in self.lost_servers
            if known or self._started or self.outcome is not None or exited.role != "server":
                return
            what = f"server {exited.rank} {exited.reason} before it registered"
            if len(self.lost_servers) + 1 >= self.config.replication:
                survivable = False
            else:
                survivable = True
                self.lost_servers.add(exited.rank)
                self.failures.append(
                    {"role": "server", "rank": exited.rank, "reason": what, "time": time.time()}
                )
                others = list(self.members.by_conn)
        if not survivable:
            before = (
                f", and servers {sorted(self.lost_servers)} were lost before" if self.lost_servers else ""
            )
            self.abort(
                f"{what}; the job cannot go on without it (replication={self.config.replication}{before})"
            )
            return
        logger.warning("%s; its backups serve its slices (replication %d)", what, self.config.replication)
        for conn in others:
            _notify(conn, p.ServerLost(exited.rank, what))
        self._start_if_ready()

    def disconnected(self, conn: Connection, error: Exception | None) -> None:
        with self._lock:
            node = self.members.by_conn.pop(conn, None)
            self._joining = [entry for entry in self._joining if entry[0].conn is not conn]
            self._fenced.pop(conn, None)
        if node is None or node.finished:
            return
        if self.outcome is not None:
            node.stopped = True
            return
        cause = f": {error}" if error else ""
        if self._survivable(node, f"lost its connection to the scheduler{cause}"):
            return
        self._failed(node, f"{node.describe()} lost its connection to the scheduler{cause}")

    def _refuse(self, request: Request, exc: RegistrationError) -> None:
        """Refuse that node, not the job: a stray process with the secret (a duplicate rank, a
        leftover of another run) must not end a healthy job. A refused member of this job fails on
        its own (its init raises), and the launcher, or the start timeout, ends it."""
        request.fail(str(exc))
        logger.warning("refused a registration from %s: %s", request.conn.peer, exc)
        self._refused.append((request.conn.peer, str(exc)))

    # -- replicated servers: a restarted one rejoins -------------------------------------------------
    def _rejoin(self, request: Request, register: p.Register) -> None:
        """A restarted server registers into the running job, with the rank of a lost server (the
        placement of slices is a function of the server count: a fresh rank would hold nothing). It
        gets the roster and the other lost servers at once and catches up from the live ones
        (kvstore/server/replica.py); it counts as a copy again only once it reports `caught_up`."""
        try:
            with self._lock:
                role, rank = self.members.check(register)
                if rank is None or rank not in self.lost_servers:
                    raise RegistrationError(
                        f"{register.describe()}: the job is running and server {rank!r} "
                        f"is not lost (lost: {sorted(self.lost_servers)}); only a lost server's rank can "
                        "rejoin"
                    )
                node = self.members.add(request.conn, register, rank)
                lost = sorted(self.lost_servers - {rank})
                membership = self.members.snapshot()
        except RegistrationError as exc:
            self._refuse(request, exc)
            return
        logger.warning("%s rejoins the running job; it catches up from the live servers", node.describe())
        roster = self._roster()
        reply = p.Registered(rank, roster.servers, roster.workers, membership, joined=True, lost=tuple(lost))
        _quietly(request.reply, reply.to_meta())

    def _caught_up(self, request: Request, _: p.CaughtUp) -> None:
        """A rejoined server holds every slice it backs up: it counts as a copy again, and every
        node hears where it listens now (`server_back {rank, host, port}`)."""
        node = self.members.by_conn.get(request.conn)
        if node is None or node.role != "server":
            request.fail("caught_up from a node that is not a registered server")
            return
        with self._lock:
            self.lost_servers.discard(node.rank)
            conns = list(self.members.by_conn)
        request.reply({})
        logger.warning("%s caught up: it holds copies again", node.describe())
        for conn in conns:
            _notify(conn, p.ServerBack(node.rank, node.host, node.port))

    def _survivable(self, node: Node, what: str) -> bool:
        """Whether the job goes on without `node`: a server, while fewer than JobConfig.replication
        servers are lost (every slice still has a copy; workers fail over to it)."""
        if node.role != "server" or self.config.replication < 2:
            return False
        with self._lock:
            if node.rank in self.lost_servers:
                return True
            if len(self.lost_servers) + 1 >= self.config.replication:
                return False
            self.lost_servers.add(node.rank)
            node.failed = True
            self.failures.append({"role": node.role, "rank": node.rank, "reason": what, "time": time.time()})
        logger.warning(
            "%s %s; its backups serve its slices (replication %d)",
            node.describe(),
            what,
            self.config.replication,
        )
        self._fence(node, f"{node.describe()} {what}")
        with self._lock:
            others = [conn for conn in self.members.by_conn if conn is not node.conn]
        for conn in others:
            _notify(conn, p.ServerLost(node.rank, what))
        return True

    def _fence(self, node: Node, reason: str) -> None:
        """The job goes on without `node`: tell it so (now, and at each heartbeat it sends later)."""
        notice = p.Dropped(node.role, node.rank, reason)
        with self._lock:
            self._fenced[node.conn] = notice
        _notify(node.conn, notice)


def listen_socket(spec: ClusterSpec):
    import socket

    if spec.scheduler_fd is not None:
        return socket.socket(fileno=spec.scheduler_fd)
    # Its own address, not the name others reach it by: that may be a DNS alias (a Kubernetes
    # Service) that no local interface carries.
    return listen(spec.host, spec.scheduler_port)


def _notify(conn: Connection, notice: Message) -> None:
    """A one-way notice to a node (id 0), quietly."""
    _quietly(conn.send, notice.op, 0, notice.to_meta())


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    """Send a notice to a peer that may already be gone: its absence is handled elsewhere."""
    try:
        fn(*args)
    except Exception as exc:
        logger.debug("could not notify a peer: %s", exc)
