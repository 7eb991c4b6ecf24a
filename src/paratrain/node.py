"""`paratrain.init()`: every process of a job runs the same script and calls it first.

On the scheduler and on servers it serves until the job ends and then exits the process; on a worker it
registers with the scheduler and returns a `Context`. Without any cluster variables in the environment
it returns a single-process context, so the same script also runs alone.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import threading
from collections.abc import Callable
from types import TracebackType

from paratrain.cluster import stacks
from paratrain.cluster.agent import SchedulerLink
from paratrain.cluster.config import JobConfig
from paratrain.cluster.context import Context
from paratrain.cluster.scheduler import Scheduler
from paratrain.cluster.spec import ClusterSpec, spec_from_env
from paratrain.transport.handshake import NoGreeting, NotParatrain
from paratrain.transport.ports import TAKEN, PortUnavailable, binding, unavailable
from paratrain.transport.rpc import RpcServer

logger = logging.getLogger(__name__)

__all__ = ["Context", "init"]


_context: Context | None = None
_lock = threading.Lock()


def init(config: JobConfig | None = None) -> Context:
    """Join the job this process belongs to (see module docstring). Idempotent on workers."""
    global _context
    with _lock:
        if _context is not None:
            return _context
        config = config or JobConfig()
        spec = _read_spec()
        if spec is None:
            _context = Context("worker", 0, 1, 0, config=config)
            return _context
        _setup_logging(spec)
        stacks.install()
        logger.info("starting: %s %s", spec, config)
        atexit.register(_freeze_before_shutdown)
        if spec.role == "scheduler":
            sys.exit(_schedule(spec, config)())
        if spec.role == "server":
            sys.exit(_serve(spec, config))
        _context = _join_as_worker(spec, config)
        return _context


_LOCAL_RANKS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


def _read_spec() -> ClusterSpec | None:
    """spec_from_env, where a mistake in the environment (no secret, say) ends the process with one
    line: every process that torchrun, srun or mpirun started has the same mistake, and as many
    tracebacks of it bury the line that says what to do. Under those launchers only the first
    process of each host says it; the others exit with status 1 as well, quietly."""
    try:
        return spec_from_env()
    except ValueError as exc:
        foreign = "PARATRAIN_LAUNCHER_PID" not in os.environ  # paratrain's launcher names each child
        first = all(os.environ.get(name, "0") in ("", "0") for name in _LOCAL_RANKS)
        sys.exit(f"paratrain: {exc}" if first or not foreign else 1)


def _freeze_before_shutdown() -> None:
    """Runs at exit, after the handlers registered later (the worker's leave-the-job hook, the
    kvstore's close, the user's). The interpreter's last garbage collections then skip every object
    alive now instead of walking all that `import torch` made. Measured on the loaded 2-core test
    machine: `import torch` then exit ends 2.0 s after the script instead of 6.5 s; a 6-step
    dist_sync parity job (2 workers, 1 server) spends 12 CPU-s instead of 16. Objects alive now are
    still freed by reference counting as modules are cleared; only cycles among them stay for the OS."""
    gc.freeze()


def _setup_logging(spec: ClusterSpec) -> None:
    root = logging.getLogger()
    if root.handlers:
        return  # the script configured logging itself
    rank = "?" if spec.rank is None else spec.rank
    # paratrain's launchers (local, Ray) put "[role rank] " before every line a child writes.
    who = "" if spec.launcher_pid is not None else f"[{spec.role} {rank}] "
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s")


def _schedule(spec: ClusterSpec, config: JobConfig, embedded: bool = False) -> Callable[[], int]:
    """The scheduler, bound and ready to run, with the dashboard (PARATRAIN_DASHBOARD) and its
    timeline (PARATRAIN_TRACE_DIR) where the launcher asked for them (metrics/observe.py). Embedded
    in a worker or server, the process's timeline is that node's."""
    from paratrain.metrics import observe

    with binding(spec.host, spec.scheduler_port, _scheduler_port_setting(spec)):
        scheduler = Scheduler(spec, config, log_dir=os.environ.get("PARATRAIN_LOG_DIR"))
    dashboard = observe.start_dashboard(scheduler, spec.secret, os.environ)
    trace = observe.tracer() if embedded else observe.start_trace(os.environ, "scheduler", 0)

    def run() -> int:
        try:
            with trace.range("job"):
                return scheduler.run()
        finally:
            if dashboard is not None:
                dashboard.linger_then_close()

    return run


def _scheduler_port_setting(spec: ClusterSpec) -> str:
    """What changes the scheduler's port, said in the error when it is taken."""
    if os.environ.get("PARATRAIN_SCHEDULER"):
        return "set PARATRAIN_SCHEDULER to another HOST:PORT"
    master = os.environ.get("MASTER_PORT", "")
    if master.isdigit() and spec.scheduler_port == int(master) + 1:
        return (
            "the scheduler listens on MASTER_PORT+1: choose another MASTER_PORT, or set "
            "PARATRAIN_SCHEDULER=HOST:PORT"
        )
    return "set PARATRAIN_SCHEDULER=HOST:PORT to another port"


