"""A worker's side of replicated servers (kvstore/server/replica.py): which servers live, and
requests that fail over to a slice's next live server when the one serving it dies.

A request to the servers of one primary's slices is sent to the first live server of their chain
(placement.replicas). If its connection is lost before the reply, or the scheduler says the server
is lost (Servers.fail_over, at once: not when the caller waits), the server is marked dead and the
same request (same pushes, same (worker, clock) per slice) goes to the next live server of the
chain, with the list of dead servers, so that it stops forwarding to them. The new server drops a
push it already has from the dead primary's replication and waits for the others' to complete a
round; the caller's Handle never sees the fail-over. Only when every server of a chain is dead does
the wait fail.

A call that is no push or pull goes to every live server (configure, set_optimizer, set_hyper,
stats, a checkpoint's get_state) or to every copy of some slices (init, a checkpoint's load): there
the server that dies during it is only marked dead (`Servers.submit`, `Spared`): the others got
the same message, and its slices are served by a copy that has it. A server lost before the job
started (it never registered, or died before this worker connected) is dead from the start: its
place holds an `Unreachable` client.

On one machine a primary keeps its slices in shared memory (as an unreplicated server does): the
worker adds its pushes into the open round's buffer and reads the pulled values there. A backup
does not, so a request sent to any server but the primary goes as its `Payload` says: the pushes in
the frame, the values in the reply, and the Handle's reads of that frame dropped (they would read
the dead primary's memory over the reply).

A restarted server that has caught up (the scheduler's `server_back` notice, with its new address)
is live again but comes last in every chain's order: it is a backup of the slices it held, and
serves them again only if every other copy dies (no fail-back; replica.py says why).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.errors import KVStoreError, TransportError
from paratrain.kvstore.placement import replicas
from paratrain.transport.client import Future, Reply, RpcClient

logger = logging.getLogger(__name__)


class Servers:
    """The job's servers as one worker sees them: its clients, the copies per slice, the dead."""

    def __init__(self, clients: list[RpcClient], replication: int) -> None:
        replicas(0, len(clients), replication)  # checks the count against the servers
        self.clients = clients
        self.replication = replication
        self.dead: set[int] = set()
        self.rejoined: set[int] = set()
        """Restarted servers that caught up: backups, last in every chain's fail-over order."""
        self._lock = threading.Lock()
        self._pending: weakref.WeakSet[FailoverFuture] = weakref.WeakSet()
        """Requests not answered yet: they fail over as soon as their server is found dead."""

    def chain(self, primary: int) -> list[int]:
        return replicas(primary, len(self.clients), self.replication)

    def order(self, primary: int) -> list[int]:
        """The live servers of `primary`'s chain in fail-over order: the rejoined ones last."""
        with self._lock:
            live = [s for s in self.chain(primary) if s not in self.dead]
            return [s for s in live if s not in self.rejoined] + [s for s in live if s in self.rejoined]

    def serving(self, primary: int) -> int:
        """The server that serves `primary`'s slices now: the first of their live ones (order)."""
        live = self.order(primary)
        if not live:
            raise KVStoreError(
                f"every server holding server {primary}'s slices is dead ({self.chain(primary)}): "
                f"replication={self.replication} copies were not enough"
            )
        return live[0]

    def dead_list(self) -> list[int]:
        with self._lock:
            return sorted(self.dead)

    def live(self) -> list[int]:
        with self._lock:
            return [s for s in range(len(self.clients)) if s not in self.dead]

    def back(self, server: int, client: RpcClient) -> None:
        """A restarted server caught up: reached through `client` (its new address) from now on."""
        with self._lock:
            self.clients[server] = client
            self.dead.discard(server)
            self.rejoined.add(server)
        logger.warning("server %d is back (a backup of its slices again)", server)

    def lost(self, server: int, error: object) -> bool:
        """Marks a server dead; True the first time."""
        with self._lock:
            if server in self.dead:
                return False
            self.dead.add(server)
        if self.replication > 1:
            logger.warning("server %d is gone (%s): its slices fail over to their backups", server, error)
        return True

    def track(self, future: FailoverFuture, pending: bool) -> None:
        with self._lock:
            if pending:
                self._pending.add(future)
            else:
                self._pending.discard(future)

    def fail_over(self, server: int) -> None:
        """`server`'s connection closed: send again now, to the next live copies, every request
        it had not answered. Not only when a caller waits for it: a worker waiting for one of
        its requests (a round that needs another worker's push) must not hold back the others,
        whose rounds the other workers may be waiting for."""
        with self._lock:
            waiting = list(self._pending)
        for future in waiting:
            future.fail_over(server)

    def request(
        self,
        primary: int,
        op: str,
        meta: dict,
        tensors: Sequence[torch.Tensor] = (),
        out: Sequence[torch.Tensor | None] | None = None,
        payload: Payload | None = None,
    ) -> Future | FailoverFuture:
        """A request for `primary`'s slices: plain without replication (a lost connection fails
        the Future, not the call: the caller's wait raises it as a KVStoreError), else one that
        fails over (sent as `payload` says to any server but the primary, where it used shared
        memory)."""
        if self.replication == 1:
            return self.clients[primary].submit(op, meta, tensors, out=out)
        return FailoverFuture(self, primary, op, meta, tensors, out, payload)

    def covered(self) -> None:
        """Raises KVStoreError if every copy of some server's slices is dead."""
        for primary in range(len(self.clients)):
            self.serving(primary)

    def submit(
        self, server: int, op: str, meta: dict, tensors: Sequence[torch.Tensor] = ()
    ) -> Future | Spared:
        """A request to `server` alone, one of a call to every live server or every copy (not a
        push or pull): with replication, its loss meanwhile is survived (Spared)."""
        future = self.clients[server].submit(op, meta, tensors)
        return future if self.replication == 1 else Spared(self, server, future)

    def in_place(self, primary: int) -> bool:
        """Whether a request for `primary`'s slices may use its shared memory: it serves them."""
        try:
            return self.replication == 1 or self.serving(primary) == primary
        except KVStoreError:
            return False  # the request itself says so


