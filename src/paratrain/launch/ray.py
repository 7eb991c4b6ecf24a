"""`paratrain launch --backend ray`: every role process on a node of an existing Ray cluster.

The driver (this module, run by `paratrain launch`) connects to the cluster (`ray start` on each
machine; `--address auto` or an address) and reserves one placement-group bundle per process: the
servers in one group, STRICT_SPREAD over distinct nodes where enough nodes can hold a server (else
SPREAD, best effort), the scheduler and the workers in another, SPREAD. On each bundle a Ray actor
(`ray_process.RoleProcess`) starts the script as a real OS process with paratrain's identity
variables (`spec_to_env`): PARATRAIN_HOST is that node's address, and the scheduler listens on its
own node's address through a socket its actor opened and handed over. The job secret travels only
in the arguments of the actor call that starts each process (never in a command line, a file or
an actor's creation spec, which Ray keeps in its control store).

The driver long-polls every actor for output and exit (`ray.wait` on the pending polls, one
thread), prints each line prefixed `[role rank @node] `, and ends the job as the local engine
does (launch/local.py is the model): success when every worker exits 0 and then the scheduler and
servers by themselves; on the first failure, a lost actor (its node died) included, everything is
stopped (SIGTERM to each process group through its actor, then SIGKILL) and report.py's report
names role, rank, node and cause. Ctrl-C (SIGINT) or SIGTERM to the driver stops every process on
every node. Whatever happens, every actor is killed and every placement group removed; a child
whose actor dies goes with it (see ray_process.py), and Ray kills the actors of a driver that dies.

Each process gets OMP_NUM_THREADS = the CPUs its role reserves (at least 1) unless the user set
OMP_NUM_THREADS or MKL_NUM_THREADS, which are then passed on as they are. Every node needs
paratrain, the script (at the same path, e.g. a shared file system or the same image) and the
interpreter Ray runs there, which runs the script unless `LaunchConfig.python` names another.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shlex
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from paratrain.cluster.spec import EXIT_ABORTED, ClusterSpec, spec_to_env
from paratrain.launch.api import THREAD_VARS, LaunchConfig, thread_env
from paratrain.launch.ray_placement import GroupPlan, NodeInfo, RayJobError, node_labels, plan_groups
from paratrain.launch.report import (
    ChildFailure,
    ChildRecord,
    JobResult,
    _exit_reason,
    _failure_report,
    _first_failure,
    _interrupted_report,
    _signal_name,
)

logger = logging.getLogger(__name__)

STDERR_TAIL_LINES = 30
EXIT_INTERRUPTED = 130
_POLL_S = 0.5
"""How long one ray.wait (and one actor poll) lasts: the driver notices an interrupt this fast."""
_KILL_WAIT_S = 30.0
_ACTOR_CONCURRENCY = 4
"""Calls one actor serves at once: a poll may be waiting while signal or close comes in."""


@dataclass(frozen=True)
class RayOptions:
    """Where and with what resources a job runs on Ray."""

    address: str = "auto"
    """The Ray cluster: "auto" (the one `ray start` started on this machine), or host:port."""
    cpus_per_worker: float = 1.0
    """CPUs reserved for each worker; also its OMP_NUM_THREADS (at least 1)."""
    cpus_per_server: float = 1.0
    """CPUs reserved for each server; also its OMP_NUM_THREADS (at least 1)."""
    gpus_per_worker: float = 0
    """GPUs reserved for each worker (Ray sets CUDA_VISIBLE_DEVICES for it)."""
    cpus_per_scheduler: float = 0.5
    """CPUs reserved for the scheduler, which only answers rendezvous, barriers and heartbeats."""
    placement_timeout_s: float = 120.0
    """How long to wait for the cluster to hold every process's bundle."""
    start_timeout_s: float = 120.0
    """How long to wait for the actors to come up and start their processes."""
    stop_grace_s: float = 5.0
    """Between SIGTERM and SIGKILL when stopping; also how long the others may take to exit by
    themselves after a process exits with EXIT_ABORTED (the cause may still be on its way)."""
    exit_grace_s: float = 30.0
    """How long the scheduler and servers may take to exit after every worker exited 0."""

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address:
            raise ValueError(f"address must be 'auto' or host:port, got {self.address!r}")
        for name in ("cpus_per_worker", "cpus_per_server", "cpus_per_scheduler"):
            _check_number(name, getattr(self, name), positive=True)
        _check_number("gpus_per_worker", self.gpus_per_worker, positive=False)
        for name in ("placement_timeout_s", "start_timeout_s"):
            _check_number(name, getattr(self, name), positive=True)
        for name in ("stop_grace_s", "exit_grace_s"):
            _check_number(name, getattr(self, name), positive=False)


