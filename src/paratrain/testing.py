"""The one helper tests use to run a multi-role job on 127.0.0.1, and checks for what it leaves.

    outcome = run_job(SCRIPT, workers=2, servers=1)
    assert outcome.lines("worker", 1) == ["loss 0.3"]

`run_job` runs the job with the local launcher, captures every child's output (whole, and per
role and rank), asserts that no child process outlived the job and that the scheduler's port is no
longer bound, and by default raises AssertionError carrying the failure report and every child's
stderr when the job did not succeed, so the child's traceback shows in the pytest failure.
"""

from __future__ import annotations

import io
import os
import random
import re
import signal
import socket
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from paratrain.launch.engines.local.job import ChildFailure, LocalJobConfig, ProcessHost, run_local_job
from paratrain.metrics.dashboard import DashboardConfig
from paratrain.system import process_alive
from paratrain.testing_hosts import LinkShape, SimulatedHosts, hosts_unavailable, shaping_unavailable

__all__ = [
    "JobOutcome",
    "LinkShape",
    "SimulatedHosts",
    "assert_all_gone",
    "assert_port_closed",
    "free_port",
    "hosts_unavailable",
    "listening_ports",
    "place_on_hosts",
    "run_job",
    "shaping_unavailable",
]

_LINE = re.compile(r"^\[(scheduler|server|worker) (\d+)\] (.*)$")
_GONE_WAIT_S = 5.0


@dataclass
class JobOutcome:
    """What a job printed and how it ended."""

    exit_code: int
    failure: ChildFailure | None
    report: str
    stdout: str
    """Everything the children wrote to stdout, each line prefixed with `[role rank] `."""
    stderr: str
    """Everything the children wrote to stderr (prefixed), then the launcher's report."""
    pids: list[int]
    scheduler_address: str
    _lines: dict[tuple[str, int], list[tuple[str, str]]] = field(default_factory=dict, repr=False)

    def lines(self, role: str, rank: int, stream: str | None = None) -> list[str]:
        """That child's output lines without the prefix, in arrival order; `stream` picks
        "stdout" or "stderr" (default both)."""
        return [text for name, text in self._lines.get((role, rank), []) if stream in (None, name)]


