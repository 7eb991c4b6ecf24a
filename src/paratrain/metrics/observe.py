"""What a launcher asks of a job's observability, and how each process starts it (node.py calls these).

    PARATRAIN_DASHBOARD        "fd:N" (a listening socket the launcher made and passed) or
                               "host:port": the scheduler serves the dashboard and /metrics there
    PARATRAIN_DASHBOARD_LINGER seconds the scheduler keeps serving after a failed job (default 0)
    PARATRAIN_TRACE_DIR        every process writes its Chrome-trace timeline into this folder

The scheduler's board collects what the heartbeats bring; the scheduler (cluster/) knows nothing of
HTTP: the board is passed to it as its observer.
"""

from __future__ import annotations

import logging
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

from paratrain.metrics.trace import NullTracer, Tracer, open_tracer, tracer

logger = logging.getLogger(__name__)

DASHBOARD_VAR = "PARATRAIN_DASHBOARD"
LINGER_VAR = "PARATRAIN_DASHBOARD_LINGER"
TRACE_VAR = "PARATRAIN_TRACE_DIR"


class RunningDashboard:
    def __init__(self, server: Any, scheduler: Any, linger_s: float) -> None:
        self.server, self.scheduler, self.linger_s = server, scheduler, linger_s

    def linger_then_close(self) -> None:
        """After a failed job, serve its final state a while (the launcher waits for it)."""
        if self.scheduler.outcome and self.linger_s > 0:
            time.sleep(self.linger_s)
        self.server.close()


def start_dashboard(scheduler: Any, secret: bytes, env: Mapping[str, str]) -> RunningDashboard | None:
    """Serve the dashboard for `scheduler` where `env` says; None when it does not ask."""
    setting = env.get(DASHBOARD_VAR)
    if not setting:
        return None
    from paratrain.metrics.board import JobBoard
    from paratrain.metrics.dashboard import DashboardServer, dashboard_token, dashboard_url

    linger_s = float(env.get(LINGER_VAR) or 0)
    board = JobBoard(scheduler.roles, scheduler.job, env.get("PARATRAIN_STRATEGY"))
    scheduler.observer = board
    token = dashboard_token(secret)
    server = DashboardServer(board, token, _dashboard_socket(setting)).start()
    if not setting.startswith("fd:"):  # the launcher did not make the socket, so it cannot print the URL
        print(f"paratrain: dashboard at {dashboard_url(server.host, server.port, token)}", file=sys.stderr)
    return RunningDashboard(server, scheduler, linger_s)


def _dashboard_socket(setting: str) -> socket.socket:
    if setting.startswith("fd:"):
        return socket.socket(fileno=int(setting[3:]))
    host, _, port = setting.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{DASHBOARD_VAR}={setting!r} must be host:port or fd:N")
    from paratrain.metrics.dashboard import DashboardConfig, listen_dashboard

    return listen_dashboard(DashboardConfig(host=host.strip("[]"), port=int(port)))


def start_trace(env: Mapping[str, str], role: str, rank: int) -> Tracer | NullTracer:
    """This process's timeline, if `env` asks for one (its clock is aligned by `align_trace`)."""
    folder = env.get(TRACE_VAR)
    return open_tracer(folder, role=role, rank=rank) if folder else tracer()


def align_trace(trace: Tracer | NullTracer, link: Any) -> None:
    """Put the timeline on the scheduler's clock (a few round trips, once)."""
    if isinstance(trace, Tracer):
        trace.clock_offset_s = link.clock_offset()


class TracedHandler:
    """A server's request handler whose every request is a range of the timeline."""

    def __init__(self, handler: Any, trace: Tracer) -> None:
        self._handler, self._trace = handler, trace

    def handle(self, request: Any) -> None:
        with self._trace.range(f"serve {request.op}"):
            self._handler.handle(request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)


def traced(handler: Any, trace: Tracer | NullTracer) -> Any:
    return TracedHandler(handler, trace) if isinstance(trace, Tracer) else handler
