"""A paratrain HTTP server in a process of its own with few descriptors, for tests/test_http_floods.py.

    python tests/http_flood_server.py dashboard|serve NOFILE

Lowers this process's descriptor limit to NOFILE (so running out costs a test a few hundred
sockets, not thousands), serves the dashboard beside an RpcServer (the scheduler's port, where
nodes register) or `paratrain serve`'s app on a small model, prints one JSON line
{"http": port, "rpc": port, "token": ...} and serves until its stdin closes. The limits are the
real policy's with short deadlines, so a test sees them act in seconds.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from transport_fuzz import PingHandler  # noqa: E402

from paratrain.transport.http_limits import HttpLimits  # noqa: E402
from paratrain.transport.rpc import RpcServer  # noqa: E402

SECRET = b"h" * 32
LIMITS = HttpLimits(head_timeout_s=2.0, idle_timeout_s=2, body_timeout_s=2.0, max_head_bytes=8 << 10)


def dashboard() -> tuple[Any, int, str]:
    from paratrain.metrics.board import JobBoard
    from paratrain.metrics.dashboard import DashboardServer, dashboard_token

    board = JobBoard(lambda: [], lambda: {"state": "running", "failures": []}, strategy="ps, sync")
    token = dashboard_token(SECRET)
    sock = socket.create_server(("127.0.0.1", 0), backlog=64)
    server = DashboardServer(board, token, sock, LIMITS).start()
    return server, server.port, token


def serve() -> tuple[Any, int, str]:
    from paratrain.serve.api import ServeConfig
    from paratrain.serve.app import Endpoint, build_app
    from paratrain.serve.http import HttpServer

    def run_batch(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int | None]:
        return inputs["inputs"] * 2.0, 7

    endpoint = Endpoint(run_batch, step=lambda: 7, source=lambda: "x2")
    config = ServeConfig(max_body_bytes=4 << 20, max_pending_body_bytes=8 << 20, limits=LIMITS)
    server = HttpServer(build_app(endpoint, config), limits=LIMITS).start()
    return server, server.port, ""


def main() -> None:
    kind, nofile = sys.argv[1], int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    server, port, token = dashboard() if kind == "dashboard" else serve()
    rpc = RpcServer(SECRET, PingHandler()).start()
    print(json.dumps({"http": port, "rpc": rpc.port, "token": token}), flush=True)
    sys.stdin.read()
    rpc.close()
    server.close()


if __name__ == "__main__":
    main()
