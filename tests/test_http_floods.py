"""Floods and hostile bodies against paratrain's two HTTP servers (the dashboard beside the
scheduler's RPC port, and `paratrain serve`), as data: for each, a normal request is still answered
while the flood's connections are held and after they close, the server's descriptors and memory
come back near where they started, and its log stays a few lines.

The server runs in a process of its own (tests/http_flood_server.py) whose descriptor limit is
lowered to NOFILE, so running out of descriptors takes a few hundred sockets. Only 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http.client
import json
import logging
import os
import random
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from http_flood_server import SECRET

from paratrain.serve import codec
from paratrain.serve.api import BadRequest, ServeConfig
from paratrain.serve.app import OFF_LOOP_BYTES, BodyBudget, Endpoint, Predict, ServeMetrics, build_app
from paratrain.serve.batcher import Batcher
from paratrain.serve.http import HttpServer
from paratrain.transport.client import RpcClient
from paratrain.transport.config import TransportConfig
from paratrain.transport.http_limits import (
    ConnectionGuard,
    HttpLimits,
    _fold_accept_errors,
    connection_cap,
    guarded_protocol,
)

TESTS = Path(__file__).resolve().parent
NOFILE = 160
"""The server's descriptor limit: its HTTP connection cap is a quarter of it (40)."""
FLOOD = 200
"""Connections per flood: more than the server's descriptor limit."""
ANSWER_S = 15.0
"""A functional deadline for a normal request under a flood (generous: the machine is shared)."""


@dataclass
class Server:
    proc: subprocess.Popen
    kind: str
    http: int
    rpc: int
    token: str
    log: Path

    def usage(self) -> tuple[int, int]:
        """(descriptors, resident KiB)."""
        fds = len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        return fds, rss

    def log_lines(self) -> int:
        return len(self.log.read_text().splitlines())

    def normal_request(self) -> None:
        """What a real client does, answered right, within ANSWER_S; the dashboard's RPC port too."""
        conn = http.client.HTTPConnection("127.0.0.1", self.http, timeout=ANSWER_S)
        try:
            if self.kind == "dashboard":
                conn.request("GET", f"/api/state?token={self.token}")
                reply = conn.getresponse()
                assert reply.status == 200 and json.loads(reply.read())["job"]["state"] == "running"
            else:
                body = json.dumps({"inputs": [[1.0, 2.0], [3.0, 4.0]]})
                conn.request("POST", "/predict", body, {"content-type": "application/json"})
                reply = conn.getresponse()
                text = reply.read()
                assert reply.status == 200, text
                assert json.loads(text)["outputs"] == [[2.0, 4.0], [6.0, 8.0]]
        finally:
            conn.close()
        if self.kind == "dashboard":  # the scheduler's port: nodes must still register
            config = TransportConfig(connect_timeout_s=ANSWER_S)
            client = RpcClient("127.0.0.1", self.rpc, SECRET, config=config)
            try:
                assert client.call("ping", {"k": 1}, timeout_s=ANSWER_S).meta == {"k": 1}
            finally:
                client.close()


