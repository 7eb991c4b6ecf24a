"""Unauthenticated connections cost a server bounded time, threads, descriptors and log lines, and
never its accept loop: the handshake deadline, the caps on handshakes, running out of descriptors,
and a flood against a running job."""

from __future__ import annotations

import contextlib
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from transport_fuzz import PingHandler

from paratrain.transport import handshake
from paratrain.transport.config import TransportConfig
from paratrain.transport.rpc import RpcClient, RpcServer

SECRET = b"f" * 32
HELLO = len(handshake.MAGIC) + handshake.NONCE_BYTES
TESTS = Path(__file__).resolve().parent


@contextlib.contextmanager
def serving(config: TransportConfig) -> Iterator[RpcServer]:
    server = RpcServer(SECRET, PingHandler(), config=config).start()
    try:
        yield server
    finally:
        server.close()


def ping(server_or_port: RpcServer | int, n: int = 3) -> None:
    port = server_or_port if isinstance(server_or_port, int) else server_or_port.port
    client = RpcClient("127.0.0.1", port, SECRET, config=TransportConfig(connect_timeout_s=30.0))
    try:
        reply = client.call("ping", {"n": n}, [torch.arange(n)], timeout_s=30)
        assert reply.meta == {"n": n} and reply.tensors[0].tolist() == list(range(n))
    finally:
        client.close()


def closed_by_peer(sock: socket.socket, wait_s: float) -> bool:
    """Whether the peer ends the stream within wait_s (whatever it sent before is skipped)."""
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        if select.select([sock], [], [], left)[0]:
            try:
                if not sock.recv(4096):
                    return True
            except OSError:
                return True
    return False


def test_a_peer_dripping_bytes_is_cut_off_at_the_handshake_deadline() -> None:
    # One byte every 0.2 s: every read sees a byte within the 1 s timeout, so only a deadline on
    # the whole handshake ends it before the 64 bytes are in (12.8 s).
    with serving(TransportConfig(handshake_timeout_s=1.0)) as server:
        with socket.create_connection((server.host, server.port)) as sock:
            sent = 0
            while sent < 64:
                if closed_by_peer(sock, 0.2):
                    break
                with contextlib.suppress(OSError):
                    sock.send(b"x")
                sent += 1
            assert sent < 64, "the server held a dripping connection through the whole handshake"
        ping(server)
        assert any("no handshake within 1.0 s" in reason for _, reason in server.refused())


def test_handshakes_are_capped_per_server_and_per_host_and_the_oldest_go() -> None:
    config = TransportConfig(handshake_timeout_s=60.0, max_handshakes=4, max_handshakes_per_host=3)
    with serving(config) as server:
        socks = [socket.create_connection((server.host, server.port)) for _ in range(10)]
        try:
            # The first 7 are dropped as newer ones arrive; the last 3 stay in their handshake.
            dropped = [closed_by_peer(sock, 10.0 if i < 7 else 0.5) for i, sock in enumerate(socks)]
            assert dropped == [True] * 7 + [False] * 3, dropped
            ping(server)  # a real client still gets in, past the idle ones
            assert sum(closed_by_peer(sock, 0.5) for sock in socks[7:]) == 1  # it took a slot
            reasons = {reason for _, reason in server.refused()}
            assert reasons == {"over 3 handshakes from 127.0.0.1"}, reasons
        finally:
            for sock in socks:
                sock.close()


EMFILE_SERVER = """
import resource, os, sys
sys.path.insert(0, {tests!r})
from transport_fuzz import PingHandler
from paratrain.transport.config import TransportConfig
from paratrain.transport.rpc import RpcServer

# Room for what is open now and a few connections more: a flood runs this process out of descriptors.
opened = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (opened + 24, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
config = TransportConfig(handshake_timeout_s=30.0, max_handshakes=1000, max_handshakes_per_host=1000)
server = RpcServer({secret!r}, PingHandler(), config=config).start()
print(server.port, flush=True)
sys.stdin.read()  # until the test closes our stdin
server.close()
"""


def test_running_out_of_descriptors_does_not_end_the_accept_loop() -> None:
    script = EMFILE_SERVER.format(tests=str(TESTS), secret=SECRET)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        for _ in range(60):  # idle: each holds one of the server's descriptors in its handshake
            socks.append(socket.create_connection(("127.0.0.1", port)))
        ping(port)  # accept hit EMFILE: it dropped the oldest handshakes and went on
        ping(port, 5)
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        for sock in socks:
            sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = proc.stderr.read().decode() if proc.stderr else ""
    assert "Too many open files" in stderr, stderr
    assert "Traceback" not in stderr, stderr
