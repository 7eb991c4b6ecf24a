"""`paratrain launch --backend ray`: every role process on a node of an existing Ray cluster.

The driver (this module, run by `paratrain launch`) connects to the cluster (`ray start` on each
machine; `--address auto` or an address) and reserves one placement-group bundle per process: the
servers in one group, STRICT_SPREAD over distinct nodes where enough nodes can hold a server (else
SPREAD, best effort), the scheduler and the workers in another, SPREAD. On each bundle a Ray actor
(`process.RoleProcess`) starts the script as a real OS process with paratrain's identity
variables (`spec_to_env`): PARATRAIN_HOST is that node's address, and the scheduler listens on its
own node's address through a socket its actor opened and handed over. The job secret travels only
in the arguments of the actor call that starts each process (never in a command line, a file or
an actor's creation spec, which Ray keeps in its control store).

Once they run, supervise.py prints their output prefixed `[role rank @node] ` and ends the
job as the local engine does; a process lost with its node fails it like one that exited. Ctrl-C
(SIGINT) or SIGTERM to the driver stops every process on every node. Whatever happens, every actor
is killed and every placement group removed; a child whose actor dies goes with it (see
process.py), and Ray kills the actors of a driver that dies.

Each process gets OMP_NUM_THREADS = the CPUs its role reserves (at least 1) unless the user set
OMP_NUM_THREADS or MKL_NUM_THREADS, which are then passed on as they are. Every node needs
paratrain, the script (at the same path, e.g. a shared file system or the same image) and the
interpreter Ray runs there, which runs the script unless `LaunchConfig.python` names another.

Elastic jobs (`--elastic`, `--max-restarts N`: LaunchConfig.elastic, max_restarts; restarts.py): a
dead worker is started again by the driver, up to N times in all, with the same identity, and joins
the running job. A worker process that died leaves its actor alive, and that actor starts the new
process on the same node; a worker lost with its node gets a new actor in the same placement-group
bundle, which Ray moves to a live node when it can (until start_timeout_s). Ray's own actor
restarts (`max_restarts` of an actor) do not fit: Ray does not see a process die under a live
actor, and a restarted actor is rebuilt from its creation spec, which must not hold the job's
secret (nor the command, which the driver's restart passes again with the secret).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from paratrain.cluster.spec import ClusterSpec, spec_to_env
from paratrain.launch.api import THREAD_VARS, LaunchConfig, thread_env
from paratrain.launch.engines.ray.placement import GroupPlan, NodeInfo, RayJobError, node_labels, plan_groups
from paratrain.launch.engines.ray.process import RoleProcess
from paratrain.launch.engines.ray.supervise import POLL_S, Interrupts, RayChild, Supervisor, first_line
from paratrain.launch.report import (
    JobResult,
    Printer,
    _failure_report,
    _interrupted_report,
    interrupted_exit_code,
    write_outcome,
)
from paratrain.launch.restarts import Restarts

logger = logging.getLogger(__name__)

_CLOSE_WAIT_S = 5.0
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
    """`paratrain launch --backend ray`: the job on the Ray cluster; its exit status. The children's
    output is folded: their abort notices and repeated tracebacks are left out (lines.py)."""
    return run_ray(config, options, fold=True).exit_code


def run_ray(
    config: LaunchConfig,
    options: RayOptions,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
    fold: bool = False,
) -> RayJobResult:
    """Runs the job on the Ray cluster to its end; nothing of it is left running there.

    Connects to options.address unless this process is already connected to a cluster (then it
    stays connected). Output goes to `out` and `err` (default sys.stdout and sys.stderr), each line
    prefixed `[role rank @node] `; a failure or interruption report is written to `err`. With
    `fold`, abort notices and repeated tracebacks are left out of `out` and `err` (lines.py).
    """
    printer = Printer(out or sys.stdout, err or sys.stderr, fold)
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
        with job.interrupts.handled():
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
    write_outcome(printer, result, config.num_workers, started)
    return result


class _RayJob(Supervisor):
    """The actors and processes of one job on Ray: placed and started here, supervised by the base."""

    def __init__(self, config: LaunchConfig, options: RayOptions, printer: Printer) -> None:
        timeout_s = config.timeout_s
        restarts = Restarts(config.max_restarts, config.elastic)
        grace = (options.stop_grace_s, options.exit_grace_s)
        super().__init__(printer, Interrupts(), *grace, timeout_s, restarts)
        self.config = config
        self.options = options
        self.groups: list[Any] = []
        self._actor_options: dict[tuple[str, int], dict[str, Any]] = {}
        """Per (role, rank): where its actor runs (its bundle), to place a replacement's actor again."""
        self._launch: dict[tuple[str, int], tuple[list[str | None], dict[str, str]]] = {}
        """Per (role, rank): the command and environment its process was started with."""
        self.scheduler_address = ""
        self.start_error = ""

    # -- starting

    def start(self) -> None:
        import ray

        nodes = _alive_nodes(ray.nodes())
        plans = plan_groups(self.config, self.options, nodes)
        self._place(plans)
        remote = ray.remote(RoleProcess)
        for plan, group in zip(plans, self.groups):
            for index, (role, rank) in enumerate(plan.members):
                bundle = plan.bundles[index]
                self._actor_options[role, rank] = {
                    "num_cpus": bundle.get("CPU", 0),
                    "num_gpus": bundle.get("GPU", 0),
                    "max_concurrency": _ACTOR_CONCURRENCY,
                    "scheduling_strategy": _in_bundle(group, index),
                }
                actor = remote.options(**self._actor_options[role, rank]).remote()
                self.children.append(RayChild(role, rank, actor))
        order = {"scheduler": 0, "server": 1, "worker": 2}
        self.children.sort(key=lambda c: (order[c.role], c.rank))
        wheres = self._wait_all([c.actor.where.remote() for c in self.children], "the actors to start")
        for child, where in zip(self.children, wheres):  # pid: the actor's, until its process starts
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
        cmd = [python, "-u", *cfg.entry(absolute=True), *cfg.args]
        threads, thread_line = self._threads()
        logger.info("%s", self._describe(thread_line))
        refs = []
        places = local_places([(c.rank, c.node.node_id) for c in self.children if c.role == "worker"])
        gpus = math.ceil(self.options.gpus_per_worker) or None  # a fraction of a GPU is still cuda:0
        for child in self.children:
            local_rank, local_size = (
                places.get(child.rank, (None, None)) if child.role == "worker" else (None, None)
            )
            spec = ClusterSpec(
                role=child.role,
                rank=child.rank,
                num_workers=cfg.num_workers,
                num_servers=cfg.num_servers,
                scheduler_host=scheduler.node.ip,
                scheduler_port=port,
                secret=secret,
                host=child.node.ip,
                local_rank=local_rank,
                local_world_size=local_size,
                gpus_per_worker=gpus if child.role == "worker" else None,
            )
            env = {**cfg.job_env(), **threads[child.role], **spec_to_env(spec), "PYTHONUNBUFFERED": "1"}
            if gpus and child.role != "worker":  # whatever Ray shows a GPU-less actor: none
                env["CUDA_VISIBLE_DEVICES"] = ""
            self._launch[child.role, child.rank] = (cmd, env)
            refs.append(child.actor.start.remote(cmd, env, os.getcwd()))
        for child, pid in zip(self.children, self._wait_all(refs, "the processes to start")):
            child.pid = pid
            child.poll_ref = child.actor.poll.remote(POLL_S)

    def restart(self, dead: RayChild) -> None:
        """A replacement of a dead worker: on its actor if that lives (the process died), else on a
        new actor in its bundle (lost with its node). Its start is awaited by the supervisor."""
        import ray

        key = (dead.role, dead.rank)
        actor = dead.actor
        if dead.lost is not None:
            actor = ray.remote(RoleProcess).options(**self._actor_options[key]).remote()
        child = RayChild(dead.role, dead.rank, actor)
        child.replacement = True
        child.node, child.node_label = dead.node, dead.node_label  # until it says where it runs
        cmd, env = self._launch[key]
        child.start_ref = actor.start_here.remote(cmd, env, os.getcwd())
        child.start_deadline = time.monotonic() + self.options.start_timeout_s
        self.children.append(child)

    def started(self, child: RayChild, where: dict[str, Any]) -> None:
        child.node, child.pid = NodeInfo(ip=where["ip"], node_id=where["node_id"]), where["pid"]
        known = [c.node for c in self.children if c.node.node_id != "?"]
        child.node_label = node_labels(known)[child.node.node_id]

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
            f"{self.scheduler_address}; timeout {timeout}{_describe_restarts(self.restarts)}\n"
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
            if self.interrupts.pending:
                raise _Interrupted
            if time.monotonic() >= deadline:
                raise RayJobError(f"waited {timeout_s} s for {what}")
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as exc:
            raise RayJobError(f"while waiting for {what}: {first_line(exc)}") from None

    def release(self) -> None:
        """Kills every actor (a child still alive dies with it) and removes the placement groups."""
        import ray
        from ray.util.placement_group import remove_placement_group

        # A process still running here (its start was interrupted, or it could not be reaped) has
        # its whole process group killed by its actor first: killing the actor alone would take
        # only the process itself (PR_SET_PDEATHSIG), not what it started.
        closing = [c.actor.close.remote() for c in self.children if c.running]
        if closing:
            with contextlib.suppress(Exception):
                ray.wait(closing, num_returns=len(closing), timeout=_CLOSE_WAIT_S)
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
            first = self.interrupts.first
            report, exit_code = _interrupted_report(first), interrupted_exit_code(first)
        elif outcome == "unstarted":
            report, exit_code = f"paratrain: could not start the job on Ray: {self.start_error}\n", 1
        elif outcome != "ok":
            failure = self.failure(outcome)
            report, exit_code = _failure_report(failure, self.failed, self.still_running), 1
        children = [c.record() for c in self.children]
        nodes = {c.label: c.node_label for c in self.children}
        return RayJobResult(exit_code, failure, report, children, self.scheduler_address, nodes)


def local_places(workers: Sequence[tuple[int, str]]) -> dict[int, tuple[int, int]]:
    """Each worker's (local rank, local world size) from the (rank, node id) of every worker: its
    index among the workers on its node, in rank order, and their count."""
    by_node: dict[str, list[int]] = {}
    for rank, node in sorted(workers):
        by_node.setdefault(node, []).append(rank)
    return {rank: (ranks.index(rank), len(ranks)) for ranks in by_node.values() for rank in ranks}


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


class _Interrupted(Exception):
    """Raised out of a startup wait when SIGINT or SIGTERM arrived (not a RayJobError: nothing
    went wrong with the cluster)."""


def _describe_restarts(restarts: Restarts) -> str:
    if not restarts.on:
        return ""
    return f"; elastic, a dead worker restarted up to {restarts.max_restarts} time(s) in all"


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


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