class Spared:
    """A Future of one server's part in a call to every live server or every copy: if that server
    dies first, it is marked dead and the wait returns an empty reply (`lost` set), as long as
    every slice keeps a live copy (which got the same call)."""

    def __init__(self, servers: Servers, server: int, future: Future) -> None:
        self._servers, self.server, self._future = servers, server, future
        self.lost = False

    @property
    def what(self) -> str:
        return self._future.what

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float | None = None) -> Reply:
        try:
            return self._future.wait(timeout_s)
        except TransportError as exc:
            self._servers.lost(self.server, exc)
            self._servers.covered()
            self.lost = True
            return Reply({}, [])


class Unreachable:
    """The client of a server lost before this worker could connect to it: every request fails."""

    same_host_path = False

    def __init__(self, name: str, why: object) -> None:
        self.name, self._why = name, why

    def request(self, op: str, meta: dict | None = None, tensors: object = (), out: object = None) -> Future:
        raise TransportError(f"{self.name} was lost before it could be reached: {self._why}")

    def submit(self, op: str, meta: dict | None = None, tensors: object = (), out: object = None) -> Future:
        future = Future((op, 0, self.name), None)
        future._set(None, TransportError(f"{self.name} was lost before it could be reached: {self._why}"))
        return future

    def call(self, op: str, meta: dict | None = None, timeout_s: float | None = None) -> Reply:
        return self.request(op, meta).wait(timeout_s)

    def close(self) -> None:
        pass


@dataclass
class Payload:
    """A request as sent to a server that does not hold the slices in shared memory: a backup
    that took over from a same-host primary. The worker had added its pushes into the primary's
    shared buffers and would have read the pulled values there; the backup needs the pushes in the
    frame and sends the values in its reply, and `reads` (the Handle's) loses this frame's
    entries (`mine`), which would read the dead primary's memory over them."""

    meta: dict
    tensors: list[torch.Tensor]
    out: list[torch.Tensor] | None
    reads: list
    mine: list

    def use(self) -> tuple[dict, list[torch.Tensor], list[torch.Tensor] | None]:
        self.reads[:] = [entry for entry in self.reads if not any(entry is m for m in self.mine)]
        return self.meta, self.tensors, self.out


class FailoverFuture:
    """A Future (wait, done, what) over the live servers of one chain, in order."""

    def __init__(
        self,
        servers: Servers,
        primary: int,
        op: str,
        meta: dict,
        tensors: Sequence[torch.Tensor],
        out: Sequence[torch.Tensor | None] | None,
        payload: Payload | None = None,
    ) -> None:
        self._servers, self._primary = servers, primary
        self._request: tuple[str, dict, Sequence[torch.Tensor], Any] = (op, meta, tensors, out)
        self._payload = payload
        self._lock = threading.Lock()
        with self._lock:  # a fail_over meanwhile waits for the first send
            servers.track(self, True)
            self._future = self._send()

    @property
    def what(self) -> str:
        return self._future.what

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float | None = None) -> Reply:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            with self._lock:
                future, server = self._future, self._server
            try:
                reply = future.wait(left)
            except TransportError as exc:
                self._servers.lost(server, exc)
                with self._lock:
                    if self._future is future:  # not sent again meanwhile (fail_over)
                        self._future = self._send()
                continue
            self._servers.track(self, False)
            return reply

    def fail_over(self, server: int) -> None:
        """`server` is dead: send again now if it had this request and had not answered it (its
        connection is closed, so no answer can come any more)."""
        with self._lock:
            if self._server != server:
                return
            future = self._future
            if future.done():
                try:
                    future.wait(0)
                    return  # answered before it died
                except TransportError:
                    pass
                except Exception:
                    return  # its own failure: the caller sees it
            try:
                self._future = self._send()
            except KVStoreError:
                pass  # no live copy left: the caller's wait says so

    def _send(self) -> Future:
        """Holds self._lock."""
        op, meta, tensors, out = self._request
        while True:
            self._server = self._servers.serving(self._primary)
            if self._payload is not None and self._server != self._primary:
                meta, tensors, out = self._payload.use()
            dead = self._servers.dead_list()
            sent = dict(meta, dead=dead) if dead else meta
            try:
                return self._servers.clients[self._server].request(op, sent, tensors, out=out)
            except (TransportError, OSError) as exc:
                self._servers.lost(self._server, exc)