class _Capture(io.StringIO):
    """A text stream that keeps everything written and files each prefixed line by child."""

    def __init__(
        self,
        stream: str,
        by_child: dict[tuple[str, int], list[tuple[str, str]]],
        watch: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__()
        self._stream = stream
        self._by_child = by_child
        self._watch = watch
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            for line in text.splitlines():
                if self._watch is not None:
                    self._watch(line)
                match = _LINE.match(line)
                if match:
                    key = (match[1], int(match[2]))
                    self._by_child.setdefault(key, []).append((self._stream, match[3]))
            return super().write(text)


def run_job(
    script: str | os.PathLike[str],
    *,
    workers: int,
    servers: int = 0,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
    expect: Literal["success", "failure"] | None = "success",
    stop_grace_s: float = 5.0,
    exit_grace_s: float = 30.0,
    hosts: SimulatedHosts | None = None,
    place: Mapping[str, Sequence[int]] | None = None,
    dashboard: DashboardConfig | None = None,
    watch: Callable[[str], None] | None = None,
    server_losses: int = 0,
    elastic: bool = False,
    max_restarts: int = 0,
    gpus_per_worker: int = 0,
) -> JobOutcome:
    """Runs `script` (a path, or Python source if it contains a newline) as a job of `workers`
    workers, `servers` servers and a scheduler on 127.0.0.1, and checks what it left behind.

    With `hosts`, the processes run on those simulated hosts instead: `place` names the host index
    of each rank per role ({"scheduler": [0], "server": [0, 1], "worker": [1, 2, 3]}); by default
    `place_on_hosts` spreads them. `dashboard`: serve the job's dashboard (its URL is a line of
    stdout); `watch` is called with every line of output as it comes (from the printing thread).
    `server_losses`: servers that may die without failing the job (LocalJobConfig.server_losses).
    `elastic`, `max_restarts`: a worker's death does not stop the job (LocalJobConfig's).
    `gpus_per_worker`: GPUs of its own for each worker (LocalJobConfig's).

    Raises AssertionError if a child process survived the job, if the scheduler's port is still
    listening, or if the job's success does not match `expect` (None: either is fine).
    """
    with tempfile.TemporaryDirectory(prefix="paratrain-job-") as tmp:
        path = _script_path(script, Path(tmp))
        config = LocalJobConfig(
            script=str(path),
            args=tuple(args),
            num_workers=workers,
            num_servers=servers,
            env=dict(env or {}),
            timeout_s=timeout_s,
            stop_grace_s=stop_grace_s,
            exit_grace_s=exit_grace_s,
            placements=_placements(hosts, place or place_on_hosts(hosts.count, servers, workers))
            if hosts is not None
            else {},
            dashboard=dashboard,
            server_losses=server_losses,
            elastic=elastic,
            max_restarts=max_restarts,
            gpus_per_worker=gpus_per_worker,
        )
        by_child: dict[tuple[str, int], list[tuple[str, str]]] = {}
        out, err = _Capture("stdout", by_child, watch), _Capture("stderr", by_child, watch)
        result = run_local_job(config, out=out, err=err)
    outcome = JobOutcome(
        exit_code=result.exit_code,
        failure=result.failure,
        report=result.report,
        stdout=out.getvalue(),
        stderr=err.getvalue(),
        pids=result.pids,
        scheduler_address=result.scheduler_address,
        _lines=by_child,
    )
    assert_all_gone(result.pids)
    if hosts is None:
        assert_port_closed(result.scheduler_address)
    else:
        scheduler_host = (place or {}).get("scheduler", [0])[0]
        assert_port_closed(result.scheduler_address, ports=lambda: hosts.listening_ports(scheduler_host))
    _check_expectation(outcome, expect)
    return outcome


def place_on_hosts(count: int, servers: int, workers: int) -> dict[str, list[int]]:
    """Host indices per role: the scheduler on host 0, servers from host 0 on, workers after the
    servers, wrapping around the `count` hosts."""
    return {
        "scheduler": [0],
        "server": [i % count for i in range(servers)],
        "worker": [(servers + i) % count for i in range(workers)],
    }


def _placements(hosts: SimulatedHosts, place: Mapping[str, Sequence[int]]) -> dict[str, list[ProcessHost]]:
    return {role: [hosts.placement(i) for i in indices] for role, indices in place.items()}


def _script_path(script: str | os.PathLike[str], tmp: Path) -> Path:
    if isinstance(script, str) and "\n" in script:
        path = tmp / "job_script.py"
        path.write_text(textwrap.dedent(script))
        return path
    return Path(script)


def _check_expectation(outcome: JobOutcome, expect: str | None) -> None:
    if expect == "success" and outcome.exit_code != 0:
        raise AssertionError(
            f"job failed with exit code {outcome.exit_code}, expected success\n"
            f"{outcome.report}\n--- stderr of every child ---\n{outcome.stderr}"
            f"--- stdout of every child ---\n{outcome.stdout}"
        )
    if expect == "failure" and outcome.exit_code == 0:
        raise AssertionError(
            "job succeeded, expected a failure\n"
            f"--- stderr of every child ---\n{outcome.stderr}"
            f"--- stdout of every child ---\n{outcome.stdout}"
        )


def assert_all_gone(pids: Iterable[int], wait_s: float = _GONE_WAIT_S) -> None:
    """Asserts that none of `pids` is alive, polling up to `wait_s`; kills and names survivors."""
    deadline = time.monotonic() + wait_s
    survivors = [pid for pid in pids if process_alive(pid)]
    while survivors and time.monotonic() < deadline:
        time.sleep(0.05)
        survivors = [pid for pid in survivors if process_alive(pid)]
    if survivors:
        for pid in survivors:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        raise AssertionError(f"child processes still alive after the job: pids {survivors}")


def assert_port_closed(
    address: str, wait_s: float = _GONE_WAIT_S, ports: Callable[[], set[int]] | None = None
) -> None:
    """Asserts that the port of `address` (host:port) is not listening, polling up to `wait_s`;
    `ports` lists the listening ports where that host is (default: this machine's)."""
    if not address:
        return
    port = int(address.rsplit(":", 1)[1])
    deadline = time.monotonic() + wait_s
    while port in (ports or listening_ports)():
        if time.monotonic() >= deadline:
            raise AssertionError(f"port {port} ({address}) is still listening after the job")
        time.sleep(0.05)


def listening_ports() -> set[int]:
    """TCP ports in LISTEN state on this machine (IPv4 and IPv6), from /proc/net/tcp{,6}."""
    ports: set[int] = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(name).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and fields[3] == "0A":  # TCP_LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (another process may take it later)."""
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive TCP ports that were free on `host` a moment ago, below the
    kernel's ephemeral range: a convention that puts a second service at MASTER_PORT+1 (torchrun's,
    with paratrain's scheduler there) needs both, and a port next to one from `free_port` may be
    taken meanwhile by any outgoing connection."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    chance = random.Random()
    for _ in range(200):
        first = chance.randrange(max(1024, low - 10_000), low - count)
        try:
            for port in range(first, first + count):
                with socket.socket(family, socket.SOCK_STREAM) as sock:
                    sock.bind((host, port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports below {low} on {host}")
