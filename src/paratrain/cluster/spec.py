"""The cluster spec: who is where, read from the environment by one function.

Environment variables carry process identity only (role, rank, counts, the scheduler's address,
the job secret); everything else a job is configured with lives in the script's `JobConfig`.
`spec_from_env` reads them; `spec_to_env` writes paratrain's own variables for the launcher.

paratrain's own variables (what `paratrain launch` sets):

    PARATRAIN_ROLE          scheduler | server | worker
    PARATRAIN_RANK          rank within the role (optional: else the scheduler assigns one)
    PARATRAIN_NUM_WORKERS   number of workers (>= 1)
    PARATRAIN_NUM_SERVERS   number of servers (>= 0; 0 is a collective-only job)
    PARATRAIN_SCHEDULER     host:port of the scheduler ([::1]:5000 for IPv6)
    PARATRAIN_SECRET        the per-job secret, hex, at least 16 bytes (or PARATRAIN_SECRET_FILE)
    PARATRAIN_HOST          the address this process binds and advertises (default 127.0.0.1)
    PARATRAIN_LAUNCHER_PID  set by the local launcher: exit if that process goes away
    PARATRAIN_SCHEDULER_FD  set by the local launcher: an inherited, already listening socket
    PARATRAIN_GPUS_PER_WORKER  set by a launcher that gave each worker GPUs of its own (it made only
                            those visible, CUDA_VISIBLE_DEVICES): the worker trains on cuda:0; 0 is
                            the CPU. Unset: every GPU of the host is visible to every process.

A worker's place on its host (every convention): LOCAL_RANK and LOCAL_WORLD_SIZE as torchrun sets
them; else Slurm's SLURM_LOCALID (with SLURM_STEP_TASKS_PER_NODE and SLURM_NODEID), Open MPI's
OMPI_COMM_WORLD_LOCAL_RANK/_SIZE, MPICH's MPI_LOCALRANKID/MPI_LOCALNRANKS; else unknown (the
Context then takes the worker's rank among the job's workers, as on one host).

Other launchers' conventions are accepted too; the first whose marker is set wins, in this order:

    paratrain   PARATRAIN_ROLE (above)
    dmlc        DMLC_ROLE, as MXNet/ps-lite set it: DMLC_PS_ROOT_URI/PORT, DMLC_NUM_WORKER/SERVER,
                DMLC_NODE_HOST, DMLC_WORKER_ID / DMLC_SERVER_ID
    tf_config   TF_CONFIG: chief and workers are workers (the chief is worker 0), ps tasks servers
    torchrun    RANK + WORLD_SIZE, with MASTER_ADDR/MASTER_PORT
    slurm       SLURM_PROCID + SLURM_NTASKS
    mpi         OMPI_COMM_WORLD_RANK + OMPI_COMM_WORLD_SIZE, or PMI_RANK + PMI_SIZE

Servers under torchrun, Slurm and MPI: these start N processes of one kind and number them
0..N-1 (the global rank). With PARATRAIN_NUM_SERVERS=S set (default 0), S of them become servers:
server j is global rank floor((j + 1) * N / S) - 1, the last rank of each of S equal blocks of
ranks. Every one of these launchers numbers ranks node by node (torchrun always; srun and mpirun
with their default block distribution), so the servers spread over the nodes as evenly as the
counts allow (`torchrun --nnodes 2 --nproc_per_node 4` with S=2: ranks 3 and 7, one per node)
rather than crowding the first node, and each node keeps its low ranks as workers. The other ranks
are workers, numbered 0.. in global-rank order, so global rank 0 is worker 0 whenever S <= N/2.
`server_ranks(N, S)` gives the list.

TF_CONFIG, torchrun, Slurm and MPI start no scheduler process: one process runs it embedded in a
thread, whatever its role. Under TF_CONFIG that is worker 0, at worker 0's listed address; under
torchrun, Slurm and MPI it is global rank 0 (the process at MASTER_ADDR), at MASTER_ADDR and
MASTER_PORT+1 (MASTER_PORT itself is torch.distributed's store), or at PARATRAIN_SCHEDULER if set.
Under Slurm, MASTER_ADDR defaults to the first host of the step's node list and MASTER_PORT to
20000 + SLURM_JOB_ID % 20000 (the same on every task of a job, and apart for concurrent jobs).

A process's own address (the one it binds and advertises): PARATRAIN_HOST if set; else what its
convention names (DMLC_NODE_HOST, TF_CONFIG's entry; the scheduler's own address for the
scheduler); else the local address this host routes to the scheduler's host from (127.0.0.1 for a
scheduler on loopback), so that processes on several machines advertise addresses their peers can
reach with no setting. In every convention the secret comes from PARATRAIN_SECRET(_FILE), and
PARATRAIN_LAUNCHER_PID/PARATRAIN_SCHEDULER_FD are read. A variable set to the empty string counts
as unset.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

ROLES = ("scheduler", "server", "worker")
SOURCES = ("paratrain", "dmlc", "tf_config", "torchrun", "slurm", "mpi")
MIN_SECRET_BYTES = 16

# Exit status of a process that stopped because the scheduler aborted the job for another node's
# failure: the launcher reports such exits as consequences, never as the first failure.
EXIT_ABORTED = 75


@dataclass(frozen=True)
class ClusterSpec:
    """This process's place in the job, as resolved from the environment."""

    role: str
    """`scheduler`, `server` or `worker`."""
    rank: int | None
    """Rank within the role; None lets the scheduler assign one at registration."""
    num_workers: int
    num_servers: int
    scheduler_host: str
    scheduler_port: int
    secret: bytes = field(repr=False)
    """The per-job secret every connection authenticates with (at least 16 bytes; never printed)."""
    host: str = "127.0.0.1"
    """The address this process binds its listening sockets to and advertises to peers."""
    source: str = "paratrain"
    """Which convention the spec was read from: paratrain, dmlc, tf_config, torchrun, slurm, mpi."""
    embedded_scheduler: bool = False
    """True where no separate scheduler process exists (TF_CONFIG, torchrun, Slurm, MPI) and this
    process runs it in a thread at scheduler_host:scheduler_port (worker 0 under TF_CONFIG, global
    rank 0 under the others, whatever its role)."""
    launcher_pid: int | None = None
    scheduler_fd: int | None = None
    local_rank: int | None = None
    """This process's index among the processes of its host (LOCAL_RANK); None: unknown."""
    local_world_size: int | None = None
    """How many processes of the job run on this host (LOCAL_WORLD_SIZE); None: unknown."""
    gpus_per_worker: int | None = None
    """GPUs the launcher made visible to this worker alone; None: every GPU of the host is visible."""

    def __post_init__(self) -> None:
        _check_choice("role", self.role, ROLES)
        _check_range("num_workers", self.num_workers, 1)
        _check_range("num_servers", self.num_servers, 0)
        _check_place(self.role, self.rank, self.num_workers, self.num_servers, _FIELD_NAMES)
        _check_range("scheduler_port", self.scheduler_port, 1, 65535)
        _check_choice("source", self.source, SOURCES)
        if self.embedded_scheduler and (self.role == "scheduler" or self.rank is None):
            raise ValueError(
                f"embedded_scheduler=True on {self.role} rank={self.rank}: only a worker or server "
                f"with a known rank runs it"
            )
        if len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(f"secret is {len(self.secret)} bytes; it must be at least {MIN_SECRET_BYTES}")
        if self.local_world_size is not None:
            _check_range("local_world_size", self.local_world_size, 1)
        if self.local_rank is not None:
            _check_range("local_rank", self.local_rank, 0, (self.local_world_size or self.local_rank + 1) - 1)
        if self.gpus_per_worker is not None:
            _check_range("gpus_per_worker", self.gpus_per_worker, 0)

    @property
    def scheduler_address(self) -> str:
        return _join_address(self.scheduler_host, self.scheduler_port)


