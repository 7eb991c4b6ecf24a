"""What every engine of `paratrain launch --backend ...` is given, and what they share.

`LaunchConfig` is the job as the user asked for it, whatever runs it: the script, its arguments,
how many workers and servers, the strategy, extra environment. Each engine (engines/: what one must
do is engines/api.py) takes a LaunchConfig plus its own `*Options` and starts every role where that
engine puts processes. The helpers here are what engines would otherwise each write again: the
strategy checked before anything starts, and each process's share of its host's cores.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# paratrain's identity variables: an engine sets them for each process, and a value inherited from
# the launching shell, or given in a job's env, would describe some other job's process.
IDENTITY_VARS = frozenset(
    {
        "PARATRAIN_ROLE",
        "PARATRAIN_RANK",
        "PARATRAIN_NUM_WORKERS",
        "PARATRAIN_NUM_SERVERS",
        "PARATRAIN_SCHEDULER",
        "PARATRAIN_SECRET",
        "PARATRAIN_SECRET_FILE",
        "PARATRAIN_HOST",
        "PARATRAIN_LAUNCHER_PID",
        "PARATRAIN_SCHEDULER_FD",
    }
)

# The variables that set a process's intra-op threads; a user who set any of them chose for us.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class LaunchConfig:
    """One job: which script runs as which roles, whatever engine starts them."""

    script: str
    """Path of the Python script every process runs (with `module`: a module's name)."""
    args: tuple[str, ...] = ()
    """Arguments passed to the script, unparsed."""
    num_workers: int = 2
    """Number of worker processes (>= 1)."""
    num_servers: int = 1
    """Number of server processes (>= 0; 0 is a collective-only job)."""
    strategy: str | None = None
    """The Trainer's strategy (PARATRAIN_STRATEGY), checked here so that a typo fails before any
    process starts; None: dist_sync with servers, collective without."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables for every process (paratrain's identity variables win)."""
    timeout_s: float | None = None
    """Limit on the whole job; None waits forever."""
    python: str = sys.executable
    """The interpreter that runs the script (on every host)."""
    server_losses: int = 0
    """Servers that may die without failing the job (replicated servers: JobConfig.replication - 1)."""
    elastic: bool = False
    """A worker's death does not stop the job: the scheduler drops it (the script sets
    JobConfig.elastic, and the scheduler stops the job below min_workers)."""
    max_restarts: int = 0
    """How many times a dead worker process is started again (implies `elastic`): in all under the
    local and Ray engines, per worker task under Slurm (restarts.py says why)."""
    module: bool = False
    """`script` is a module, run as `python -m script` (from the launch's directory)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "script", os.fspath(self.script))
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "env", dict(self.env))
        if not self.script:
            raise ValueError(f"script must be a path, got {self.script!r}")
        for name, value in (("num_workers", self.num_workers), ("num_servers", self.num_servers)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.num_servers < 0:
            raise ValueError(f"num_servers must be >= 0, got {self.num_servers}")
        if not isinstance(self.server_losses, int) or not 0 <= self.server_losses < max(1, self.num_servers):
            raise ValueError(
                f"server_losses must be an int >= 0 and below num_servers, got {self.server_losses!r}"
            )
        if not isinstance(self.elastic, bool):
            raise TypeError(f"elastic must be a bool, got {self.elastic!r}")
        restarts = self.max_restarts
        if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")
        self.warnings()  # raises about a strategy that cannot run
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s!r}")

    def warnings(self) -> list[str]:
        """What the launcher should tell the user before starting this (valid) job: settings that
        leave processes idle. Raises ValueError about a strategy that cannot run (`check_strategy`)."""
        if self.strategy is None:
            return []
        return check_strategy(self.strategy, self.num_servers, self.num_workers)

    def entry(self, absolute: bool = False) -> list[str]:
        """What the interpreter is given before the arguments: the script's path (made absolute
        with `absolute`, for a process that starts elsewhere), or -m and the module."""
        if self.module:
            return ["-m", self.script]
        return [os.path.abspath(self.script) if absolute else self.script]

    def job_env(self) -> dict[str, str]:
        """The variables every process gets besides its identity: env plus the strategy."""
        env = dict(self.env)
        if self.strategy is not None:
            env["PARATRAIN_STRATEGY"] = self.strategy
        return env


def check_strategy(name: str, num_servers: int, num_workers: int = 1) -> list[str]:
    """Checks a job's strategy before any process starts: raises ValueError naming the strategy
    and the cause if it does not parse (a misspelt name, field or value gets the nearest valid
    one), needs servers the job lacks, or cuts the model into a number of pipeline stages (or
    tensor-parallel groups) that does not divide the workers. Returns warnings about a valid job
    that would leave processes idle."""
    from paratrain.train.strategy import Strategy  # train/ is below launch/; imported late for speed

    try:
        strategy = Strategy.parse(name)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"strategy={name!r}: {exc}") from None
    arch, stages = strategy.architecture, strategy.pipeline_stages
    if arch in ("ps", "hybrid") and num_servers == 0:
        raise ValueError(
            f"strategy={name!r} is a {arch} strategy and needs servers, but num_servers=0 (-s 0); "
            "launch with -s 1 or more, or use strategy 'collective'"
        )
    if num_workers % stages:
        fits = ", ".join(str(stages * k) for k in range(1, 4))
        raise ValueError(
            f"strategy={name!r}: pipeline_stages={stages} does not divide the job's {num_workers} "
            f"worker(s) (-w {num_workers}): each replica of the model runs on {stages} workers, so "
            f"launch with -w {fits}, ..."
        )
    if strategy.tensor_parallel > 1:
        from paratrain.train.mesh import mesh_dims

        try:
            mesh_dims(strategy, num_workers)
        except ValueError as exc:
            raise ValueError(f"strategy={name!r}: {exc}") from None
    if arch in ("collective", "local", "fsdp") and num_servers:
        return [
            f"strategy={name!r} is a {arch} strategy and uses no servers: the job's {num_servers} "
            "server(s) will be idle (launch with -s 0)"
        ]
    return []


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or cgroup narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def thread_env(cores: int, processes: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """OMP_NUM_THREADS (and MKL_NUM_THREADS) for one of `processes` processes sharing `cores` cores:
    its share, at least 1. Empty when the user already set either in `env` (default os.environ).

    Why: torch starts one intra-op thread per core in every process; with several processes per host
    they oversubscribe the cores. Measured on 2 cores, the digits job took 7.0 s under dist_sync and
    18-41 s under dist_async with torch's default, against 1.7 s and 2.2 s with one thread each.
    """
    env = os.environ if env is None else env
    if any(env.get(name) for name in THREAD_VARS):
        return {}
    share = str(max(1, cores // max(1, processes)))
    return {name: share for name in THREAD_VARS}


def describe_threads(chosen: Mapping[str, str], cores: int, processes: int, where: str = "host") -> str:
    """The line an engine prints about the thread count it chose (or left to the user)."""
    if not chosen:
        return "threads per process: as set by the user (OMP_NUM_THREADS/MKL_NUM_THREADS)"
    return (
        f"threads per process: OMP_NUM_THREADS={chosen['OMP_NUM_THREADS']} ({cores} cores per {where}, "
        f"{processes} processes; set OMP_NUM_THREADS to choose otherwise)"
    )
