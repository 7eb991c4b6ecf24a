"""Start one job as local processes: a scheduler, S servers and W workers, all running one script.

The launcher creates the scheduler's listening socket itself and hands it to the scheduler process
(`pass_fds` + PARATRAIN_SCHEDULER_FD), so the address is known before any process starts and no
port is raced for. The job secret travels only in the environment, never on a command line.

One waiter thread per child posts its exit (with a monotonic timestamp) to a queue; the main thread
reacts to those exits, to the job timeout and to SIGINT/SIGTERM. The job succeeds when every worker
exits 0 and then the scheduler and servers exit 0 by themselves. On the first failure everything is
stopped (SIGTERM to each process group, then SIGKILL), and the report names the first failure that
is a cause: an exit with EXIT_ABORTED is a consequence of another node's failure.

Elastic jobs (`elastic`, or `max_restarts` > 0; the script's JobConfig.elastic must be set too): a
worker that dies does not stop the job here, since the scheduler drops it from the membership (and
stops the job itself below min_workers); with restarts left the launcher starts a new process in
its place, which joins the running job with the dead worker's rank. With replicated servers
(`server_losses`), a dead server is restarted too while restarts last: it rejoins with its rank
as a backup and catches up. A dead scheduler, or a server beyond `server_losses`, ends the job.
Each child (its process, its output threads, its exit) is a `children.Child`. How the outcome is
described (the result and record types, exit reasons, the report text) lives in report.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from paratrain.cluster.spec import EXIT_ABORTED, ClusterSpec, spec_to_env
from paratrain.launch.api import IDENTITY_VARS, LaunchConfig, describe_threads, host_cores, thread_env
from paratrain.launch.children import Child, Exit, Interrupt
from paratrain.launch.report import (
    ChildFailure,
    JobResult,
    Printer,
    _exit_reason,
    _failure_report,
    _interrupted_report,
    blame,
    earliest,
    early_exit_deadline,
    interrupted_exit_code,
    no_exit_outcome,
    only_replacements_left,
    workers_running,
    write_outcome,
)
from paratrain.launch.restarts import Restarts
from paratrain.metrics.dashboard import DashboardConfig

logger = logging.getLogger(__name__)

_POLL_S = 0.5
_KILL_WAIT_S = 30.0


@dataclass(frozen=True)
class ProcessHost:
    """Where one process of a job runs, when not on this machine's `LocalJobConfig.host`: the
    address it binds and advertises, a command prefix that puts it there (such as
    `ip netns exec ns3`: the prefix must exec the command, so that its pid is the process's), and
    extra environment variables for it alone."""

    host: str
    prefix: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LocalJobConfig:
    """One job to run as processes of this machine."""

    script: str
    """Path of the Python script every process runs (a PathLike is stored as str)."""
    args: tuple[str, ...] = ()
    """Arguments passed to the script, unparsed."""
    num_workers: int = 2
    """Number of worker processes (>= 1)."""
    num_servers: int = 1
    """Number of server processes (>= 0; 0 is a collective-only job, still with a scheduler)."""
    host: str = "127.0.0.1"
    """The address every process binds and advertises; the scheduler listens here."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables for every process (paratrain's identity variables win)."""
    timeout_s: float | None = None
    """Limit on the whole job; None waits forever."""
    stop_grace_s: float = 5.0
    """Between SIGTERM and SIGKILL when stopping; also how long the others may take to exit by
    themselves after a process exits with EXIT_ABORTED, before they are stopped."""
    exit_grace_s: float = 30.0
    """How long the scheduler and servers may take to exit after every worker exited 0 (and the
    workers to exit after the scheduler or a server exited 0 before them)."""
    python: str = sys.executable
    """The interpreter that runs the script."""
    server_losses: int = 0
    """Servers that may die without failing the job: with replicated servers
    (JobConfig.replication), replication - 1; their backups serve their slices."""
    placements: Mapping[str, Sequence[ProcessHost]] = field(default_factory=dict)
    """Per role ("scheduler", "server", "worker"), where each rank runs (simulated hosts in tests);
    a role or rank not listed runs here at `host`. A placed scheduler binds `scheduler_port`
    itself, where the launcher cannot bind for it."""
    scheduler_port: int = 29400
    """The scheduler's port when it is placed (unused otherwise: the launcher picks a free one)."""
    dashboard: DashboardConfig | None = None
    """Serve the live dashboard and /metrics from the scheduler (metrics/dashboard.py); the
    launcher binds its port, passes it on like the scheduler's, and prints the URL with the token."""
    elastic: bool = False
    """A worker's death does not stop the job (the scheduler's elastic membership decides)."""
    max_restarts: int = 0
    """How many times in all a dead worker process, or a dead replicated server (`server_losses`),
    is started again (implies `elastic`)."""
    module: bool = False
    """`script` is a module's name, run as `python -m script`."""
    gpus_per_worker: int = 0
    """GPUs of its own for each worker (CUDA_VISIBLE_DEVICES, `device_env`); 0: every process sees
    what this machine shows it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "script", os.fspath(self.script))
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "env", dict(self.env))
        if not self.script:
            raise ValueError(f"script must be a path, got {self.script!r}")
        for name, value in self._strings():
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {value!r}")
        _check_int("num_workers", self.num_workers, minimum=1)
        _check_int("num_servers", self.num_servers, minimum=0)
        _check_int("server_losses", self.server_losses, minimum=0)
        _check_int("max_restarts", self.max_restarts, minimum=0)
        _check_int("gpus_per_worker", self.gpus_per_worker, minimum=0)
        if not self.host:
            raise ValueError(f"host must be an address, got {self.host!r}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s!r}")
        for name in ("stop_grace_s", "exit_grace_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.python:
            raise ValueError(f"python must be an interpreter path, got {self.python!r}")
        counts = {"scheduler": 1, "server": self.num_servers, "worker": self.num_workers}
        for role, places in self.placements.items():
            if role not in counts or len(places) > counts[role]:
                raise ValueError(f"placements[{role!r}] names {len(places)} places for {counts.get(role)}")

    def place(self, role: str, rank: int) -> ProcessHost:
        """Where that process runs."""
        places = self.placements.get(role, ())
        return places[rank] if rank < len(places) else ProcessHost(self.host)

    def local_place(self, rank: int) -> tuple[int, int]:
        """Worker `rank`'s index among the workers on its host, and how many run there."""
        host = self.place("worker", rank).host
        peers = [r for r in range(self.num_workers) if self.place("worker", r).host == host]
        return peers.index(rank), len(peers)

    def _strings(self) -> Iterator[tuple[str, Any]]:
        for i, arg in enumerate(self.args):
            yield f"args[{i}]", arg
        for key, value in self.env.items():
            yield "env key", key
            yield f"env[{key!r}]", value


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


class _Job:
    """The children of one job and the main loop that reacts to their exits."""

    def __init__(self, config: LocalJobConfig, printer: Printer) -> None:
        self.config = config
        self.printer = printer
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.children: list[Child] = []
        self.failed: list[Child] = []
        """Children whose exit (before we began stopping) failed the job."""
        self.early: list[Child] = []
        """Schedulers and servers that exited 0 while workers were still running."""
        self.still_running: list[Child] = []
        """Children that had to be stopped."""
        self.lost: list[Child] = []
        """Servers that died without failing the job (LocalJobConfig.server_losses)."""
        self.scheduler_address = ""
        self.started = time.monotonic()
        self.deadline = None if config.timeout_s is None else self.started + config.timeout_s
        self.interrupt: int | None = None
        self.restarts = Restarts(config.max_restarts, config.elastic)
        self.ending = False
        """Elastic: the job is done while replacements that never joined still start; stop them."""
        self._secret, self._port = b"", 0
        cores, processes = host_cores(), config.num_workers + config.num_servers
        self.threads = thread_env(cores, processes, {**os.environ, **config.env})
        """OMP_NUM_THREADS for every child: its share of this machine's cores, unless the user chose."""
        self.threads_line = describe_threads(self.threads, cores, processes, where="machine")

    # -- starting

    def start(self) -> None:
        cfg = self.config
        secret = secrets.token_bytes(32)
        where = cfg.place("scheduler", 0)
        if where.prefix:  # on another host: it binds its port there itself
            port, listener = cfg.scheduler_port, None
        else:
            listener = _listen(where.host)
            port = listener.getsockname()[1]
        self.scheduler_address = f"{where.host}:{port}"
        self._secret, self._port = secret, port
        logger.info("%s\n  %s", _describe(cfg, self.scheduler_address), self.threads_line)
        board = self._dashboard_socket(secret)
        try:
            self._spawn("scheduler", 0, secret, port, listener, board)
        finally:
            for sock in (listener, board):
                if sock is not None:
                    sock.close()  # the scheduler holds it now; nothing of ours keeps the port
        for rank in range(cfg.num_servers):
            self._spawn("server", rank, secret, port)
        for rank in range(cfg.num_workers):
            self._spawn("worker", rank, secret, port)

    def _dashboard_socket(self, secret: bytes) -> socket.socket | None:
        """The dashboard's listening socket, its URL printed with the token (none if not asked)."""
        if self.config.dashboard is None:
            return None
        from paratrain.metrics.dashboard import dashboard_token, dashboard_url, listen_dashboard

        sock = listen_dashboard(self.config.dashboard)
        host, port = sock.getsockname()[:2]
        url = dashboard_url(host, port, dashboard_token(secret))
        self.printer.write(self.printer.out, f"paratrain: dashboard at {url} (metrics at /metrics)\n")
        return sock

    def _spawn(
        self,
        role: str,
        rank: int,
        secret: bytes,
        port: int,
        listener: socket.socket | None = None,
        board: socket.socket | None = None,
    ) -> None:
        cfg = self.config
        where = cfg.place(role, rank)
        local_rank, local_size = cfg.local_place(rank) if role == "worker" else (None, None)
        spec = ClusterSpec(
            role=role,
            rank=rank,
            num_workers=cfg.num_workers,
            num_servers=cfg.num_servers,
            scheduler_host=cfg.place("scheduler", 0).host,
            scheduler_port=port,
            secret=secret,
            host=where.host,
            launcher_pid=os.getpid(),
            scheduler_fd=None if listener is None else listener.fileno(),
            local_rank=local_rank,
            local_world_size=local_size,
            gpus_per_worker=(cfg.gpus_per_worker or None) if role == "worker" else None,
        )
        child = Child(role, rank, where.host)
        pass_fds = tuple(sock.fileno() for sock in (listener, board) if sock is not None)
        cmd = [*where.prefix, cfg.python, "-u", *(["-m"] if cfg.module else []), cfg.script, *cfg.args]
        env = {**self.threads, **_child_env(cfg, spec)}
        if board is not None and cfg.dashboard is not None:
            env.update(PARATRAIN_DASHBOARD=f"fd:{board.fileno()}")
            env.update(PARATRAIN_DASHBOARD_LINGER=str(cfg.dashboard.linger_s))
        env.update(where.env)
        child.start(cmd, env, pass_fds, self.printer, self.events)
        self.children.append(child)

    # -- waiting

    def supervise(self) -> str:
        """Waits for the job to end; returns ok, failed, timeout, grace or interrupted."""
        while self._workers_running():
            early_end = self._early_exit_deadline()
            event = self._next_event(earliest(self.deadline, early_end))
            if event is None:
                return no_exit_outcome(self.early, self.failed, early_end)
            if isinstance(event, Interrupt):
                return "interrupted"
            if not self._record(event):
                return self._after_failure()
        self.early.clear()  # they only left a little before the last worker: no harm done
        return self._await_rest()

    def _workers_running(self) -> bool:
        return workers_running(self.children)

    def _early_exit_deadline(self) -> float | None:
        return early_exit_deadline(self.early, self.config.exit_grace_s)

    def _await_rest(self) -> str:
        """Every worker exited 0: the scheduler and servers now exit by themselves."""
        grace_end = time.monotonic() + self.config.exit_grace_s
        deadline = grace_end if self.deadline is None else min(grace_end, self.deadline)
        while any(c.running for c in self.children):
            event = self._next_event(deadline)
            if event is None:
                return "grace" if deadline == grace_end else "timeout"
            if isinstance(event, Interrupt):
                return "interrupted"
            if not self._record(event):
                return self._after_failure()
        return "ok"

    def _after_failure(self) -> str:
        """After an EXIT_ABORTED exit the real cause may still be on its way: give the others
        stop_grace_s to exit by themselves before stopping them."""
        end = time.monotonic() + self.config.stop_grace_s
        while all(c.returncode == EXIT_ABORTED for c in self.failed):
            if not any(c.running for c in self.children):
                break
            event = self._next_event(end)
            if event is None:
                break
            if isinstance(event, Interrupt):
                return "interrupted"
            self._record(event)
        return "failed"

    def _next_event(self, deadline: float | None) -> Exit | Interrupt | None:
        """The next exit or interrupt; None once the deadline has passed."""
        while True:
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if wait <= 0:
                return None
            try:
                event = self.events.get(timeout=wait)
            except queue.Empty:
                continue
            if isinstance(event, Interrupt):
                self.interrupt = event.signum
            return event

    def _record(self, event: Exit, stopping: bool = False) -> bool:
        """Notes one exit; returns False if it fails the job."""
        child = event.child
        child.returncode, child.exit_time = event.returncode, event.time
        if stopping:
            return True
        if child.role == "worker" and self._elastic() and (self.ending or event.returncode != 0):
            if not self.ending:
                self._lost(child)
            return True
        if event.returncode != 0:
            child.failure_reason = _exit_reason(event.returncode)
            if child.role == "server" and len(self.lost) < self.config.server_losses:
                self.lost.append(child)  # replicated: the job goes on (the scheduler decides)
                self._server_lost(child)
                return True
            self.failed.append(child)
            self.failed.extend(self.early)  # an earlier clean exit may be the cause of this one
            self.early.clear()
            return False
        if child.role != "worker" and self._workers_running() and not self.ending:
            child.failure_reason = "exited early (code 0) before every worker finished"
            self.early.append(child)
        if self._only_replacements_left():
            self._end_before_joining()
        return True

    def _elastic(self) -> bool:
        return self.restarts.on

    def _only_replacements_left(self) -> bool:
        return self._elastic() and not self.ending and only_replacements_left(self.children)

    def _end_before_joining(self) -> None:
        """The job finished (its scheduler exited 0) while replacements run: one that joined is
        leaving, one that never joined finds the scheduler gone; either way it exits by itself."""
        self.ending = True
        self.early.clear()

    def _lost(self, child: Child) -> None:
        """A worker of an elastic job died: the scheduler drops it; restart it while restarts last."""
        reason = _exit_reason(child.returncode or 0)
        again, line = self.restarts.take(f"{child.label} (pid {child.pid}) {reason}")
        self.printer.write(self.printer.err, line)
        if again:
            self._spawn("worker", child.rank, self._secret, self._port)
            self.children[-1].replacement = True

    def _server_lost(self, child: Child) -> None:
        """A replicated server died and the job goes on; restart it while restarts last: the new
        process rejoins with its rank and catches up (kvstore/server/rejoin.py). It takes the dead
        one's place in `lost`: whether the job survives it dying again, or another server dying
        before it caught up, is the scheduler's call (it counts servers lost until caught up)."""
        wanted = self._workers_running() and not self.ending
        again, line = self.restarts.take(f"server {child.rank} {child.failure_reason}", wanted)
        self.printer.write(self.printer.err, line)
        if again:
            self.lost.remove(child)
            self._spawn("server", child.rank, self._secret, self._port)
        else:  # one that never registered is lost for the scheduler now, not at its start timeout
            reason = child.failure_reason or "died"
            threading.Thread(
                target=_tell_scheduler,
                args=(self.scheduler_address, self._secret, "server", child.rank, reason),
                name="exited",
                daemon=True,
            ).start()

    # -- stopping

    def stop(self) -> None:
        """SIGTERM to every running child's process group, SIGKILL after stop_grace_s; reaps all."""
        self._let_dashboard_linger()
        self.still_running = [c for c in self.children if c.running]
        if not self.still_running:
            return
        for child in self.still_running:
            child.signal(signal.SIGTERM)
        if self._drain(time.monotonic() + self.config.stop_grace_s, interruptible=True):
            return
        for child in self.children:
            child.signal(signal.SIGKILL)
        if not self._drain(time.monotonic() + _KILL_WAIT_S, interruptible=False):
            left = ", ".join(f"{c.label} (pid {c.pid})" for c in self.children if c.running)
            self.printer.write(self.printer.err, f"paratrain: could not reap {left}\n")

    def _let_dashboard_linger(self) -> None:
        """After a failure the scheduler serves the dashboard linger_s more, then exits by itself
        (the others exit as it aborted the job); an interrupt cuts the wait short."""
        linger = self.config.dashboard.linger_s if self.config.dashboard is not None else 0
        scheduler = next((c for c in self.children if c.role == "scheduler" and c.running), None)
        if not linger or scheduler is None:
            return
        deadline = time.monotonic() + linger + self.config.stop_grace_s
        while scheduler.running:
            event = self._next_event(deadline)
            if event is None or isinstance(event, Interrupt):
                return
            self._record(event, stopping=True)

    def _drain(self, deadline: float, interruptible: bool) -> bool:
        """Records exits until every child exited (True) or the deadline (False). A second
        interrupt while stopping skips the rest of the grace period."""
        while any(c.running for c in self.children):
            event = self._next_event(deadline)
            if event is None:
                return False
            if isinstance(event, Interrupt):
                if interruptible:
                    return False
                continue
            self._record(event, stopping=True)
        return True

    def join_output(self) -> None:
        for child in self.children:
            child.join_output()

    # -- reporting

    def result(self, outcome: str) -> JobResult:
        children = [c.record() for c in self.children]
        if outcome == "ok":
            return JobResult(0, None, "", children, self.scheduler_address)
        if outcome == "interrupted":
            report = _interrupted_report(self.interrupt)
            return JobResult(
                interrupted_exit_code(self.interrupt), None, report, children, self.scheduler_address
            )
        failure = self._failure(outcome)
        report = _failure_report(failure, self.failed, self.still_running)
        return JobResult(1, failure, report, children, self.scheduler_address)

    def _failure(self, outcome: str) -> ChildFailure:
        cfg = self.config
        return blame(outcome, self.failed, self.still_running, self.children, cfg.timeout_s, cfg.exit_grace_s)


def _describe(cfg: LocalJobConfig, scheduler_address: str) -> str:
    timeout = "none" if cfg.timeout_s is None else f"{cfg.timeout_s} s"
    return (
        f"starting {'-m ' * cfg.module}{cfg.script} {' '.join(cfg.args)}\n"
        f"  {cfg.num_workers} worker(s), {cfg.num_servers} server(s), scheduler at "
        f"{scheduler_address}\n"
        f"  timeout {timeout}, stop grace {cfg.stop_grace_s} s, exit grace {cfg.exit_grace_s} s, "
        f"python {cfg.python}"
    )


def _tell_scheduler(address: str, secret: bytes, role: str, rank: int, reason: str) -> None:
    """Say to the scheduler that this process died and the job goes on without it (`exited`)."""
    from paratrain.cluster.protocol import Exited
    from paratrain.transport.client import RpcClient
    from paratrain.transport.config import TransportConfig

    host, port = address.rsplit(":", 1)
    try:
        client = RpcClient(
            host, int(port), secret, config=TransportConfig(connect_timeout_s=10.0), name="the scheduler"
        )
        try:
            client.call(*Exited(role, rank, reason).wire(), timeout_s=10.0)
        finally:
            client.close()
    except Exception as exc:  # the scheduler is gone or busy: its start timeout still ends the job
        logger.info("could not tell the scheduler that %s %d %s: %s", role, rank, reason, exc)


def _listen(host: str) -> socket.socket:
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, 0), family=family, backlog=128)