@dataclass(frozen=True)
class _Place:
    """What one convention says about this process; the secret and overrides are common to all."""

    role: str
    rank: int | None
    num_workers: int
    num_servers: int
    scheduler_host: str
    scheduler_port: int
    host: str | None = None
    """None: PARATRAIN_HOST, else the local address that routes to the scheduler's host."""
    embedded_scheduler: bool = False
    host_var: str = "PARATRAIN_SCHEDULER"
    """The variable that named the scheduler's host (in the message when it cannot be routed to)."""


# The names _check_place uses in its messages: (role, rank, num_servers).
_FIELD_NAMES = ("role", "rank", "num_servers")


def spec_from_env(env: Mapping[str, str] | None = None) -> ClusterSpec | None:
    """Read this process's ClusterSpec from env (default os.environ). Returns None when no
    convention's variables are present (a plain single-process run).

    Raises ValueError naming the variable and its value for anything missing, malformed or
    inconsistent (the secret's value is never shown).
    """
    env = os.environ if env is None else env
    for source, markers, read in _CONVENTIONS:
        if all(_get(env, name) is not None for name in markers):
            return _finish(env, read(env), source)
    return None


def spec_to_env(spec: ClusterSpec) -> dict[str, str]:
    """The PARATRAIN_* variables that make spec_from_env return this spec (used by the launcher).
    The secret goes out as hex. Omit rank when None, launcher_pid/scheduler_fd when None.

    The local rank and size go out as LOCAL_RANK and LOCAL_WORLD_SIZE, as torchrun names them.
    The result reads back with source="paratrain" whatever spec.source was. paratrain's variables
    cannot say embedded_scheduler, so such a spec raises ValueError.
    """
    if spec.embedded_scheduler:
        raise ValueError("spec_to_env cannot express embedded_scheduler=True in PARATRAIN_* variables")
    env = {
        "PARATRAIN_ROLE": spec.role,
        "PARATRAIN_NUM_WORKERS": str(spec.num_workers),
        "PARATRAIN_NUM_SERVERS": str(spec.num_servers),
        "PARATRAIN_SCHEDULER": spec.scheduler_address,
        "PARATRAIN_SECRET": spec.secret.hex(),
        "PARATRAIN_HOST": spec.host,
    }
    optional = {
        "PARATRAIN_RANK": spec.rank,
        "PARATRAIN_LAUNCHER_PID": spec.launcher_pid,
        "PARATRAIN_SCHEDULER_FD": spec.scheduler_fd,
        "LOCAL_RANK": spec.local_rank,
        "LOCAL_WORLD_SIZE": spec.local_world_size,
        "PARATRAIN_GPUS_PER_WORKER": spec.gpus_per_worker,
    }
    env.update({name: str(value) for name, value in optional.items() if value is not None})
    return env


