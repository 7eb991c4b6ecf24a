"""One connection policy for paratrain's HTTP servers: the dashboard (metrics/dashboard.py) and
`paratrain serve` (serve/http.py), both uvicorn.

uvicorn alone holds a connection that sends nothing for ever (its keep-alive timer starts only once
data arrived), lets a client drip a header byte every few seconds, and caps requests rather than
connections (`limit_concurrency` answers 503 once a request arrives: the connection, and its
descriptor, are held before that, so it caps nothing a flood of idle connections costs, and past it
real clients are refused while the idle ones stay). Under a common `ulimit -n 1024`, 1,100 idle
connections took every descriptor of the process, and asyncio logged each failed accept with a
traceback. So, on top of uvicorn, `guarded_protocol` wraps its protocol class:

- at most `connection_cap` connections open: `max_connections`, and never more than a quarter of the
  process's descriptor limit, so the rest of the process (the scheduler's RPC port, where nodes
  register) keeps its own headroom. Past the cap the oldest connection still waiting for a request
  head is closed (a real client sends its head at once; a flood's connections are the ones that
  linger), so a real client still gets in during a flood; if every open connection has a request in
  progress, the new one is answered 503 and closed;
- a deadline for each request head (`head_timeout_s`), counted from the connection's start or from
  its last answer: a connection that sends nothing, or drips a head, is closed at it;
- uvicorn's own limits where they fit: `timeout_keep_alive` (`idle_timeout_s`, between requests)
  and `h11_max_incomplete_event_size` (`max_head_bytes`: a longer head is a 400); httptools has no
  such limit, so the guard also counts a head's bytes and closes a connection past it with a 431;
- a body is the app's to read: `body_timeout_s` is the deadline the app reads it under (serve's
  /predict; the dashboard takes no bodies, and an unread one is discarded with its request);
- refusals, accept errors (out of descriptors) and malformed requests are logged through
  `RefusalLog`: a few lines and then one count per interval, never one line per attempt. Out of
  descriptors, the oldest connections waiting for a head are closed, so accept can go on.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
from dataclasses import dataclass, fields
from typing import Any

from paratrain.transport.admission import RefusalLog

logger = logging.getLogger(__name__)

OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def _answer(status: bytes, text: bytes) -> bytes:
    """A whole HTTP answer that closes the connection, written by the guard itself."""
    head = b"HTTP/1.1 %s\r\ncontent-type: text/plain\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
    return head % (status, len(text)) + text


HEAD_TOO_LARGE = _answer(b"431 Request Header Fields Too Large", b"the request head is over the limit\n")
BUSY = _answer(b"503 Service Unavailable", b"every connection has a request in progress\n")


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP server lets a client hold (module docstring)."""

    max_connections: int = 256
    """Most connections open at once (and never over a quarter of the descriptor limit)."""
    head_timeout_s: float = 10.0
    """A request's head (request line and headers) must arrive within this, from the connection's
    start or from the answer before."""
    idle_timeout_s: int = 5
    """A kept-alive connection with no new data for this long is closed (uvicorn's
    `timeout_keep_alive`, whole seconds)."""
    body_timeout_s: float = 30.0
    """A request's body must arrive within this from its head (the app reads it: 408 beyond)."""
    max_head_bytes: int = 64 << 10
    """Longest request head (h11's `max_incomplete_event_size`: 400 beyond)."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            whole = field.name in ("max_connections", "idle_timeout_s", "max_head_bytes")
            kind = int if whole else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
                what = "an int >= 1" if whole else "a number > 0"
                raise ValueError(f"HttpLimits.{field.name}={value!r} must be {what}")

    def uvicorn_options(self) -> dict[str, Any]:
        """The limits uvicorn enforces itself (for `uvicorn.Config`)."""
        return {
            "timeout_keep_alive": self.idle_timeout_s,
            "h11_max_incomplete_event_size": self.max_head_bytes,
        }


def connection_cap(limits: HttpLimits) -> int:
    """`max_connections`, at most a quarter of this process's soft descriptor limit."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return limits.max_connections
    return max(1, min(limits.max_connections, soft // 4))


class ConnectionGuard:
    """The open connections of one server (oldest first) and its refusals."""

    def __init__(self, name: str, limits: HttpLimits) -> None:
        self.name, self.limits, self.cap = name, limits, connection_cap(limits)
        self.refusals = RefusalLog(name)
        self.open: dict[Any, None] = {}  # protocol -> None: a set that keeps its order

    def make_room(self, peer: str) -> bool:
        """At the cap: closes the oldest connection waiting for a head; False if none is."""
        if len(self.open) < self.cap:
            return True
        return self.shed(1, f"over {self.cap} connections (the newest from {peer})") == 1

    def shed(self, count: int, why: str) -> int:
        """Closes up to `count` of the oldest connections waiting for a request head."""
        victims = [p for p in self.open if p.waiting_for_head()][:count]
        for protocol in victims:
            self.refusals.note(protocol.peer, f"closed while waiting for a request head: {why}")
            self.close(protocol)
        return len(victims)

    def close(self, protocol: Any) -> None:
        """Closes a connection and stops counting it at once (its connection_lost comes a turn of
        the loop later; counted until then, a burst would close more than it must)."""
        self.open.pop(protocol, None)
        protocol.transport.close()

    def accept_failed(self, exc: OSError) -> None:
        """accept() failed for want of descriptors: close the oldest idle quarter, log once per burst."""
        shed = self.shed(max(1, len(self.open) // 4), f"{self.name} ran out of descriptors")
        self.refusals.note("(accept)", f"{exc}; closed {shed} idle connection(s)")


def guarded_protocol(base: type[asyncio.Protocol], guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """uvicorn's protocol class `base` (h11 or httptools) under `guard`'s policy."""
    head_timeout_s, max_head_bytes = guard.limits.head_timeout_s, guard.limits.max_head_bytes

    class Guarded(base):  # type: ignore[valid-type, misc]
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0
        peer = "?"

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            address = transport.get_extra_info("peername")
            self.peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
            super().connection_made(transport)
            if not guard.make_room(self.peer):
                guard.refusals.note(
                    self.peer, f"over {guard.cap} connections, each with a request in progress"
                )
                transport.write(BUSY)  # type: ignore[attr-defined]
                transport.close()
                return
            guard.open[self] = None
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            guard.open.pop(self, None)
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self.waiting_for_head():
                self._head_bytes = 0
                return
            self._head_bytes += len(data)
            if self._head_bytes > max_head_bytes and not self.transport.is_closing():
                guard.refusals.note(self.peer, f"a request head over {max_head_bytes} bytes")
                self.transport.write(HEAD_TOO_LARGE)
                guard.close(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def waiting_for_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_due)

        def _head_due(self) -> None:
            if self.waiting_for_head() and not self.transport.is_closing():
                guard.refusals.note(self.peer, f"no request head within {head_timeout_s} s")
                guard.close(self)

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def h11_protocol() -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    return H11Protocol


def guarded_server(
    app: Any, guard: ConnectionGuard, protocol: type[asyncio.Protocol] | None = None, **options: Any
) -> Any:
    """A uvicorn.Server for `app` under `guard` (`protocol`: uvicorn's h11 one by default;
    `options`: more uvicorn.Config settings)."""
    import uvicorn

    _fold_uvicorn_warnings()
    http = guarded_protocol(protocol or h11_protocol(), guard)
    config = uvicorn.Config(app, http=http, **guard.limits.uvicorn_options(), **options)

    class GuardedServer(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            _fold_accept_errors(asyncio.get_running_loop(), guard)
            await super().startup(sockets)

    return GuardedServer(config)


def _fold_accept_errors(loop: asyncio.AbstractEventLoop, guard: ConnectionGuard) -> None:
    """asyncio reports a failed accept to the loop's exception handler (with a traceback, once per
    listener and retry); out of descriptors, the guard handles and counts it instead."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in OUT_OF_DESCRIPTORS:
            guard.accept_failed(exc)
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


class _FoldMalformed(logging.Filter):
    """uvicorn logs a warning for each malformed request: counted by a RefusalLog instead."""

    WARNINGS = ("Invalid HTTP request received.", "Exceeded concurrency limit.")

    def __init__(self, refusals: RefusalLog) -> None:
        super().__init__()
        self.refusals = refusals

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno == logging.WARNING and message in self.WARNINGS:
            self.refusals.note("(a client)", message)
            return False
        return True


def _fold_uvicorn_warnings() -> None:
    """Installs the filter once per process (uvicorn's logger is one for all its servers)."""
    uvicorn_logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _FoldMalformed) for f in uvicorn_logger.filters):
        uvicorn_logger.addFilter(_FoldMalformed(RefusalLog("HTTP")))