def _child_env(config: LocalJobConfig, spec: ClusterSpec) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in IDENTITY_VARS and k not in _LOCAL_VARS}
    env.update(config.env)
    env.update(spec_to_env(spec))
    env.update(
        device_env(spec.role, spec.local_rank or 0, config.gpus_per_worker, env.get("CUDA_VISIBLE_DEVICES"))
    )
    env["PYTHONUNBUFFERED"] = "1"
    return env


# What a launcher that started this one set for its own process: it would describe another.
_LOCAL_VARS = frozenset({"LOCAL_RANK", "LOCAL_WORLD_SIZE", "PARATRAIN_GPUS_PER_WORKER"})


def device_env(role: str, local_rank: int, gpus_per_worker: int, visible: str | None) -> dict[str, str]:
    """The GPUs one process sees (nothing to set when gpus_per_worker is 0): a worker the
    `gpus_per_worker` devices from local_rank * gpus_per_worker on, numbered within `visible` (this
    machine's CUDA_VISIBLE_DEVICES) where that is set; the scheduler and servers none, so that no
    CUDA context of theirs takes a worker's memory."""
    if not gpus_per_worker:
        return {}
    if role != "worker":
        return {"CUDA_VISIBLE_DEVICES": ""}
    first = local_rank * gpus_per_worker
    wanted = range(first, first + gpus_per_worker)
    if visible is not None and visible.strip():
        shown = [name.strip() for name in visible.split(",")]
        if wanted.stop > len(shown):
            raise ValueError(
                f"gpus_per_worker={gpus_per_worker}: worker {local_rank} on this host needs devices "
                f"{first}..{wanted.stop - 1}, CUDA_VISIBLE_DEVICES={visible!r} shows {len(shown)}"
            )
        names = [shown[i] for i in wanted]
    else:
        names = [str(i) for i in wanted]
    return {"CUDA_VISIBLE_DEVICES": ",".join(names), "PARATRAIN_GPUS_PER_WORKER": str(gpus_per_worker)}


