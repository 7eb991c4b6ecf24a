"""The live dashboard and `/metrics`, served over HTTP from the scheduler's process.

    GET /  /workers  /servers  /keys  /staleness    the pages (one HTML file, dashboard.html)
    GET /api/state                                  the board's state as JSON (the pages poll it)
    GET /metrics                                    Prometheus exposition text (prometheus.py)

Starlette on uvicorn, in a thread of the scheduler; bound to 127.0.0.1 by default. Every request
needs the job's dashboard token (an HMAC of the job secret, so whoever holds the secret, the
launcher, can print it and nobody else can guess it): `?token=` or an `Authorization: Bearer`
header (Prometheus; the pages send it from their own URL). No cookie: a browser sends a cookie to
every server on the host whatever its port, another user's included, so a cookie holding the token
would hand it to them. The pages' links carry `?token=` on, and `Referrer-Policy: no-referrer`
keeps the URL's token out of what a page's links send elsewhere. Without the token: 401. The pages
poll /api/state once a second; it reads what the heartbeats already brought, so a look at the
dashboard adds no traffic to the job.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.metrics.board import JobBoard
from paratrain.transport.http_limits import ConnectionGuard, HttpLimits, guarded_server
from paratrain.transport.ports import binding

logger = logging.getLogger(__name__)

PAGES = ("/", "/workers", "/servers", "/keys", "/staleness")
_PAGE = Path(__file__).with_name("dashboard.html")


@dataclass(frozen=True)
class DashboardConfig:
    """Where the dashboard listens, and how long it outlives the job."""

    host: str = "127.0.0.1"
    """The address to bind: loopback by default (reach it through an SSH tunnel)."""
    port: int = 0
    """0: a free port."""
    linger_s: float = 0.0
    """Keep serving this long after the job ended, so its final state (a failure) can be read."""

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError(f"DashboardConfig.host={self.host!r} must be an address")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"DashboardConfig.port={self.port!r} must be an int in 0..65535")
        if not (isinstance(self.linger_s, (int, float)) and self.linger_s >= 0):
            raise ValueError(f"DashboardConfig.linger_s={self.linger_s!r} must be a number >= 0")


def dashboard_token(secret: bytes) -> str:
    """The dashboard's token for the job whose secret is `secret`."""
    return hmac.new(secret, b"paratrain dashboard", hashlib.sha256).hexdigest()[:32]


def dashboard_url(host: str, port: int, token: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/?token={token}"


def build_app(board: JobBoard, token: str) -> Any:
    """The Starlette app: pages, state and metrics, all behind the token."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    from paratrain.metrics.prometheus import prometheus_text

    page = _PAGE.read_text()

    def allowed(request: Request) -> bool:
        given = request.query_params.get("token") or ""
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return hmac.compare_digest(given.encode(), token.encode())

    def guarded(handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            if not allowed(request):
                return Response(
                    "401: this dashboard needs its token (?token=... as printed at launch)\n", 401
                )
            response = handler(request)
            response.headers["Referrer-Policy"] = "no-referrer"
            return response

        return endpoint

    routes = [Route(path, guarded(lambda _r: HTMLResponse(page))) for path in PAGES]
    routes.append(Route("/api/state", guarded(lambda _r: JSONResponse(board.state()))))
    routes.append(
        Route(
            "/metrics",
            guarded(lambda _r: Response(prometheus_text(board), media_type="text/plain; version=0.0.4")),
        )
    )
    return Starlette(routes=routes)


class DashboardServer:
    """uvicorn serving `build_app` on a socket, in a daemon thread."""

    def __init__(
        self, board: JobBoard, token: str, sock: socket.socket, limits: HttpLimits | None = None
    ) -> None:
        self.sock = sock
        self.host, self.port = sock.getsockname()[:2]
        # The connection policy of every paratrain HTTP server (transport/http_limits.py): a flood of
        # idle connections here must leave the scheduler's RPC port its descriptors.
        self.guard = ConnectionGuard(f"dashboard :{self.port}", limits or HttpLimits())
        app = build_app(board, token)
        self._server = guarded_server(app, self.guard, log_level="warning", lifespan="off", access_log=False)
        self._thread = threading.Thread(target=self._serve, name="dashboard", daemon=True)

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self.sock])
        except Exception:
            logger.exception("the dashboard stopped")

    def start(self) -> DashboardServer:
        self._thread.start()
        deadline = time.monotonic() + 10.0
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(5.0)
        self.sock.close()


def listen_dashboard(config: DashboardConfig) -> socket.socket:
    """The dashboard's listening socket; a port taken raises PortUnavailable naming the option."""
    family = socket.getaddrinfo(config.host, config.port, type=socket.SOCK_STREAM)[0][0]
    with binding(config.host, config.port, "choose another with --dashboard-port (0: a free one)"):
        return socket.create_server((config.host, config.port), family=family, backlog=64)
