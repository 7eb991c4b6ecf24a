"""What a server lets an accepted connection cost before it has authenticated.

A connection in its handshake holds a thread and a descriptor, and anyone who can reach the port can
open one. So: the handshake has a deadline for the whole exchange (a peer dripping a byte every few
seconds is cut off at it, not at a per-read timeout), at most `max_handshakes` connections are in
their handshake at once and `max_handshakes_per_host` from one address (past a cap the oldest is
dropped: a real peer finishes its handshake in milliseconds, a flood's connections are the ones that
linger), and when the process runs out of descriptors the oldest are dropped too, so that accept can
go on. Refusals are kept (the last few, for error messages) and logged at a bounded rate.

Dropping a connection here means shutting its socket down: the thread reading it sees the end of
the stream, gives up the handshake and closes the socket itself.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass

from paratrain.transport.config import TransportConfig

logger = logging.getLogger(__name__)

LOG_BURST = 5
"""Refusals logged one by one in each LOG_INTERVAL_S; the rest are counted in one line."""
LOG_INTERVAL_S = 10.0
KEEP_REFUSALS = 32


@dataclass(eq=False)
class Handshake:
    """One accepted connection that has not authenticated yet."""

    sock: socket.socket
    host: str
    peer: str
    deadline: float
    dropped: str | None = None
    """Why admission dropped it, if it did."""
    done: bool = False


class RefusalLog:
    """Refused connections: the last KEEP_REFUSALS kept, the first LOG_BURST of every
    LOG_INTERVAL_S logged, the others counted and summed up in one line."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.total = 0
        self._recent: deque[tuple[str, str]] = deque(maxlen=KEEP_REFUSALS)
        self._lock = threading.Lock()
        self._window_start = time.monotonic()
        self._logged = 0
        self._unlogged = 0

    def note(self, peer: str, reason: str) -> None:
        with self._lock:
            self.total += 1
            self._recent.append((peer, reason))
            self._roll(time.monotonic())
            quiet = self._logged >= LOG_BURST
            if quiet:
                self._unlogged += 1
            else:
                self._logged += 1
        if not quiet:
            logger.warning("%s: refused connection from %s: %s", self.name, peer, reason)

    def flush(self, final: bool = False) -> None:
        """Logs the count of refusals not logged one by one, once their interval is over (at
        once if `final`: the server is closing)."""
        with self._lock:
            self._roll(time.monotonic(), final)

    def _roll(self, now: float, final: bool = False) -> None:
        if now - self._window_start < LOG_INTERVAL_S and not final:
            return
        if self._unlogged:
            logger.warning(
                "%s: refused %d more connection(s) since %s (not logged one by one; the last from %s: %s)",
                self.name,
                self._unlogged,
                time.strftime("%H:%M:%S", time.localtime(time.time() - (now - self._window_start))),
                *self._recent[-1],
            )
        self._window_start, self._logged, self._unlogged = now, 0, 0

    def recent(self) -> list[tuple[str, str]]:
        """(peer, reason) of the last refusals, oldest first."""
        with self._lock:
            return list(self._recent)


class Admission:
    """The connections of one server that are in their handshake."""

    def __init__(self, name: str, config: TransportConfig) -> None:
        self.name = name
        self.config = config
        self.refusals = RefusalLog(name)
        self._lock = threading.Lock()
        self._pending: list[Handshake] = []  # oldest first

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def admit(self, sock: socket.socket, addr: tuple) -> Handshake:
        """Registers a just-accepted connection, dropping the oldest ones past a cap."""
        host = str(addr[0])
        entry = Handshake(sock, host, f"{host}:{addr[1]}", time.monotonic() + self.config.handshake_timeout_s)
        with self._lock:
            same_host = [e for e in self._pending if e.host == host]
            if len(same_host) >= self.config.max_handshakes_per_host:
                self._drop(same_host[0], f"over {self.config.max_handshakes_per_host} handshakes from {host}")
            if len(self._pending) >= self.config.max_handshakes:
                self._drop(self._pending[0], f"over {self.config.max_handshakes} handshakes at once")
            self._pending.append(entry)
        return entry

    def replace_socket(self, entry: Handshake, sock: socket.socket) -> None:
        """The connection is now `sock` (TLS wraps the accepted socket)."""
        with self._lock:
            entry.sock = sock
            if entry.dropped is not None:
                _shutdown(sock)

    def finish(self, entry: Handshake) -> bool:
        """The handshake ended; returns False if admission dropped it meanwhile."""
        with self._lock:
            entry.done = True
            if entry in self._pending:
                self._pending.remove(entry)
            return entry.dropped is None

    def expire(self) -> None:
        """Drops every connection past its handshake deadline; logs refusal counts due."""
        now = time.monotonic()
        with self._lock:
            for entry in [e for e in self._pending if e.deadline <= now]:
                self._drop(entry, f"no handshake within {self.config.handshake_timeout_s} s")
        self.refusals.flush()

    def shed(self, why: str) -> int:
        """Out of descriptors: drops the oldest quarter of the handshakes (at least one). Not the
        newest: the connection accepted just before accept failed is as likely a real peer as
        any, and it is the one about to finish; the oldest are the ones that linger."""
        with self._lock:
            victims = self._pending[: max(1, len(self._pending) // 4)]
            for entry in victims:
                self._drop(entry, why)
        return len(victims)

    def drop_all(self, why: str) -> None:
        with self._lock:
            for entry in list(self._pending):
                self._drop(entry, why)

    def _drop(self, entry: Handshake, why: str) -> None:
        """Called with the lock held."""
        self._pending.remove(entry)
        if not entry.done and entry.dropped is None:
            entry.dropped = why
            _shutdown(entry.sock)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed already, or never connected
