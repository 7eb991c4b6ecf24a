"""Running an app on uvicorn: in the foreground (the CLI) or on a thread (tests, benchmarks, examples).

The socket is bound here, before uvicorn starts, so port 0 picks a free port with no race and `url`
is known at once.

Each answer goes out in one write: uvicorn's httptools protocol writes a response's status line and
headers on `http.response.start` and its body on `http.response.body`, two `send` syscalls and two
TCP segments per answer (and two wake-ups of the client). `CoalescingTransport` joins the writes a
connection makes in one turn of the event loop. With batching on, the event loop's work for a
batch's answers runs while the model waits (it is half of a batch's time at 32 clients), so this
matters most there; see docs/serve.md for the measurements.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

from starlette.applications import Starlette

from paratrain.serve.api import ServeError
from paratrain.transport.http_limits import ConnectionGuard, HttpLimits, guarded_server, h11_protocol


class CoalescingTransport:
    """A connection's transport whose writes in one turn of the event loop go out as one write
    (module docstring); everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending = []
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._pending))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


PARSERS = ("auto", "httptools", "h11")
"""HTTP parsers a server may use: httptools (fast; in `uvicorn[standard]`), h11 (pure Python), or
auto (httptools where installed, else h11)."""


def http_protocol(parser: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's protocol for `parser` (PARSERS), writing through a CoalescingTransport."""
    if parser not in PARSERS:
        raise ValueError(f"parser={parser!r} is not one of {', '.join(PARSERS)}")
    if parser == "h11":
        return _coalescing(h11_protocol())
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        if parser == "httptools":
            raise ServeError("parser='httptools' needs httptools: pip install 'uvicorn[standard]'") from None
        return _coalescing(h11_protocol())
    return _coalescing(HttpToolsProtocol)


def _coalescing(protocol: type[Any]) -> type[asyncio.Protocol]:
    """`protocol` writing through a CoalescingTransport: both parsers' protocols write an answer's
    head and body in two writes (module docstring)."""

    class Coalescing(protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self.transport = CoalescingTransport(transport)

    Coalescing.__name__ = Coalescing.__qualname__ = f"Coalescing{protocol.__name__}"
    return Coalescing


class HttpServer:
    """`app` served by uvicorn on host:port (port 0: a free one), parsing HTTP with `parser`
    (PARSERS)."""

    def __init__(
        self,
        app: Starlette,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        limits: HttpLimits | None = None,
        parser: str = "auto",
    ) -> None:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose `proto` says
        # TCP. Without it, uvicorn's h11 protocol (two sends per answer: headers, then body) waits
        # for the client's delayed ACK before the body goes out: about 40 ms on every answer.
        self.sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        # The connection policy of every paratrain HTTP server (transport/http_limits.py). No
        # proxy-header middleware: nothing here reads the client's address, and it is a layer every
        # request passes through.
        self.guard = ConnectionGuard(f"serve :{self.port}", limits or HttpLimits())
        self.server = guarded_server(
            app,
            self.guard,
            http_protocol(parser),
            log_level=log_level,
            access_log=False,
            lifespan="on",
            backlog=2048,
            proxy_headers=False,
        )
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve until interrupted (SIGINT/SIGTERM) in this thread."""
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.sock.close()

    def start(self, timeout_s: float = 30.0) -> HttpServer:
        """Serve on a thread; returns once uvicorn accepts requests."""
        self._thread = threading.Thread(target=self.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ServeError(f"uvicorn did not start serving {self.url} within {timeout_s} s")
            time.sleep(0.01)
        return self

    def close(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> HttpServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