def gpu_shortfall(config: LocalJobConfig, environ: Mapping[str, str], gpu_count: int | None) -> str:
    """Why this machine cannot give every worker placed here its own GPUs ("" when it can, or
    when its GPUs are unknown): `gpu_count` GPUs, or those CUDA_VISIBLE_DEVICES shows."""
    if not config.gpus_per_worker:
        return ""
    visible = {**environ, **config.env}.get("CUDA_VISIBLE_DEVICES")
    shown = len(visible.split(",")) if visible and visible.strip() else gpu_count
    here = [r for r in range(config.num_workers) if not config.place("worker", r).prefix]
    needed = max((config.local_place(r)[1] for r in here), default=0) * config.gpus_per_worker
    if shown is None or needed <= shown:
        return ""
    where = f"CUDA_VISIBLE_DEVICES={visible!r} shows" if visible and visible.strip() else "this machine has"
    return (
        f"--gpus-per-worker {config.gpus_per_worker} for {needed // config.gpus_per_worker} workers needs "
        f"{needed} GPUs; {where} {shown}"
    )


def nvidia_gpu_count() -> int | None:
    """The NVIDIA GPUs the driver lists on this machine (no CUDA context made); None: unknown."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return None


@contextlib.contextmanager
def _interrupt_handlers(events: queue.SimpleQueue[Any]) -> Iterator[None]:
    """Turns SIGINT/SIGTERM into events for the main loop (only possible in the main thread).
    SimpleQueue.put is safe to call from a signal handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.getsignal(signum) for signum in signums}
    for signum in signums:
        signal.signal(signum, lambda signum, frame: events.put(Interrupt(signum)))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_launch(
    config: LaunchConfig,
    host: str = "127.0.0.1",
    dashboard: DashboardConfig | None = None,
    gpus_per_worker: int = 0,
) -> int:
    """`paratrain launch --backend local`: the job as processes of this machine; its exit status.
    The children's output is folded: their abort notices and repeated tracebacks are left out."""
    local = local_job(config, host, dashboard, gpus_per_worker)
    shortfall = gpu_shortfall(local, os.environ, nvidia_gpu_count())
    if shortfall:
        print(f"paratrain: {shortfall}", file=sys.stderr)
        return 2
    return run_local_job(local, fold=True).exit_code