def _finish(env: Mapping[str, str], place: _Place, source: str) -> ClusterSpec:
    """Add what every convention shares: the secret, the host override, the launcher's handles."""
    return ClusterSpec(
        role=place.role,
        rank=place.rank,
        num_workers=place.num_workers,
        num_servers=place.num_servers,
        scheduler_host=place.scheduler_host,
        scheduler_port=place.scheduler_port,
        secret=_read_secret(env),
        host=_get(env, "PARATRAIN_HOST") or place.host or own_address(place.scheduler_host, place.host_var),
        source=source,
        embedded_scheduler=place.embedded_scheduler,
        launcher_pid=_optional_int(env, "PARATRAIN_LAUNCHER_PID", 1),
        scheduler_fd=_optional_int(env, "PARATRAIN_SCHEDULER_FD", 0),
        **_local_place(env),
        gpus_per_worker=_optional_int(env, "PARATRAIN_GPUS_PER_WORKER", 0),
    )


# Where each launcher says a process's place on its host: (local rank, local size) variables.
_LOCAL_PLACES = (
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("SLURM_LOCALID", None),
)


def _local_place(env: Mapping[str, str]) -> dict[str, int | None]:
    """local_rank and local_world_size from the first launcher's variables that are set (see the
    module docstring); None for what none of them says."""
    for rank_var, size_var in _LOCAL_PLACES:
        local_rank = _optional_int(env, rank_var, 0)
        if local_rank is None:
            continue
        size = _optional_int(env, size_var, 1) if size_var else _slurm_tasks_here(env)
        if size is not None and local_rank >= size:
            raise ValueError(f"{rank_var}={local_rank} is out of range for {size_var or 'this node'}={size}")
        return {"local_rank": local_rank, "local_world_size": size}
    return {"local_rank": None, "local_world_size": None}