@contextlib.contextmanager
def flood_server(kind: str, log: Path) -> Iterator[Server]:
    script = str(TESTS / "http_flood_server.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)])}
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, script, kind, str(NOFILE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
        )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        assert line, log.read_text()
        where = json.loads(line)
        yield Server(proc, kind, where["http"], where["rpc"], where["token"], log)
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the floods: each opens one connection and sends what it sends ---------------------------------
def _head(extra: str = "") -> bytes:
    return f"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}".encode()


SLOW_BODY = (
    b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    b"content-length: 1000000\r\n\r\n" + b"[" * 100_000
)
FLOODS: dict[str, Callable[[socket.socket, random.Random], None]] = {
    "idle": lambda sock, rng: None,
    "half a head": lambda sock, rng: sock.sendall(_head()),
    "drip": lambda sock, rng: sock.sendall(b"G"),  # and a byte a second after (see hold)
    "huge head": lambda sock, rng: sock.sendall(_head("X-Big: " + "a" * 20_000 + "\r\n")),
    "random bytes": lambda sock, rng: sock.sendall(rng.randbytes(rng.choice([1, 100, 5000]))),
    "slow body": lambda sock, rng: sock.sendall(SLOW_BODY),
}
CASES = [("dashboard", name) for name in FLOODS if name != "slow body"] + [("serve", name) for name in FLOODS]
"""The dashboard takes no bodies."""


def hold(socks: list[socket.socket], kind: str, seconds: float) -> None:
    """Keeps the flood's connections a while (dripping where it drips), reading what comes back
    until the server closes them (they stay open on this side)."""
    poll = select.poll()  # not select(): a flood's descriptors may be past FD_SETSIZE
    open_ones = {sock.fileno(): sock for sock in socks}
    for fd in open_ones:
        poll.register(fd, select.POLLIN)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if kind == "drip":
            for sock in open_ones.values():
                with contextlib.suppress(OSError):
                    sock.send(b"E")
        for fd, _ in poll.poll(500):
            data = b""
            with contextlib.suppress(OSError):
                data = open_ones[fd].recv(65536)
            if not data:  # closed by the server
                poll.unregister(fd)
                del open_ones[fd]


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[Callable[[str], Server]]:
    """The server of each kind, started once for the module when a test first asks for it."""
    with contextlib.ExitStack() as stack:
        started: dict[str, Server] = {}

        def server(kind: str) -> Server:
            if kind not in started:
                log = tmp_path_factory.mktemp(kind) / "stderr.log"
                started[kind] = stack.enter_context(flood_server(kind, log))
                started[kind].normal_request()
            return started[kind]

        yield server


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind, flood", CASES)
def test_a_flood_leaves_the_server_answering_and_its_descriptors_memory_and_log_bounded(servers, kind, flood):
    server = servers(kind)
    rng = random.Random(flood)
    before, lines_before = server.usage(), server.log_lines()
    socks: list[socket.socket] = []
    try:
        for _ in range(FLOOD):
            try:
                sock = socket.create_connection(("127.0.0.1", server.http), timeout=5)
                FLOODS[flood](sock, rng)
            except OSError:  # refused, or reset: the server is defending itself
                continue
            socks.append(sock)
        server.normal_request()  # during: every flood connection still open on our side
        hold(socks, flood, 3.0)  # past the head and body deadlines (2 s in the child)
        server.normal_request()
    finally:
        for sock in socks:
            sock.close()
    server.normal_request()  # after
    deadline = time.monotonic() + 30
    while (after := server.usage())[0] > before[0] + 4:
        assert time.monotonic() < deadline, f"(descriptors, RSS KiB) before {before}, after {after}"
        time.sleep(0.2)
    assert after[1] < before[1] + 64 * 1024, f"(descriptors, RSS KiB) before {before}, after {after}"
    logged = server.log_lines() - lines_before
    assert logged <= 30, server.log.read_text()[-3000:]
    assert "Traceback" not in server.log.read_text()


# ---- hostile bodies to /predict: each a 4xx naming the problem, never a 500 ------------------------
def _raw(dims: int) -> dict:
    headers = {
        "content-type": "application/octet-stream",
        "x-dtype": "float32",
        "x-shape": ",".join(["1"] * dims),
    }
    return {"content": b"\0\0\0\0", "headers": headers}


def _safetensors(dims: int) -> dict:
    from safetensors.torch import save

    content = save({"inputs": torch.zeros([1] * dims)})
    return {"content": content, "headers": {"content-type": "application/x-safetensors"}}


def _json(text: str) -> dict:
    return {"content": text.encode(), "headers": {"content-type": "application/json"}}


HOSTILE_BODIES = [
    (
        "JSON nested 1,000 deep",
        lambda: _json('{"inputs": ' + "[" * 1000 + "]" * 1000 + "}"),
        400,
        "nested too deep",
    ),
    (
        "JSON nested 40 deep",
        lambda: _json('{"inputs": ' + "[" * 40 + "1" + "]" * 40 + "}"),
        422,
        "nested over 16",
    ),
    ("JSON NaN", lambda: _json('{"inputs": [[1.0, NaN]]}'), 400, "NaN, which is not JSON"),
    ("JSON -Infinity", lambda: _json('{"inputs": [[-Infinity, 1.0]]}'), 400, "-Infinity, which is not JSON"),
    ("X-Shape of 65 dims", lambda: _raw(65), 422, "X-Shape has 65 dims; the limit is 16"),
    ("X-Shape of 17 dims", lambda: _raw(17), 422, "X-Shape has 17 dims"),
    ("safetensors of 17 dims", lambda: _safetensors(17), 422, "has 17 dims; the limit is 16"),
    ("a body over its declared cap", lambda: _json("[" * 5000), 413, "the limit is 4096"),
]


@pytest.fixture(scope="module")
def doubling() -> Iterator[HttpServer]:
    """`paratrain serve`'s app on a model that doubles its input (NaN in, NaN out), no declared inputs."""

    def run_batch(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int | None]:
        return inputs["inputs"] * 2.0, 3

    endpoint = Endpoint(run_batch, step=lambda: 3, source=lambda: "x2")
    with HttpServer(build_app(endpoint, ServeConfig(max_body_bytes=4096))) as server:
        yield server


@pytest.mark.parametrize("what, body, status, words", HOSTILE_BODIES, ids=[row[0] for row in HOSTILE_BODIES])
def test_a_hostile_body_gets_a_4xx_naming_the_problem(doubling, what, body, status, words) -> None:
    with httpx.Client(base_url=doubling.url, timeout=60) as client:
        reply = client.post("/predict", **body())
        assert reply.status_code == status, reply.text
        assert words in reply.json()["error"], reply.text
        assert client.post("/predict", json={"inputs": [[1.0]]}).json()["outputs"] == [[2.0]]


def _strict(token: str) -> float:
    raise ValueError(f"{token} is not JSON")


def test_non_finite_outputs_are_strict_json_strings() -> None:
    """NaN reaches the model in a binary body; the JSON answer names it as protobuf's mapping does."""
    endpoint = Endpoint(lambda inputs: (inputs["inputs"] * 2.0, 1), step=lambda: 1, source=lambda: "x2")
    with (
        HttpServer(build_app(endpoint, ServeConfig())) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        values = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.5]])
        headers = {"content-type": "application/octet-stream", "x-dtype": "float32", "x-shape": "1,4"}
        reply = client.post("/predict", content=values.numpy().tobytes(), headers=headers)
        assert reply.status_code == 200, reply.text
        doc = json.loads(reply.text, parse_constant=_strict)
        assert doc["outputs"] == [["NaN", "Infinity", "-Infinity", 3.0]] and doc["shape"] == [1, 4]


