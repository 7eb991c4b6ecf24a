"""The Context: what a worker knows about its job, and the one `paratrain.init()` made.

Layers below the package's top take a Context as an argument. Where a caller passes none (a kvstore,
a Trainer or a pipeline built in a script that never called `paratrain.init()` itself), `current()`
returns the one the top layer provides: `paratrain/__init__.py` registers `init` as the provider,
so the job is started by the top layer only, never summoned from below (docs/architecture.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paratrain.cluster.config import JobConfig
from paratrain.errors import ClusterError

if TYPE_CHECKING:
    from paratrain.cluster.agent import Membership, SchedulerLink
    from paratrain.cluster.spec import ClusterSpec


@dataclass
class Context:
    """What a worker knows about its job."""

    role: str
    rank: int
    num_workers: int
    num_servers: int
    servers: list[tuple[str, int]] = field(default_factory=list)
    """(host, port) of each server, by rank."""
    config: JobConfig = field(default_factory=JobConfig)
    spec: ClusterSpec | None = None
    link: SchedulerLink | None = field(default=None, repr=False)
    joined: bool = False
    """This worker registered into a running elastic job (JobConfig.elastic): it skips the start's
    barriers and worker 0's duties, and takes the job's parameters and epoch as they are."""
    local_rank: int | None = None
    """This worker's index among the processes of its host: the spec's (LOCAL_RANK), else its rank
    (as when every worker runs on one host)."""
    local_world_size: int | None = None
    """How many of the job's processes run on this host: the spec's, else the number of workers."""

    def __post_init__(self) -> None:
        spec = self.spec if self.spec is not None and self.spec.local_rank is not None else None
        if self.local_rank is None:
            self.local_rank = spec.local_rank if spec is not None else self.rank
        if self.local_world_size is None:
            size = spec.local_world_size if spec is not None else None
            self.local_world_size = size or max(self.num_workers, (self.local_rank or 0) + 1)

    @property
    def device(self) -> Any:
        """The torch.device this worker trains on (see `device_for`)."""
        import torch  # not on a bare import of the cluster layer (the launcher imports it)

        gpus = self.spec.gpus_per_worker if self.spec is not None else None
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return torch.device(device_for(self.local_rank or 0, self.local_world_size or 1, gpus, count))

    @property
    def distributed(self) -> bool:
        return self.link is not None

    def barrier(
        self, group: str = "workers", name: str = "", timeout_s: float | None = None, data: Any = None
    ) -> dict[int, Any]:
        """Wait until every live worker (group "workers"), and every server too ("all"), is here.
        Returns what each worker passed as `data` (small, msgpack-able), by rank."""
        if self.link is None:
            return {0: data}
        return self.link.barrier(group, name, timeout_s, data)

    def members(self) -> Membership:
        """The job's live workers now (cluster/membership.py): generation, ranks, joiners. Without
        elasticity it never changes while the job runs (generation 0: ranks 0..num_workers-1)."""
        from paratrain.cluster.agent import Membership  # the transport, torch: not on a bare import

        if self.link is None or self.config.elastic is None:
            return Membership(0, tuple(range(self.num_workers)))
        return self.link.members()


def device_for(local_rank: int, local_world_size: int, gpus_per_worker: int | None, cuda_devices: int) -> str:
    """The device of the worker with `local_rank` among `local_world_size` processes on its host,
    where it sees `cuda_devices` GPUs: the CPU without any (or when its launcher gave it none);
    cuda:0 where the launcher made only this worker's own GPUs visible (gpus_per_worker > 0); else,
    every GPU of the host being visible to every process (torchrun's way), GPU local_rank, or the
    CPU where the host has fewer GPUs than processes (NCCL refuses two ranks on one GPU)."""
    if cuda_devices == 0 or gpus_per_worker == 0:
        return "cpu"
    if gpus_per_worker is not None:
        return "cuda:0"
    return f"cuda:{local_rank}" if local_world_size <= cuda_devices else "cpu"


_provider: Callable[[], Context] | None = None
_lock = threading.Lock()


def provide(provider: Callable[[], Context]) -> None:
    """The top layer says where the default context comes from (`paratrain.init`)."""
    global _provider
    with _lock:
        _provider = provider


def current(ctx: Context | None = None) -> Context:
    """`ctx` itself, or the context of this process's job from the top layer's provider."""
    if ctx is not None:
        return ctx
    if _provider is None:
        raise ClusterError("no context: pass ctx=, or call paratrain.init() first")
    return _provider()
