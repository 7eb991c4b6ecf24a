"""Servers without GPUs on Slurm: a heterogeneous job (`#SBATCH hetjob`) whose first component is
the workers, with their GPUs (--gpus-per-task) and CPUs, and whose second is the servers, with their
own CPUs and no GPU. One srun with a part per component (`srun ... : ...`) starts both as one step:
its tasks are numbered across the components (workers 0..W-1, then the servers) and
--kill-on-bad-exit still ends every task when one fails.

A plain srun gives every task the same resources, so a job with GPUs would reserve them for its
servers too (which hide them: sbatch.py's `gpu_binding`); the heterogeneous job reserves none there.

Each task's place in the job reaches paratrain.init() through torchrun's convention (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT; cluster/spec.py): a task's RANK is the global rank the cluster
spec gives its role and rank (`server_ranks`), so that the roles are what they would be in one srun.
Task 0, on the batch script's node (MASTER_ADDR), is worker 0 whenever there are no more servers
than workers, and runs the scheduler; with more servers than workers the job stays one srun.

Components may not share a node on many clusters (a partition without OverSubscribe), so a
heterogeneous job needs as many nodes as it has components; the tests' one-node Slurm cannot start
one, and check the script and each task's identity without Slurm instead.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from paratrain.cluster.spec import server_ranks

if TYPE_CHECKING:
    from paratrain.launch.api import LaunchConfig
    from paratrain.launch.engines.slurm.sbatch import SlurmOptions

# What every component of the job asks for alike (sbatch propagates some of these, not all).
_SHARED = ("partition", "time", "account", "qos", "constraint", "mem-per-cpu")


def heterogeneous(config: LaunchConfig, options: SlurmOptions) -> bool:
    """Whether the job is a heterogeneous one: workers with GPUs beside servers (no more of them
    than workers, so that task 0 is a worker)."""
    return bool(options.gpus_per_worker and 0 < config.num_servers <= config.num_workers)


def het_roles(num_workers: int, num_servers: int) -> list[tuple[str, int]]:
    """(role, rank) of each task of the heterogeneous step, by task number."""
    return [("worker", i) for i in range(num_workers)] + [("server", j) for j in range(num_servers)]


def global_ranks(num_workers: int, num_servers: int) -> list[int]:
    """The RANK each task of the heterogeneous step is given: where the cluster spec puts its role
    and rank among W + S processes."""
    servers = server_ranks(num_workers + num_servers, num_servers)
    workers = [rank for rank in range(num_workers + num_servers) if rank not in servers]
    return workers + servers


def identity(num_workers: int, num_servers: int, server_threads: dict[str, str]) -> str:
    """The start of each task's command: its RANK and WORLD_SIZE (torchrun's convention), and on a
    server its own share of threads (the script exports the workers')."""
    ranks = " ".join(str(rank) for rank in global_ranks(num_workers, num_servers))
    text = f"ranks=({ranks}); export RANK=${{ranks[$SLURM_PROCID]}} WORLD_SIZE={num_workers + num_servers}; "
    if server_threads:
        exports = " ".join(f"{name}={value}" for name, value in server_threads.items())
        text += f'if [ "$SLURM_PROCID" -ge {num_workers} ]; then export {exports}; fi; '
    return text


def components(shared: dict[str, str | None], config: LaunchConfig, options: SlurmOptions) -> list[dict]:
    """The #SBATCH values of each component: the workers', then (after `hetjob`) the servers'."""
    common = {name: shared.get(name) for name in _SHARED}
    workers = {
        "ntasks": str(config.num_workers),
        "cpus-per-task": str(math.ceil(options.cpus_per_worker)),
        "gpus-per-task": str(options.gpus_per_worker),
        "nodes": None if options.nodes is None else str(options.nodes),
        **common,
    }
    servers = {"ntasks": str(config.num_servers), "cpus-per-task": str(math.ceil(options.cpus_per_server))}
    return [workers, {**servers, **common}]


def srun_parts(config: LaunchConfig, options: SlurmOptions) -> list[str]:
    """srun's options for each component of the step (joined with ` : `, each before the command)."""
    workers = (
        f"--het-group=0 --ntasks={config.num_workers} --cpus-per-task={math.ceil(options.cpus_per_worker)} "
        f"--gpus-per-task={options.gpus_per_worker}"
    )
    servers = (
        f"--het-group=1 --ntasks={config.num_servers} --cpus-per-task={math.ceil(options.cpus_per_server)}"
    )
    return [workers, servers]
