"""Unauthenticated connections cost a server bounded time, threads, descriptors and log lines, and
never its accept loop: the handshake deadline, the caps on handshakes, running out of descriptors,
and a flood against a running job."""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transport_fuzz import PingHandler

from paratrain.errors import RemoteError
from paratrain.testing import run_job
from paratrain.transport import handshake
from paratrain.transport.client import RpcClient
from paratrain.transport.config import TransportConfig
from paratrain.transport.rpc import RpcServer

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


@pytest.mark.parametrize("field", ["max_handshakes", "max_handshakes_per_host"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_handshake_caps_must_be_positive_ints(field, value) -> None:
    with pytest.raises(ValueError, match=f"TransportConfig.{field}={value!r} must be an int >= 1"):
        TransportConfig(**{field: value})


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


# ---- a flood against a running job ----------------------------------------------------------------
FLOOD_JOB = """
import json, os, time, torch, paratrain, paratrain.kvstore
from pathlib import Path
from paratrain.transport.config import TransportConfig

DIR = Path(os.environ["FLOOD_DIR"])
(DIR / f"{os.environ['PARATRAIN_ROLE']}-{os.environ['PARATRAIN_RANK']}.pid").write_text(str(os.getpid()))
ctx = paratrain.init(paratrain.JobConfig(transport=TransportConfig(handshake_timeout_s=2.0)))
kv = paratrain.kvstore.create("dist_sync")
kv.init(["w"], [torch.zeros(1000)])
out = torch.empty(1000)
r = 0
while True:  # exact rounds until the flood is over; the workers agree on the last one
    kv.pushpull(["w"], [torch.full((1000,), float((ctx.rank + 1) * (r + 1)))], out=[out])
    assert torch.equal(out, torch.full((1000,), 3.0 * (r + 1))), (r, out[:3])
    r += 1
    if ctx.rank == 0 and r == 3:
        spec = ctx.spec
        where = {"scheduler": [spec.scheduler_host, spec.scheduler_port], "servers": ctx.servers}
        (DIR / "where.tmp").write_text(json.dumps(where))
        (DIR / "where.tmp").rename(DIR / "where.json")
    if any(ctx.barrier(name=f"round {r}", data=(DIR / "flood-done").exists()).values()):
        break
    time.sleep(0.02)
print("exact rounds", r)
"""


def usage(pid: int) -> tuple[int, int]:
    """(threads, descriptors) of a process."""
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def flood(
    targets: list[tuple[str, int]], count: int, hold_s: float, seed: int, midway: Callable[[], None]
) -> Counter:
    """`count` unauthenticated connections, spread over `targets`: random bytes, a huge length
    prefix, idle, or one byte a second; each held until the server drops it or `hold_s` is over.
    `midway` is called once half of them are open."""
    rng = random.Random(seed)
    kinds = ["random", "huge", "idle", "drip"]
    held: dict[socket.socket, str] = {}
    stats: Counter = Counter()

    def service() -> None:
        readable = select.select(list(held), [], [], 0)[0] if held else []
        for sock in readable:
            with contextlib.suppress(OSError):
                if sock.recv(4096):
                    continue
            stats["dropped by the server"] += 1
            del held[sock]
            sock.close()

    try:
        for i in range(count):
            kind = kinds[i % len(kinds)]
            try:
                sock = socket.create_connection(targets[i % len(targets)], timeout=10)
                if kind == "random":
                    sock.sendall(rng.randbytes(rng.choice([1, 63, 64, 65, 4096])))
                elif kind == "huge":
                    sock.sendall(struct.pack("!IQ", 0xFFFFFFFF, 1 << 62) + rng.randbytes(52))
            except OSError:
                stats["refused at once"] += 1
                continue
            stats[kind] += 1
            held[sock] = kind
            if i % 20 == 19:
                service()
            if i == count // 2:
                midway()
        end = time.monotonic() + hold_s
        while held and time.monotonic() < end:
            for sock, kind in list(held.items()):
                if kind == "drip":
                    with contextlib.suppress(OSError):
                        sock.send(b"x")
            time.sleep(1.0)
            service()
        stats["still open at the end"] = len(held)
    finally:
        for sock in held:
            sock.close()
    return stats


def legitimate(scheduler: tuple[str, int], server: tuple[str, int], secret: bytes) -> None:
    """A client with the secret gets in: the server echoes, the scheduler answers (an error for
    an op it does not serve is an answer)."""
    ping_port = server[1]
    client = RpcClient(server[0], ping_port, secret, config=TransportConfig(connect_timeout_s=30.0))
    try:
        assert client.call("ping", {"k": 1}, timeout_s=30).meta == {"k": 1}
    finally:
        client.close()
    client = RpcClient(*scheduler, secret, config=TransportConfig(connect_timeout_s=30.0))
    try:
        with pytest.raises(RemoteError, match="unknown op"):
            client.call("ping", timeout_s=30)
    finally:
        client.close()


def wait_for(path: Path, job: threading.Thread, limit_s: float = 90.0) -> None:
    deadline = time.monotonic() + limit_s
    while not path.exists():
        assert job.is_alive(), "the job ended early"
        assert time.monotonic() < deadline, f"no {path.name} within {limit_s} s"
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_a_flood_of_unauthenticated_connections_costs_a_running_job_nothing(tmp_path, monkeypatch):
    # The secret is the launcher's: the test learns it by giving the launcher its own generator.
    secret = b"s" * 32
    monkeypatch.setattr("paratrain.launch.engines.local.job.secrets.token_bytes", lambda n: secret[:n])
    outcomes: list = []
    job = threading.Thread(
        target=lambda: outcomes.append(
            run_job(FLOOD_JOB, workers=2, servers=2, env={"FLOOD_DIR": str(tmp_path)}, timeout_s=150)
        ),
        daemon=True,
    )
    job.start()
    try:
        wait_for(tmp_path / "where.json", job)
        where = json.loads((tmp_path / "where.json").read_text())
        scheduler, server = tuple(where["scheduler"]), tuple(where["servers"][0])
        pids = {name: int((tmp_path / f"{name}.pid").read_text()) for name in ("scheduler-0", "server-0")}
        before = {name: usage(pid) for name, pid in pids.items()}
        midway = lambda: legitimate(scheduler, server, secret)  # noqa: E731
        stats = flood([scheduler, server], count=500, hold_s=4.0, seed=0, midway=midway)
        legitimate(scheduler, server, secret)
        deadline = time.monotonic() + 30
        after = {name: usage(pid) for name, pid in pids.items()}
        while any(a > b for name in pids for a, b in zip(after[name], before[name])):
            assert time.monotonic() < deadline, f"threads, descriptors before {before}, after {after}"
            time.sleep(0.2)
            after = {name: usage(pid) for name, pid in pids.items()}
    finally:
        (tmp_path / "flood-done").touch()
        job.join(timeout=150)
    assert outcomes, "the job did not finish"
    outcome = outcomes[0]
    print(f"flood: {dict(stats)}; threads, descriptors before {before}, after {after}")
    assert sum(stats[k] for k in ("random", "huge", "idle", "drip")) + stats["refused at once"] == 500
    assert stats["still open at the end"] == 0, stats  # the drips too: the handshake deadline
    for rank in range(2):
        assert outcome.lines("worker", rank, "stdout")[-1].startswith("exact rounds"), outcome.stdout
    for name in ("scheduler", "server"):
        lines = [s for s in outcome.lines(name, 0, "stderr") if "refused" in s]
        print(f"{name} 0 logged {len(lines)} lines about the flood")
        assert 0 < len(lines) <= 20, f"{name} 0 logged {len(lines)} lines about the flood"
