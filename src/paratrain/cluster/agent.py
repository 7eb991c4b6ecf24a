"""A node's link to the scheduler: registration, heartbeats, barriers, and reacting to job end.

When the scheduler aborts the job (another node failed) or the link to it breaks, this process cannot
usefully go on: it prints why and exits at once with EXIT_ABORTED, so nothing hangs waiting on a peer
that is gone. The same happens if the local launcher that started it disappears, and when the
scheduler says the job went on without this process (`dropped`: it was cut off by a partition, or
frozen, for longer than the heartbeat timeout): it exits naming its role and rank rather than
rejoin as itself (fencing; kvstore/server/fence.py is the servers' half).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paratrain import version
from paratrain.cluster import protocol as p
from paratrain.cluster import stacks
from paratrain.cluster.config import JobConfig
from paratrain.cluster.fencing import dropped_notice
from paratrain.cluster.spec import EXIT_ABORTED, ClusterSpec
from paratrain.errors import RemoteError, RendezvousError, TransportError
from paratrain.transport.client import RpcClient
from paratrain.transport.frame import Header
from paratrain.transport.message import Routes

logger = logging.getLogger(__name__)


Membership = p.Membership  # the name callers know (cluster/context.py)


@dataclass(frozen=True)
class Roster:
    """What registration tells every node: its rank and where everyone is."""

    rank: int
    servers: list[tuple[str, int]]
    workers: list[tuple[str, int]]
    """(host, pid) of each registered worker, by rank."""
    membership: Membership | None = None
    """The membership when this node registered (workers only)."""
    joined: bool = False
    """This worker registered into a running elastic job (a replacement or an extra worker), or
    this server into a running replicated job (a restarted one, which catches up first)."""
    lost: tuple[int, ...] = ()
    """The servers lost when this node registered (replication): for a rejoining server the other
    ones (their copies cannot send it anything); at the start, servers that died before it (some
    never registered: their place in `servers` is ("", 0))."""


class SchedulerLink:
    def __init__(
        self, spec: ClusterSpec, config: JobConfig, report: Callable[[], dict] | None = None
    ) -> None:
        """`report`: what each heartbeat carries (this process's figures for the dashboard)."""
        self.spec = spec
        self.config = config
        self.report = report
        self.shutdown = threading.Event()
        self._leaving = False
        self._stop = threading.Event()
        self._members_changed = threading.Condition()
        self._membership: Membership | None = None
        self._on_members: list[Callable[[Membership], None]] = []
        self._on_server_back: list[Callable[[int, str, int], None]] = []
        self._on_server_lost: list[Callable[[int, str], None]] = []
        self.lost_servers: dict[int, str] = {}
        """Servers the scheduler said are lost, with why, until they are back (replication)."""
        self._notices = Routes(
            {
                p.Abort: lambda notice: _exit_aborted(f"the scheduler aborted the job: {notice.reason}"),
                p.Membership: self._learn,
                p.ServerBack: self._server_back,
                p.Dropped: lambda notice: _exit_aborted(dropped_notice(notice)),
                p.ServerLost: self._server_lost,
                p.Shutdown: self._shutdown,
                p.DumpStacks: self._dump_stacks,
            }
        )
        self.client = RpcClient(
            spec.scheduler_host,
            spec.scheduler_port,
            spec.secret,
            config=config.transport,
            name=f"the scheduler ({spec.scheduler_address})",
            on_message=self._notice,
            on_close=self._closed,
            origin=f"{spec.role}{'' if spec.rank is None else f' {spec.rank}'} at {spec.host}",
            # The scheduler greets at once; a silent listener is another program on its port,
            # which waiting connect_timeout_s would not change (node.py says so in one line).
            silence_is_final=True,
        )
        self._heartbeats = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._heartbeats.start()

    def register(self, role: str, port: int = 0) -> Roster:
        register = p.Register(
            role=role,
            rank=self.spec.rank,
            host=self.spec.host,
            port=port,
            pid=os.getpid(),
            version=version.__version__,
            config=self.config.as_dict(),
            config_digest=self.config.digest(),
        )
        # Longer than the scheduler's own start timeout: its abort, which names who is missing and
        # what it refused meanwhile, arrives first.
        wait_s = self.config.start_timeout_s + self.config.heartbeat_timeout_s
        try:
            reply = self.client.call(*register.wire(), timeout_s=wait_s)
        except RemoteError as exc:
            raise RendezvousError(f"the scheduler refused {role} registration: {exc}") from None
        except TimeoutError:
            raise RendezvousError(
                f"the job did not start within {wait_s} s: "
                f"not every node registered with the scheduler at {self.spec.scheduler_address}"
            ) from None
        registered = p.Registered.from_meta(reply.meta)
        for rank in registered.lost:
            self.lost_servers.setdefault(rank, "lost before the job started")
        if registered.membership is not None:
            self._learn(registered.membership)
        return Roster(
            rank=registered.rank,
            servers=[(str(host), int(port)) for host, port in registered.servers],
            workers=[(str(host), int(pid)) for host, pid in registered.workers],
            membership=registered.membership,
            joined=registered.joined,
            lost=registered.lost,
        )

    # -- a stuck job's stacks (cluster/stacks.py) ---------------------------------------------------
    def ask_for_stacks(self, why: str, awaited: tuple[int, ...] = ()) -> None:
        """Ask the scheduler that every process of the job write its stacks; `awaited`: the
        workers this process's wait is for."""
        self.client.send(*p.StacksWanted(why, list(awaited)).wire())

    def _dump_stacks(self, notice: p.DumpStacks) -> None:
        stacks.dump(notice.why)
        try:
            self.client.send(*p.StackReport(stacks.user_frames(), notice.why).wire())
        except TransportError:
            pass  # the link is down: _closed reports it

    # -- replicated servers ----------------------------------------------------------------------
    def caught_up(self) -> None:
        """A rejoined server holds its copies again: the scheduler counts it and tells every node."""
        self.client.call(*p.CaughtUp().wire(), timeout_s=self.config.barrier_timeout_s)

    def on_server_back(self, callback: Callable[[int, str, int], None]) -> None:
        """Call `callback(rank, host, port)` when a restarted server has caught up (it listens at
        a new port), from the link's reader thread."""
        self._on_server_back.append(callback)

    # -- membership (elastic jobs) ---------------------------------------------------------------
    def members(self, timeout_s: float | None = None) -> Membership:
        """The scheduler's membership now (a round trip)."""
        timeout = self.config.barrier_timeout_s if timeout_s is None else timeout_s
        membership = Membership.from_meta(self.client.call(*p.MembersQuery().wire(), timeout_s=timeout).meta)
        self._learn(membership)
        return membership

    @property
    def membership(self) -> Membership | None:
        """The newest membership this process heard of (registration or a notice); no round trip."""
        return self._membership

    def wait_members(self, after: int, timeout_s: float) -> Membership:
        """Wait until the membership's generation is above `after`; TimeoutError after `timeout_s`."""
        with self._members_changed:
            if not self._members_changed.wait_for(
                lambda: self._membership is not None and self._membership.generation > after, timeout_s
            ):
                raise TimeoutError(
                    f"the job's membership did not change from generation {after} within {timeout_s} s"
                )
            assert self._membership is not None
            return self._membership

    def on_members(self, callback: Callable[[Membership], None]) -> None:
        """Call `callback(membership)` at each change the scheduler announces, in order, from the
        link's reader thread: it must be quick and must not call the scheduler."""
        self._on_members.append(callback)

    def on_server_lost(self, callback: Callable[[int, str], None]) -> None:
        """Call `callback(rank, reason)` when the scheduler lost a server and the job goes on
        without it (JobConfig.replication), from the link's reader thread: it must be quick."""
        self._on_server_lost.append(callback)

    def _learn(self, membership: Membership) -> None:
        with self._members_changed:
            if self._membership is not None and membership.generation <= self._membership.generation:
                return
            self._membership = membership
            self._members_changed.notify_all()
            for callback in self._on_members:  # under the lock: callbacks see changes in order
                try:
                    callback(membership)
                except Exception:
                    logger.exception("a membership callback failed")

    def barrier(
        self, group: str = "workers", name: str = "", timeout_s: float | None = None, data: Any = None
    ) -> dict[int, Any]:
        """Wait for the group; returns each worker's `data` (small, msgpack-able) by rank."""
        timeout = self.config.barrier_timeout_s if timeout_s is None else timeout_s
        reply = self.client.call(*p.Barrier(group, name, data).wire(), timeout_s=timeout)
        return {rank: value for rank, value in p.Gathered.from_meta(reply.meta).data}

    def finish(self) -> None:
        """Tell the scheduler this worker is done, then close the link."""
        self._leaving = True
        try:
            self.client.call(*p.Finish().wire(), timeout_s=self.config.finish_timeout_s)
        except (TransportError, RemoteError, TimeoutError) as exc:
            logger.warning("could not tell the scheduler we finished: %s", exc)
        self.close()

    def peer_lost(self, role: str, rank: int, error: Exception | None) -> None:
        """Tell the scheduler this node lost its connection to another, so that the job's end
        names that one (its disconnect may reach the scheduler after ours)."""
        if self._leaving:
            return
        try:
            self.client.send(*p.PeerLost(role, rank, str(error or "closed")).wire())
        except TransportError:
            pass  # the link is down too: _closed reports that

    def close(self) -> None:
        self._leaving = True
        self._stop.set()
        self.client.close()

    # -- background ------------------------------------------------------------------------------
    def _beat(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            launcher = self.spec.launcher_pid
            if launcher is not None and os.getppid() != launcher:
                _exit_aborted(f"the launcher (pid {launcher}) is gone")
            try:
                self.client.send(*p.Heartbeat(self._report()).wire())
            except TransportError:
                return  # _closed reports it

    def _report(self) -> dict | None:
        if self.report is None:
            return None
        try:
            return self.report()
        except Exception as exc:  # figures are best effort: never let them stop the heartbeats
            logger.warning("could not gather this process's figures: %r", exc)
            return None

    def clock_offset(self, samples: int = 5) -> float:
        """The scheduler's wall clock minus this one, in seconds, from the quickest of `samples`
        round trips (its error is at most half that round trip)."""
        best: tuple[float, float] | None = None
        for _ in range(samples):
            sent = time.time()
            reply = self.client.call(*p.Clock().wire(), timeout_s=self.config.barrier_timeout_s)
            received = time.time()
            offset = p.Time.from_meta(reply.meta).time - (sent + received) / 2
            if best is None or received - sent < best[0]:
                best = (received - sent, offset)
        assert best is not None
        return best[1]

    def _notice(self, header: Header, _tensors: list) -> None:
        if not self._notices.route(header.op, header.meta):
            logger.warning("the scheduler sent an unknown notice %r", header.op)

    def _server_back(self, notice: p.ServerBack) -> None:
        self.lost_servers.pop(notice.rank, None)
        for callback in self._on_server_back:
            try:
                callback(notice.rank, notice.host, notice.port)
            except Exception:
                logger.exception("a server_back callback failed")

    def _server_lost(self, notice: p.ServerLost) -> None:
        self.lost_servers[notice.rank] = notice.reason
        for callback in self._on_server_lost:
            try:
                callback(notice.rank, notice.reason)
            except Exception:
                logger.exception("a lost-server callback failed")

    def _shutdown(self, _: p.Shutdown) -> None:
        self._leaving = True
        self.shutdown.set()

    def _closed(self, error: Exception | None) -> None:
        if not self._leaving:
            _exit_aborted(f"lost the connection to the scheduler: {error}")


def _exit_aborted(reason: str) -> None:
    role = os.environ.get("PARATRAIN_ROLE", "node")
    try:
        # One write, its newline included: print() writes the end apart, and a traceback that
        # another thread prints at the same moment would land between the two (launch/lines.py).
        sys.stderr.write(f"paratrain: {role} stopping: {reason}\n")
        sys.stderr.flush()
        sys.stdout.flush()
    except BaseException:
        # stderr may be a pipe to a launcher that is gone (BrokenPipeError): saying why is
        # worth a try, exiting is not optional.
        pass
    os._exit(EXIT_ABORTED)