def _slurm_tasks_here(env: Mapping[str, str]) -> int | None:
    """This node's task count from SLURM_STEP_TASKS_PER_NODE (`2(x3),1`: 2 on each of the first
    three nodes, then 1) at SLURM_NODEID; None where either is missing."""
    text, node = _get(env, "SLURM_STEP_TASKS_PER_NODE"), _optional_int(env, "SLURM_NODEID", 0)
    if text is None or node is None:
        return None
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={text!r} is not a Slurm task count list")
        counts += [int(match[1])] * int(match[2] or 1)
    if node >= len(counts):
        raise ValueError(f"SLURM_NODEID={node} is out of range for SLURM_STEP_TASKS_PER_NODE={text!r}")
    return counts[node]


# ---- the conventions ---------------------------------------------------------------------------


def _read_paratrain(env: Mapping[str, str]) -> _Place:
    role = _check_choice("PARATRAIN_ROLE", _get(env, "PARATRAIN_ROLE"), ROLES)
    because = f"PARATRAIN_ROLE={role!r} needs it"
    num_workers = _required_int(env, "PARATRAIN_NUM_WORKERS", because, 1)
    num_servers = _required_int(env, "PARATRAIN_NUM_SERVERS", because, 0)
    rank = _optional_int(env, "PARATRAIN_RANK")
    names = ("PARATRAIN_ROLE", "PARATRAIN_RANK", "PARATRAIN_NUM_SERVERS")
    _check_place(role, rank, num_workers, num_servers, names)
    scheduler_host, scheduler_port = _parse_address(
        "PARATRAIN_SCHEDULER", _require(env, "PARATRAIN_SCHEDULER", because)
    )
    host = scheduler_host if role == "scheduler" else None
    return _Place(role, rank, num_workers, num_servers, scheduler_host, scheduler_port, host)


def _read_dmlc(env: Mapping[str, str]) -> _Place:
    role = _check_choice("DMLC_ROLE", _get(env, "DMLC_ROLE"), ROLES)
    because = f"DMLC_ROLE={role!r} needs it"
    num_workers = _required_int(env, "DMLC_NUM_WORKER", because, 1)
    num_servers = _required_int(env, "DMLC_NUM_SERVER", because, 0)
    rank_var = {"worker": "DMLC_WORKER_ID", "server": "DMLC_SERVER_ID"}.get(role)
    rank = 0 if rank_var is None else _optional_int(env, rank_var)
    _check_place(role, rank, num_workers, num_servers, ("DMLC_ROLE", rank_var or "rank", "DMLC_NUM_SERVER"))
    scheduler_host = _require(env, "DMLC_PS_ROOT_URI", because)
    scheduler_port = _required_int(env, "DMLC_PS_ROOT_PORT", because, 1, 65535)
    host = _get(env, "DMLC_NODE_HOST") or (scheduler_host if role == "scheduler" else None)
    return _Place(
        role,
        rank,
        num_workers,
        num_servers,
        scheduler_host,
        scheduler_port,
        host,
        host_var="DMLC_PS_ROOT_URI",
    )


_TF_TASK_TYPES = ("chief", "worker", "ps")


def _read_tf_config(env: Mapping[str, str]) -> _Place:
    cluster, task = _parse_tf_config(env["TF_CONFIG"])
    task_type, index = _tf_task(task, cluster)
    chief, workers, ps = (cluster[kind] for kind in _TF_TASK_TYPES)
    if len(chief) > 1:
        raise ValueError(f"TF_CONFIG cluster.chief has {len(chief)} entries; at most 1 is allowed")
    if not chief + workers:
        raise ValueError("TF_CONFIG cluster has no chief or worker entry; a job needs a worker")
    scheduler_host, scheduler_port = (chief + workers)[0]
    if task_type == "ps":
        role, rank = "server", index
    elif task_type == "chief":
        role, rank = "worker", 0
    else:
        role, rank = "worker", index + len(chief)
    return _Place(
        role,
        rank,
        num_workers=len(chief) + len(workers),
        num_servers=len(ps),
        scheduler_host=scheduler_host,
        scheduler_port=scheduler_port,
        host=cluster[task_type][index][0],
        embedded_scheduler=role == "worker" and rank == 0,
    )