def _link(spec: ClusterSpec, config: JobConfig, report: Callable[[], dict]) -> SchedulerLink:
    """The link to the scheduler. A listener there that sends no paratrain greeting, or another
    one, is another program on the scheduler's port (the rank that runs the scheduler found it
    taken and said so): this rank says the same, in one line, rather than wait out connect_timeout_s."""
    try:
        return SchedulerLink(spec, config, report=report)
    except (NoGreeting, NotParatrain) as exc:
        port_taken = unavailable(
            spec.scheduler_host, spec.scheduler_port, TAKEN, _scheduler_port_setting(spec)
        )
        logger.info("no greeting from the scheduler's port: %s", exc)
        raise SystemExit(f"paratrain: {port_taken}") from None


def _start_embedded_scheduler(spec: ClusterSpec, config: JobConfig) -> threading.Thread | None:
    """Where no scheduler process exists (TF_CONFIG, torchrun, Slurm, MPI), one worker or server
    runs it in a thread (see cluster/spec.py)."""
    if not spec.embedded_scheduler:
        return None
    try:
        run = _schedule(spec, config, embedded=True)
    except PortUnavailable as exc:  # one line, not a traceback through the user's script; the
        raise SystemExit(f"paratrain: {exc}") from None  # launcher (torchrun) then stops the others
    thread = threading.Thread(target=run, name="scheduler", daemon=True)
    thread.start()
    return thread


def _serve(spec: ClusterSpec, config: JobConfig) -> int:
    from paratrain.kvstore.server import faults, rejoin
    from paratrain.kvstore.server.replica import Replicator
    from paratrain.kvstore.server.report import server_report
    from paratrain.kvstore.server.server import KVServer  # servers serve the kvstore (and "ping")
    from paratrain.metrics import observe

    scheduler_thread = _start_embedded_scheduler(spec, config)
    kv = KVServer(spec.rank or 0, replicator=Replicator(spec.rank or 0, spec.secret, config.transport))
    trace = observe.start_trace(os.environ, "server", spec.rank or 0)
    kill_at = faults.kill_at(spec.rank or 0)  # tests only: a server lost at a chosen moment
    server = RpcServer(
        spec.secret,
        faults.armed(observe.traced(kv, trace), kill_at),
        host=spec.host,
        config=config.transport,
        name=f"server {spec.rank}",
    ).start()
    link = _link(spec, config, lambda: server_report(kv))
    if config.elastic is not None:  # rounds complete with the workers that are left
        link.on_members(lambda m: kv.set_members(m.workers, m.joiners))
    if config.replication > 1:  # a lost server: no copies to it, none taken from it (fence.py)
        link.on_server_lost(kv.replicator.server_lost)
    faults.at(kill_at, "start")
    roster = link.register("server", port=server.port)
    faults.at(kill_at, "started")
    if not roster.joined:  # servers lost before the start: no copies to them (one may never have registered)
        for rank, why in list(link.lost_servers.items()):
            kv.replicator.server_lost(rank, why)
    if roster.joined:  # restarted into a running replicated job: catch up, then count as a copy
        kv.replicator.configure(config.replication, roster.servers)
        rejoin.catch_up(kv, list(roster.lost), config.transport.request_timeout_s)
        link.caught_up()
    observe.align_trace(trace, link)
    link.shutdown.wait()
    kv.replicator.close()
    server.close()
    kv.close()
    link.close()
    if scheduler_thread is not None:  # it has told every node; let it finish and release its port
        scheduler_thread.join(config.finish_timeout_s + config.heartbeat_timeout_s)
    return 0


def _join_as_worker(spec: ClusterSpec, config: JobConfig) -> Context:
    from paratrain.metrics import observe
    from paratrain.metrics.telemetry import worker_telemetry

    scheduler_thread = _start_embedded_scheduler(spec, config)
    link = _link(spec, config, worker_telemetry().report)
    roster = link.register("worker")
    stacks.set_asker(link.ask_for_stacks)
    observe.align_trace(observe.start_trace(os.environ, "worker", roster.rank), link)
    _install_exit_hooks(link, scheduler_thread, config)
    return Context(
        role="worker",
        rank=roster.rank,
        num_workers=spec.num_workers,
        num_servers=spec.num_servers,
        servers=roster.servers,
        config=config,
        spec=spec,
        link=link,
        joined=roster.joined,
    )


def _install_exit_hooks(
    link: SchedulerLink, scheduler_thread: threading.Thread | None, config: JobConfig
) -> None:
    """A worker that ends normally tells the scheduler it finished; one that dies of an exception
    just closes, and the scheduler aborts the job naming it."""
    failed = threading.Event()
    previous_hook = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        failed.set()
        previous_hook(kind, value, tb)

    def at_exit() -> None:
        if failed.is_set():
            link.close()
            return
        link.finish()
        if scheduler_thread is not None:
            scheduler_thread.join(config.finish_timeout_s + config.heartbeat_timeout_s)

    sys.excepthook = excepthook
    atexit.register(at_exit)