def _check_number(name: str, value: Any, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not (value > 0 if positive else value >= 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")


@dataclass
class RayJobResult(JobResult):
    """How a job on Ray ended, and where each of its processes ran."""

    nodes: dict[str, str] = field(default_factory=dict)
    """"role rank" -> the node's label, as in the output's prefixes (e.g. "server 0" -> "10.0.0.5")."""


def run_ray_job(config: LaunchConfig, options: RayOptions) -> int:
    """`paratrain launch --backend ray`: the job on the Ray cluster; its exit status."""
    return run_ray(config, options).exit_code


def run_ray(
    config: LaunchConfig, options: RayOptions, out: IO[str] | None = None, err: IO[str] | None = None
) -> RayJobResult:
    """Runs the job on the Ray cluster to its end; nothing of it is left running there.

    Connects to options.address unless this process is already connected to a cluster (then it
    stays connected). Output goes to `out` and `err` (default sys.stdout and sys.stderr), each line
    prefixed `[role rank @node] `; a failure or interruption report is written to `err`.
    """
    printer = _Printer(out or sys.stdout, err or sys.stderr)
    try:
        import ray
    except ImportError:
        printer.write(printer.err, "paratrain: --backend ray needs Ray: pip install 'paratrain[ray]'\n")
        return RayJobResult(1, None, "", [])
    connected_here = not ray.is_initialized()
    if connected_here:
        try:
            ray.init(address=options.address, log_to_driver=False, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            report = f"paratrain: could not connect to the Ray cluster at {options.address!r}: {exc}\n"
            printer.write(printer.err, report)
            return RayJobResult(1, None, report, [])
    job = _RayJob(config, options, printer)
    started = time.monotonic()
    try:
        with _interrupt_handlers(job):
            try:
                job.start()
                outcome = job.supervise()
            except _Interrupted:
                outcome = "interrupted"
            except RayJobError as exc:
                outcome, job.start_error = "unstarted", str(exc)
            finally:
                job.stop()
    finally:
        job.release()
        if connected_here:
            ray.shutdown()
    result = job.result(outcome)
    if result.report:
        printer.write(printer.err, result.report)
    elif result.exit_code == 0:
        elapsed = time.monotonic() - started
        printer.write(
            printer.err,
            f"paratrain: job finished: {config.num_workers} worker(s) succeeded in {elapsed:.1f} s\n",
        )
    return result


class _Printer:
    """Writes whole lines to the driver's streams; one lock so lines never interleave."""

    def __init__(self, out: IO[str], err: IO[str]) -> None:
        self.out = out
        self.err = err
        self._lock = threading.Lock()

    def write(self, stream: IO[str], text: str) -> None:
        with self._lock:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):
                pass  # a closed or broken stream must not stop the job's supervision


class _RayChild:
    """One process of the job as the driver sees it: its actor, its node and its exit."""

    def __init__(self, role: str, rank: int, actor: Any) -> None:
        self.role = role
        self.rank = rank
        self.label = f"{role} {rank}"
        self.actor = actor
        self.node = NodeInfo(ip="?", node_id="?")
        self.node_label = "?"
        self.pid = 0
        self.poll_ref: Any = None
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self.ended = False
        self.returncode: int | None = None
        self.lost: str | None = None
        """Why its actor is gone (its node died, or Ray lost it); None while it answers."""
        self.exit_time: float | None = None
        self.failure_reason: str | None = None

    @property
    def running(self) -> bool:
        """Running as far as the driver knows: its exit (or loss) has not been processed yet."""
        return not self.ended

    @property
    def prefix(self) -> str:
        return f"[{self.label} @{self.node_label}] "

    def signal(self, signum: int) -> None:
        if self.running:
            self.actor.signal.remote(signum)

    def record(self) -> ChildRecord:
        return ChildRecord(self.role, self.rank, self.pid, self.returncode)

    def failure(self, reason: str) -> ChildFailure:
        rc = self.returncode
        signame = _signal_name(-rc) if rc is not None and rc < 0 else None
        host = self.node_label
        return ChildFailure(self.role, self.rank, self.pid, host, rc, signame, reason, list(self.stderr_tail))


class _RayJob:
    """The actors and processes of one job on Ray, and the loop that reacts to their exits."""

    def __init__(self, config: LaunchConfig, options: RayOptions, printer: _Printer) -> None:
        self.config = config
        self.options = options
        self.printer = printer
        self.children: list[_RayChild] = []
        self.groups: list[Any] = []
        self.failed: list[_RayChild] = []
        self.early: list[_RayChild] = []
        self.still_running: list[_RayChild] = []
        self.scheduler_address = ""
        self.start_error = ""
        self.interrupt: int | None = None
        """The first SIGINT or SIGTERM the driver got."""
        self.interrupts = 0
        """How many it got; a wait returns early while this exceeds `seen_interrupts`."""
        self.seen_interrupts = 0
        self.deadline = None if config.timeout_s is None else time.monotonic() + config.timeout_s

    @property
    def interrupted(self) -> bool:
        """A SIGINT or SIGTERM came that no wait has yet given way to."""
        return self.interrupts > self.seen_interrupts

    # -- starting

    def start(self) -> None:
        import ray

        nodes = _alive_nodes(ray.nodes())
        plans = plan_groups(self.config, self.options, nodes)
        self._place(plans)
        remote = ray.remote(_role_process_class())
        for plan, group in zip(plans, self.groups):
            for index, (role, rank) in enumerate(plan.members):
                bundle = plan.bundles[index]
                actor = remote.options(
                    num_cpus=bundle.get("CPU", 0),
                    num_gpus=bundle.get("GPU", 0),
                    max_concurrency=_ACTOR_CONCURRENCY,
                    scheduling_strategy=_in_bundle(group, index),
                ).remote()
                self.children.append(_RayChild(role, rank, actor))
        order = {"scheduler": 0, "server": 1, "worker": 2}
        self.children.sort(key=lambda c: (order[c.role], c.rank))
        wheres = self._wait_all([c.actor.where.remote() for c in self.children], "the actors to start")
        for child, where in zip(self.children, wheres):
            child.node, child.pid = NodeInfo(ip=where["ip"], node_id=where["node_id"]), where["pid"]
        labels = node_labels([c.node for c in self.children])
        for child in self.children:
            child.node_label = labels[child.node.node_id]
        self._start_processes()

    def _place(self, plans: Sequence[GroupPlan]) -> None:
        from ray.util.placement_group import placement_group

        for plan in plans:
            self.groups.append(placement_group(list(plan.bundles), strategy=plan.strategy))
        for plan, group in zip(plans, self.groups):
            what = f"the placement group of {plan.describe()}"
            try:
                self._wait_all([group.ready()], what, self.options.placement_timeout_s)
            except RayJobError as exc:
                raise RayJobError(f"{exc}; the cluster has {_available()} free") from None

    def _start_processes(self) -> None:
        cfg = self.config
        scheduler = self.children[0]
        assert scheduler.role == "scheduler"
        [port] = self._wait_all([scheduler.actor.listen.remote(scheduler.node.ip)], "the scheduler's socket")
        self.scheduler_address = _join(scheduler.node.ip, port)
        secret = secrets.token_bytes(32)
        python = None if cfg.python == sys.executable else cfg.python  # None: the node's Python
        cmd = [python, "-u", os.path.abspath(cfg.script), *cfg.args]
        threads, thread_line = self._threads()
        logger.info("%s", self._describe(thread_line))
        refs = []
        for child in self.children:
            spec = ClusterSpec(
                role=child.role,
                rank=child.rank,
                num_workers=cfg.num_workers,
                num_servers=cfg.num_servers,
                scheduler_host=scheduler.node.ip,
                scheduler_port=port,
                secret=secret,
                host=child.node.ip,
            )
            env = {**cfg.job_env(), **threads[child.role], **spec_to_env(spec), "PYTHONUNBUFFERED": "1"}
            refs.append(child.actor.start.remote(cmd, env, os.getcwd()))
        for child, pid in zip(self.children, self._wait_all(refs, "the processes to start")):
            child.pid = pid
            child.poll_ref = child.actor.poll.remote(_POLL_S)

    def _threads(self) -> tuple[dict[str, dict[str, str]], str]:
        """Each role's thread variables and the line saying what was chosen."""
        threads, user_chose = role_threads(self.options, {**os.environ, **self.config.env})
        if user_chose:
            return threads, "threads per process: as set by the user (OMP_NUM_THREADS/MKL_NUM_THREADS)"
        counts = ", ".join(f"{role} {t['OMP_NUM_THREADS']}" for role, t in threads.items())
        line = f"threads per process: OMP_NUM_THREADS = its CPUs ({counts}; set OMP_NUM_THREADS to override)"
        return threads, line

    def _describe(self, thread_line: str) -> str:
        cfg = self.config
        timeout = "none" if cfg.timeout_s is None else f"{cfg.timeout_s} s"
        where = ", ".join(f"{c.label} @{c.node_label}" for c in self.children)
        return (
            f"starting {shlex.join([cfg.script, *cfg.args])} on Ray ({self.options.address})\n"
            f"  {cfg.num_workers} worker(s), {cfg.num_servers} server(s), scheduler at "
            f"{self.scheduler_address}; timeout {timeout}\n"
            f"  placed: {where}\n"
            f"  {thread_line}"
        )

    def _wait_all(self, refs: list[Any], what: str, timeout_s: float | None = None) -> list[Any]:
        """ray.get of `refs`, in slices short enough to notice an interrupt; RayJobError naming
        `what` on a timeout or an actor's error."""
        import ray

        timeout_s = self.options.start_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            if self.interrupted:
                raise _Interrupted
            if time.monotonic() >= deadline:
                raise RayJobError(f"waited {timeout_s} s for {what}")
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as exc:
            raise RayJobError(f"while waiting for {what}: {_first_line(exc)}") from None

    # -- waiting

    def supervise(self) -> str:
        """Waits for the job to end; returns ok, failed, timeout, grace or interrupted."""
        while self._workers_running():
            early_end = self._early_exit_deadline()
            ended = self._next_exits(_earliest(self.deadline, early_end))
            if self.interrupted:
                return "interrupted"
            if ended is None:
                if early_end is not None and time.monotonic() >= early_end:
                    self.failed.extend(self.early)
                    return "failed"
                return "timeout"
            for child in ended:
                if not self._record(child):
                    return self._after_failure()
        self.early.clear()  # they only left a little before the last worker: no harm done
        return self._await_rest()

    def _workers_running(self) -> bool:
        return any(c.running for c in self.children if c.role == "worker")

    def _early_exit_deadline(self) -> float | None:
        """A scheduler or server that exits 0 while workers still run fails the job, unless the
        workers too exit 0 within exit_grace_s (as in the local engine)."""
        times = [c.exit_time for c in self.early if c.exit_time is not None]
        return min(times) + self.options.exit_grace_s if times else None

    def _await_rest(self) -> str:
        """Every worker exited 0: the scheduler and servers now exit by themselves."""
        grace_end = time.monotonic() + self.options.exit_grace_s
        deadline = grace_end if self.deadline is None else min(grace_end, self.deadline)
        while any(c.running for c in self.children):
            ended = self._next_exits(deadline)
            if self.interrupted:
                return "interrupted"
            if ended is None:
                return "grace" if deadline == grace_end else "timeout"
            for child in ended:
                if not self._record(child):
                    return self._after_failure()
        return "ok"

    def _after_failure(self) -> str:
        """After an EXIT_ABORTED exit the real cause may still be on its way: give the others
        stop_grace_s to exit by themselves before stopping them."""
        end = time.monotonic() + self.options.stop_grace_s
        while all(c.returncode == EXIT_ABORTED for c in self.failed) and self._any_running():
            ended = self._next_exits(end)
            if self.interrupted:
                return "interrupted"
            if ended is None:
                break
            for child in ended:
                self._record(child)
        return "failed"

    def _any_running(self) -> bool:
        return any(c.running for c in self.children)

    def _next_exits(self, deadline: float | None) -> list[_RayChild] | None:
        """Prints the output that came in; returns the children that ended meanwhile (maybe
        none), or None once the deadline has passed. Returns early on an interrupt."""
        import ray

        while not self.interrupted:
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if wait <= 0:
                return None
            by_ref = {c.poll_ref: c for c in self.children if c.running and c.poll_ref is not None}
            if not by_ref:
                return []
            ready, rest = ray.wait(list(by_ref), num_returns=1, timeout=wait)
            if ready and rest:
                more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
                ready += more
            ended = [child for child in (by_ref[ref] for ref in ready) if self._take(child)]
            if ended:
                return ended
        return []

    def _take(self, child: _RayChild) -> bool:
        """Prints one finished poll's output and asks for the next; True if the child ended."""
        import ray

        try:
            reply = ray.get(child.poll_ref)
        except ray.exceptions.RayError as exc:
            child.lost = _lost_reason(child, exc)
            child.ended, child.exit_time, child.poll_ref = True, time.monotonic(), None
            return True
        for stream, line in reply["lines"]:
            if stream == 2:
                child.stderr_tail.append(line)
            stream_out = self.printer.out if stream == 1 else self.printer.err
            self.printer.write(stream_out, f"{child.prefix}{line}\n")
        if reply["dropped"]:
            self.printer.write(self.printer.err, f"{child.prefix}({reply['dropped']} lines dropped)\n")
        if reply["returncode"] is None:
            child.poll_ref = child.actor.poll.remote(_POLL_S)
            return False
        child.returncode, child.poll_ref = reply["returncode"], None
        # When it exited, on the driver's clock: the first failure is the first to exit, not the
        # first whose news came in (several exits often arrive in one batch).
        ago = max(0.0, time.time() - reply["exited_at"])
        child.ended, child.exit_time = True, time.monotonic() - ago
        return True

    def _record(self, child: _RayChild, stopping: bool = False) -> bool:
        """Notes one exit or loss; returns False if it fails the job."""
        if stopping:
            return True
        if child.lost is not None or child.returncode != 0:
            child.failure_reason = child.lost or _exit_reason(child.returncode or 0)
            self.failed.append(child)
            self.failed.extend(self.early)  # an earlier clean exit may be the cause of this one
            self.early.clear()
            return False
        if child.role != "worker" and self._workers_running():
            child.failure_reason = "exited early (code 0) before every worker finished"
            self.early.append(child)
        return True

    # -- stopping

    def stop(self) -> None:
        """SIGTERM to every running process group, SIGKILL after stop_grace_s; waits for the exits."""
        self.still_running = [c for c in self.children if c.running and c.poll_ref is not None]
        if not self.still_running:
            return
        for child in self.still_running:
            child.signal(signal.SIGTERM)
        if self._drain(time.monotonic() + self.options.stop_grace_s, interruptible=True):
            return
        for child in self.children:
            child.signal(signal.SIGKILL)
        if not self._drain(time.monotonic() + _KILL_WAIT_S, interruptible=False):
            left = ", ".join(f"{c.label} (pid {c.pid} @{c.node_label})" for c in self.children if c.running)
            self.printer.write(self.printer.err, f"paratrain: could not reap {left}\n")

    def _drain(self, deadline: float, interruptible: bool) -> bool:
        """Takes exits until every started process exited (True) or the deadline (False). A new
        interrupt while stopping skips the rest of the grace period (when interruptible)."""
        seen = self.interrupts
        while any(c.running and c.poll_ref is not None for c in self.children):
            if interruptible and self.interrupts != seen:
                return False
            self.seen_interrupts = self.interrupts  # past interrupts must not cut the wait short
            if self._next_exits(deadline) is None:
                return False
        return True

    def release(self) -> None:
        """Kills every actor (a child still alive dies with it) and removes the placement groups."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for child in self.children:
            with contextlib.suppress(Exception):
                ray.kill(child.actor, no_restart=True)
        for group in self.groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)

    # -- reporting

    def result(self, outcome: str) -> RayJobResult:
        failure, report, exit_code = None, "", 0
        if outcome == "interrupted":
            report, exit_code = _interrupted_report(self.interrupt), EXIT_INTERRUPTED
        elif outcome == "unstarted":
            report, exit_code = f"paratrain: could not start the job on Ray: {self.start_error}\n", 1
        elif outcome != "ok":
            failure = self._failure(outcome)
            report, exit_code = _failure_report(failure, self.failed, self.still_running), 1
        children = [c.record() for c in self.children]
        nodes = {c.label: c.node_label for c in self.children}
        return RayJobResult(exit_code, failure, report, children, self.scheduler_address, nodes)

    def _failure(self, outcome: str) -> ChildFailure:
        if outcome == "failed":
            child = _first_failure(self.failed)
            assert child.failure_reason is not None
            return child.failure(child.failure_reason)
        left = self.still_running or self.children
        if outcome == "timeout":
            workers = [c for c in left if c.role == "worker"]
            reason = f"was still running when the job timed out after {self.config.timeout_s} s"
            return (workers or left)[0].failure(reason)
        reason = f"did not exit within {self.options.exit_grace_s} s after every worker finished"
        return left[0].failure(reason)


def role_threads(options: RayOptions, user_env: Mapping[str, str]) -> tuple[dict[str, dict[str, str]], bool]:
    """OMP_NUM_THREADS (and MKL_NUM_THREADS) per role: the CPUs the role reserves, at least 1;
    unless the user set either in `user_env`, whose values then go to every role (the nodes do
    not share the driver's environment). Returns them and whether the user chose."""
    chosen = {name: user_env[name] for name in THREAD_VARS if user_env.get(name)}
    cpus = {
        "scheduler": options.cpus_per_scheduler,
        "server": options.cpus_per_server,
        "worker": options.cpus_per_worker,
    }
    if chosen:
        return {role: dict(chosen) for role in cpus}, True
    return {role: thread_env(max(1, int(n)), 1, env={}) for role, n in cpus.items()}, False


class _Interrupted(RayJobError):
    """Raised out of a startup wait when SIGINT or SIGTERM arrived."""


def _role_process_class() -> type:
    from paratrain.launch.ray_process import RoleProcess

    return RoleProcess


def _in_bundle(group: Any, index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)


def _alive_nodes(nodes: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """The total resources of each alive node, from ray.nodes()."""
    return [dict(node.get("Resources", {})) for node in nodes if node.get("Alive")]


def _available() -> str:
    import ray

    free = ray.available_resources()
    return ", ".join(f"{name} {free[name]:g}" for name in ("CPU", "GPU") if name in free) or "nothing"


def _lost_reason(child: _RayChild, exc: Exception) -> str:
    """Why a child's actor stopped answering: its node died, or Ray says otherwise."""
    import ray

    node = next((n for n in ray.nodes() if n.get("NodeID") == child.node.node_id), None)
    if node is not None and not node.get("Alive", True):
        return f"was lost with its node {child.node_label} (Ray node {child.node.node_id[:12]} died)"
    return f"was lost: its Ray actor died ({_first_line(exc)})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _earliest(*deadlines: float | None) -> float | None:
    return min((d for d in deadlines if d is not None), default=None)


@contextlib.contextmanager
def _interrupt_handlers(job: _RayJob) -> Iterator[None]:
    """SIGINT/SIGTERM set job.interrupt, which the loops check every _POLL_S (only possible in
    the main thread; elsewhere the job cannot be interrupted but by its timeout)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.getsignal(signum) for signum in signums}

    def note(signum: int, frame: Any) -> None:
        job.interrupt = job.interrupt or signum
        job.interrupts += 1

    for signum in signums:
        signal.signal(signum, note)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