def _parse_tf_config(text: str) -> tuple[dict[str, list[tuple[str, int]]], dict[str, object]]:
    """TF_CONFIG's cluster as {task type: [(host, port), ...]} and its task object."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"TF_CONFIG={text!r} is not valid JSON ({exc})") from None
    if not (
        isinstance(config, dict)
        and isinstance(config.get("cluster"), dict)
        and isinstance(config.get("task"), dict)
    ):
        raise ValueError(f"TF_CONFIG={text!r} is not a JSON object with 'cluster' and 'task' objects")
    cluster: dict[str, list[tuple[str, int]]] = {}
    for kind in _TF_TASK_TYPES:
        entries = config["cluster"].get(kind, [])
        if not (isinstance(entries, list) and all(isinstance(e, str) for e in entries)):
            raise ValueError(f"TF_CONFIG cluster.{kind}={entries!r} is not a list of host:port strings")
        name = f"TF_CONFIG cluster.{kind}"
        cluster[kind] = [_parse_address(f"{name}[{i}]", e) for i, e in enumerate(entries)]
    return cluster, config["task"]


def _tf_task(task: Mapping[str, object], cluster: Mapping[str, Sequence[object]]) -> tuple[str, int]:
    task_type = _check_choice("TF_CONFIG task.type", task.get("type"), _TF_TASK_TYPES)
    if task.get("index") is None:
        raise ValueError("TF_CONFIG task.index is not set")
    index = _parse_int("TF_CONFIG task.index", str(task["index"]))
    count = len(cluster[task_type])
    if not 0 <= index < count:
        raise ValueError(
            f"TF_CONFIG task.index={index} is out of range for "
            f"{_count(count, task_type + ' entry')}{_span(count)}"
        )
    return task_type, index


def server_ranks(world_size: int, num_servers: int) -> list[int]:
    """The global ranks that become servers when a launcher starts world_size processes of one kind:
    the last rank of each of num_servers equal blocks (see the module docstring for why)."""
    return [(j + 1) * world_size // num_servers - 1 for j in range(num_servers)]


def _read_global_ranks(env: Mapping[str, str], rank_var: str, size_var: str) -> _Place:
    """torchrun, Slurm, MPI: PARATRAIN_NUM_SERVERS of the processes are servers, the rest workers,
    and global rank 0 runs the scheduler."""
    world_size = _parse_int(size_var, env[size_var], 1)
    global_rank = _parse_int(rank_var, env[rank_var])
    _check_range(rank_var, global_rank, 0, world_size - 1)
    num_servers = _optional_int(env, "PARATRAIN_NUM_SERVERS", 0) or 0
    if num_servers >= world_size:
        raise ValueError(
            f"PARATRAIN_NUM_SERVERS={num_servers} leaves no worker among {size_var}={world_size} "
            f"processes; it must be at most {world_size - 1}"
        )
    servers = server_ranks(world_size, num_servers)
    if global_rank in servers:
        role, rank = "server", servers.index(global_rank)
    else:
        role, rank = "worker", global_rank - sum(r < global_rank for r in servers)
    because = f"{rank_var} is set"
    scheduler_host, scheduler_port, host_var = _embedded_scheduler_address(env, because, rank_var)
    return _Place(
        role,
        rank,
        world_size - num_servers,
        num_servers,
        scheduler_host,
        scheduler_port,
        embedded_scheduler=global_rank == 0,
        host_var=host_var,
    )


def _embedded_scheduler_address(env: Mapping[str, str], because: str, rank_var: str) -> tuple[str, int, str]:
    """PARATRAIN_SCHEDULER if set, else MASTER_ADDR:MASTER_PORT+1 (torch.distributed's store has
    MASTER_PORT); under Slurm these two default to the step's first node and a port from the job id.
    Also returns the name of the variable that gave the host."""
    explicit = _get(env, "PARATRAIN_SCHEDULER")
    if explicit is not None:
        return (*_parse_address("PARATRAIN_SCHEDULER", explicit), "PARATRAIN_SCHEDULER")
    because = f"{because} and PARATRAIN_SCHEDULER is not"
    host, host_var = _get(env, "MASTER_ADDR"), "MASTER_ADDR"
    port = _optional_int(env, "MASTER_PORT", 1, 65535)
    if rank_var == "SLURM_PROCID":
        if host is None:
            host, host_var = _slurm_first_host(env, because)
        if port is None and _get(env, "SLURM_JOB_ID") is not None:
            port = 20000 + _parse_int("SLURM_JOB_ID", env["SLURM_JOB_ID"], 0) % 20000
    if host is None:
        _require(env, "MASTER_ADDR", because)
    if port is None:
        _require(env, "MASTER_PORT", because)
    assert host is not None and port is not None
    if port == 65535:
        raise ValueError("MASTER_PORT=65535 leaves no port for the scheduler (it uses MASTER_PORT+1)")
    return host, port + 1, host_var


def _slurm_first_host(env: Mapping[str, str], because: str) -> tuple[str, str]:
    """The first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST), where task 0 runs under the
    default block distribution. Slurm compresses the list (`node[01-04,07],gpu-a`); only its first
    name is needed, so this reads that much of Slurm's hostlist syntax rather than calling scontrol."""
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"):
        value = _get(env, name)
        if value is None:
            continue
        match = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", value)
        if not match:
            raise ValueError(f"{name}={value!r} is not a Slurm node list")
        return match[1] + (match[2] or ""), name
    raise ValueError(f"MASTER_ADDR is not set ({because}), nor SLURM_STEP_NODELIST or SLURM_JOB_NODELIST")


