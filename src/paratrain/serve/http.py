"""Running an app on uvicorn: in the foreground (the CLI) or on a thread (tests, benchmarks, examples).

The socket is bound here, before uvicorn starts, so port 0 picks a free port with no race and `url`
is known at once.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette

from paratrain.serve.api import ServeError


class HttpServer:
    """`app` served by uvicorn on host:port (port 0: a free one)."""

    def __init__(
        self, app: Starlette, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
    ) -> None:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        # No proxy-header middleware: nothing here reads the client's address, and it is a layer
        # every request passes through.
        config = uvicorn.Config(
            app, log_level=log_level, access_log=False, lifespan="on", backlog=2048, proxy_headers=False
        )
        self.server = uvicorn.Server(config)
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
