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