def own_address(peer_host: str, name: str = "PARATRAIN_SCHEDULER") -> str:
    """The local address this host sends from to reach peer_host (no packet is sent: a UDP socket's
    connect only picks the route). A peer on loopback gives loopback. `name` is the variable that
    named peer_host, for the message when it does not resolve or has no route."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(peer_host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ValueError(
            f"cannot find this host's address towards {name}={peer_host!r} ({exc}); set PARATRAIN_HOST "
            f"to the address this process should bind and advertise"
        ) from None


_Reader = Callable[[Mapping[str, str]], _Place]
_CONVENTIONS: tuple[tuple[str, tuple[str, ...], _Reader], ...] = (
    ("paratrain", ("PARATRAIN_ROLE",), _read_paratrain),
    ("dmlc", ("DMLC_ROLE",), _read_dmlc),
    ("tf_config", ("TF_CONFIG",), _read_tf_config),
    (
        "torchrun",
        ("RANK", "WORLD_SIZE"),
        partial(_read_global_ranks, rank_var="RANK", size_var="WORLD_SIZE"),
    ),
    (
        "slurm",
        ("SLURM_PROCID", "SLURM_NTASKS"),
        partial(_read_global_ranks, rank_var="SLURM_PROCID", size_var="SLURM_NTASKS"),
    ),
    (
        "mpi",
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        partial(_read_global_ranks, rank_var="OMPI_COMM_WORLD_RANK", size_var="OMPI_COMM_WORLD_SIZE"),
    ),
    (
        "mpi",
        ("PMI_RANK", "PMI_SIZE"),
        partial(_read_global_ranks, rank_var="PMI_RANK", size_var="PMI_SIZE"),
    ),
)


def client_credentials(env: Mapping[str, str] | None = None) -> tuple[str, int, bytes]:
    """(scheduler host, port, job secret) from PARATRAIN_SCHEDULER and PARATRAIN_SECRET(_FILE), for
    a process that talks to a running job without being one of its nodes (a serving process)."""
    env = os.environ if env is None else env
    address = _get(env, "PARATRAIN_SCHEDULER")
    if address is None:
        raise ValueError("PARATRAIN_SCHEDULER is not set: the running job's scheduler address (host:port)")
    host, port = _parse_address("PARATRAIN_SCHEDULER", address)
    return host, port, _read_secret(env)


# ---- the secret --------------------------------------------------------------------------------


def _read_secret(env: Mapping[str, str]) -> bytes:
    """PARATRAIN_SECRET or the content of PARATRAIN_SECRET_FILE, as bytes; never put in errors."""
    text, path = _get(env, "PARATRAIN_SECRET"), _get(env, "PARATRAIN_SECRET_FILE")
    origin = "PARATRAIN_SECRET"
    if text is not None and path is not None:
        raise ValueError("PARATRAIN_SECRET and PARATRAIN_SECRET_FILE are both set; set one")
    if path is not None:
        try:
            text = Path(path).read_bytes().decode("ascii", errors="replace").strip()
        except OSError as exc:
            raise ValueError(f"PARATRAIN_SECRET_FILE={path!r} cannot be read ({exc.strerror})") from None
        origin = f"the content of PARATRAIN_SECRET_FILE={path!r}"
    if text is None:
        raise ValueError(
            f"PARATRAIN_SECRET is not set: a distributed job needs a per-job secret of at least "
            f"{MIN_SECRET_BYTES} bytes as hex ({2 * MIN_SECRET_BYTES}+ hex digits, e.g. from "
            f"`python -c 'import secrets; print(secrets.token_hex(32))'`), in PARATRAIN_SECRET or "
            f"in a file named by PARATRAIN_SECRET_FILE"
        )
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{origin} is not a hex string (value not shown)") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{origin} is {len(secret)} bytes; the secret must be at least "
            f"{MIN_SECRET_BYTES} bytes ({2 * MIN_SECRET_BYTES} hex digits)"
        )
    return secret


# ---- reading and checking one value ------------------------------------------------------------


def _get(env: Mapping[str, str], name: str) -> str | None:
    """The stripped value of name, or None when it is unset or empty."""
    value = env.get(name, "").strip()
    return value or None


def _require(env: Mapping[str, str], name: str, because: str) -> str:
    value = _get(env, name)
    if value is None:
        raise ValueError(f"{name} is not set ({because})")
    return value


def _parse_int(name: str, value: str, lo: int | None = None, hi: int | None = None) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None
    return _check_range(name, number, lo, hi)


def _optional_int(
    env: Mapping[str, str], name: str, lo: int | None = None, hi: int | None = None
) -> int | None:
    value = _get(env, name)
    return None if value is None else _parse_int(name, value, lo, hi)


def _required_int(
    env: Mapping[str, str], name: str, because: str, lo: int | None = None, hi: int | None = None
) -> int:
    return _parse_int(name, _require(env, name, because), lo, hi)


def _check_range(name: str, number: int, lo: int | None = None, hi: int | None = None) -> int:
    if (lo is not None and number < lo) or (hi is not None and number > hi):
        bound = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in {lo}..{hi}"
        raise ValueError(f"{name}={number} must be {bound}")
    return number


def _check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return str(value)


def _check_place(
    role: str, rank: int | None, num_workers: int, num_servers: int, names: tuple[str, str, str]
) -> None:
    """Is rank within its role's count? names: what role, rank and num_servers are called in
    messages (variables, or the ClusterSpec fields)."""
    role_name, rank_name, servers_name = names
    if role == "server" and num_servers == 0:
        raise ValueError(f"{role_name}='server' but {servers_name}=0")
    count = {"scheduler": 1, "server": num_servers, "worker": num_workers}[role]
    if rank is not None and not 0 <= rank < count:
        raise ValueError(f"{rank_name}={rank} is out of range for {_count(count, role)}{_span(count)}")


def _count(count: int, noun: str) -> str:
    plural = noun[:-1] + "ies" if noun.endswith("entry") else noun + "s"
    return f"{count} {noun if count == 1 else plural}"


def _span(count: int) -> str:
    return f" (0..{count - 1})" if count else ""


def _parse_address(name: str, value: str) -> tuple[str, int]:
    """host:port, with an IPv6 host in brackets ([::1]:5000)."""
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # a bare IPv6 address: where its port starts is ambiguous
    if not sep or not host:
        raise ValueError(f"{name}={value!r} is not host:port (an IPv6 host as [::1]:5000)")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{name}={value!r} has port {port!r}; a port is an integer in 1..65535")
    return host, int(port)


def _join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