# ---- the policy itself, with no process ------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [("max_connections", 0), ("head_timeout_s", 0.0), ("idle_timeout_s", 1.5), ("body_timeout_s", True)],
)
def test_http_limits_name_a_bad_field(field, value) -> None:
    with pytest.raises(ValueError, match=f"HttpLimits.{field}="):
        HttpLimits(**{field: value})


def test_the_connection_cap_leaves_three_quarters_of_the_descriptors_to_the_rest_of_the_process() -> None:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert connection_cap(HttpLimits(max_connections=10**6)) == max(1, soft // 4)
    assert connection_cap(HttpLimits(max_connections=3)) == min(3, max(1, soft // 4))


def test_accept_errors_are_logged_once_per_burst_and_shed_idle_connections(caplog) -> None:
    """asyncio reports each failed accept with a traceback; under a flood that was hundreds of
    thousands of lines. Now: a few lines, then one count per interval."""
    guard = ConnectionGuard("test server", HttpLimits())
    loop = asyncio.new_event_loop()
    try:
        _fold_accept_errors(loop, guard)
        with caplog.at_level(logging.WARNING):
            for _ in range(1000):
                exc = OSError(errno.EMFILE, "Too many open files")
                loop.call_exception_handler(
                    {"message": "socket.accept() out of system resource", "exception": exc}
                )
            guard.refusals.flush(final=True)
    finally:
        loop.close()
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 < len(lines) <= 10 and not any(r.exc_info for r in lines), [r.getMessage() for r in lines]
    assert "995 more" in lines[-1].getMessage() and guard.refusals.total == 1000


def test_a_large_body_is_decoded_off_the_event_loop_and_a_small_one_on_it(monkeypatch) -> None:
    """Decoding 16 MB of JSON is seconds of CPU: on the event loop every other client would wait."""
    loop_turned = threading.Event()
    on_threads: list[bool] = []

    def decode(*args: object) -> dict[str, torch.Tensor]:
        on_thread = threading.current_thread() is not threading.main_thread()
        on_threads.append(on_thread)
        if on_thread:  # the loop goes on meanwhile (on the loop itself, this wait would never end)
            assert loop_turned.wait(30), "the event loop did not run while a body was decoded"
        return {"inputs": torch.zeros(1, 1)}

    monkeypatch.setattr(codec, "decode", decode)
    predict = Predict(Batcher(lambda x: (x, None), 1, 0.0), ServeConfig(), ServeMetrics(1))

    async def both() -> None:
        asyncio.get_running_loop().call_soon(loop_turned.set)
        await predict._decode(b"[" * (OFF_LOOP_BYTES + 1), {})
        await predict._decode(b"[[1]]", {})

    asyncio.run(both())
    predict.batcher.close()
    assert on_threads == [True, False]


def test_bodies_held_at_once_are_budgeted_and_given_back() -> None:
    budget = BodyBudget(limit=1 << 20)
    with budget.holding(OFF_LOOP_BYTES):  # small bodies are not counted: the connection cap bounds them
        assert budget.held == 0
    with budget.holding(600 << 10) as grow:
        grow(700 << 10)
        with (
            pytest.raises(BadRequest, match="holds 716800 bytes of request bodies") as refused,
            budget.holding(400 << 10),
        ):
            pass
        assert refused.value.status == 503
    assert budget.held == 0


class _Transport:
    def __init__(self, port: int) -> None:
        self.port, self.written, self.closing = port, b"", False

    def get_extra_info(self, name: str) -> object:
        return ("127.0.0.1", self.port) if name == "peername" else None

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing


class _Cycle:
    response_complete = False


def test_the_guard_evicts_the_oldest_idle_connection_refuses_when_all_are_busy_and_caps_heads() -> None:
    """The policy over a stand-in for uvicorn's protocol (h11's own head limit would answer first)."""
    loop = asyncio.new_event_loop()

    class Base(asyncio.Protocol):
        cycle: _Cycle | None = None

        def __init__(self) -> None:
            self.loop = loop

        def connection_made(self, transport) -> None:  # noqa: ANN001
            self.transport = transport

    guard = ConnectionGuard("test", HttpLimits(max_connections=2, max_head_bytes=1000))
    protocol = guarded_protocol(Base, guard)
    try:
        conns = [protocol() for _ in range(4)]
        for i, conn in enumerate(conns[:3]):
            conn.connection_made(_Transport(i))
        assert conns[0].transport.closing and not conns[1].transport.closing  # the oldest idle went
        conns[1].cycle = conns[2].cycle = _Cycle()  # both have a request in progress now
        conns[3].connection_made(_Transport(3))
        assert conns[3].transport.written.startswith(b"HTTP/1.1 503") and conns[3].transport.closing
        conns[2].cycle.response_complete = True  # answered: waiting for its next head
        conns[2].data_received(b"G" * 600)
        assert not conns[2].transport.closing
        conns[2].data_received(b"G" * 600)
        assert conns[2].transport.written.startswith(b"HTTP/1.1 431") and conns[2].transport.closing
        assert guard.refusals.total == 3
    finally:
        loop.close()