def local_job(
    config: LaunchConfig, host: str, dashboard: DashboardConfig | None, gpus_per_worker: int
) -> LocalJobConfig:
    """The job of `config` as this engine runs it (a launch's and a submitted job's alike)."""
    return LocalJobConfig(
        script=config.script,
        args=config.args,
        num_workers=config.num_workers,
        num_servers=config.num_servers,
        host=host,
        env=config.job_env(),
        timeout_s=config.timeout_s,
        python=config.python,
        dashboard=dashboard,
        server_losses=config.server_losses,
        elastic=config.elastic,
        max_restarts=config.max_restarts,
        module=config.module,
        gpus_per_worker=gpus_per_worker,
    )


def run_local_job(
    config: LocalJobConfig, out: IO[str] | None = None, err: IO[str] | None = None, fold: bool = False
) -> JobResult:
    """Runs the job to its end and returns how it ended; nothing of it is left running.

    Child output goes to `out` and `err` (default: sys.stdout and sys.stderr at call time), each
    line prefixed with `[role rank] `; a failure or interruption report is written to `err`. With
    `fold`, the lines in which processes stop because another failed, and a traceback another child
    already printed, are left out of `out` and `err` (not out of the report's stderr tail).
    """
    printer = Printer(out or sys.stdout, err or sys.stderr, fold)
    job = _Job(config, printer)
    started = time.monotonic()
    with _interrupt_handlers(job.events):
        try:
            job.start()
            outcome = job.supervise()
        finally:
            job.stop()
            job.join_output()
    result = job.result(outcome)
    write_outcome(printer, result, config.num_workers, started)
    return result
