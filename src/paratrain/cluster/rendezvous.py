"""A torch.distributed world of the workers, from paratrain's scheduler: worker 0 hosts a TCPStore on a
free port and the scheduler's barrier tells every worker where it is. Under torchrun with no servers
torchrun's own world (its store and ranks) is the workers' world and is used as it is; with servers
some of torchrun's processes are servers, so the workers make their own world as above.

Elastic jobs (collective/elastic.py) re-form the world instead: torch.distributed has no shrink, so
`reform_torch_distributed` destroys the group and makes a new one over the members that reach the
scheduler's barrier for a generation, ranked in order of worker rank (`rank_map`), on a fresh store
(hosted by the lowest member, under a prefix naming the generation, so no key of an older group is
ever read)."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

if TYPE_CHECKING:
    from paratrain.cluster.context import Context

logger = logging.getLogger(__name__)


def init_torch_distributed(ctx: Context, backend: str = "gloo", timeout_s: float = 300.0) -> None:
    """Join every worker of `ctx` into the default torch.distributed process group."""
    if dist.is_initialized():
        return
    if ctx.spec is not None and ctx.spec.source == "torchrun" and ctx.num_servers == 0:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        return
    # Otherwise the world is the workers only (servers never join it), ranked as paratrain ranks them.
    host = ctx.spec.host if ctx.spec is not None else "127.0.0.1"
    store = None
    if ctx.rank == 0:
        store = dist.TCPStore(
            host,
            0,
            ctx.num_workers,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    where = ctx.barrier(name="torch-distributed", data=[host, store.port] if store else None)[0]
    if store is None:
        store = dist.TCPStore(
            where[0],
            where[1],
            ctx.num_workers,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    dist.init_process_group(
        backend,
        store=store,
        rank=ctx.rank,
        world_size=ctx.num_workers,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    logger.info("torch.distributed %s world of %d ready", backend, ctx.num_workers)


def rank_map(members: Iterable[int]) -> dict[int, int]:
    """Worker rank -> group_rank, its index in the all-reduce group: the members in order of rank."""
    return {worker: group_rank for group_rank, worker in enumerate(sorted(set(members)))}


@dataclass(frozen=True)
class Formation:
    """One generation's all-reduce group, as this worker sees it."""

    generation: int
    members: tuple[int, ...]
    """Worker ranks in the group, in group-rank order."""
    rank: int
    """This worker's rank in the group."""
    data: dict[int, Any]
    """What each member brought to the re-formation, by worker rank."""

    @property
    def world_size(self) -> int:
        return len(self.members)


_store: dist.TCPStore | None = None
"""The store this worker hosts for the current group (its lowest member hosts it)."""


def reform_torch_distributed(
    ctx: Context,
    generation: int,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    data: Any = None,
    barrier_timeout_s: float | None = None,
) -> Formation:
    """Leave the current process group (if any) and join generation `generation`'s: the workers
    that reach the scheduler's barrier "collective-<generation>" (within `barrier_timeout_s`, else
    TimeoutError), each bringing `data`. Every member offers a store; the lowest member's is used,
    under the prefix "generation-<generation>/". `timeout_s`: the new group's collectives'."""
    global _store
    if dist.is_initialized():
        dist.destroy_process_group()
    host = ctx.spec.host if ctx.spec is not None else "127.0.0.1"
    timeout = datetime.timedelta(seconds=timeout_s)
    offered = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    arrived = ctx.barrier(name=f"collective-{generation}", data={"store": [host, offered.port], "data": data})
    ranks = rank_map(arrived)
    leader = min(ranks)
    if leader == ctx.rank:
        _store = store = offered
    else:
        where = arrived[leader]["store"]
        store = dist.TCPStore(where[0], where[1], is_master=False, timeout=timeout)
        del offered
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"generation-{generation}/", store),
        rank=ranks[ctx.rank],
        world_size=len(ranks),
        timeout=timeout,
    )
    members = tuple(sorted(ranks))
    logger.info(
        "all-reduce group of generation %d: %d member(s) %s, this worker is rank %d",
        generation,
        len(members),
        list(members),
        ranks[ctx.rank],
    )
    return Formation(generation, members, ranks[ctx.rank], {w: arrived[w]["data"] for w in members})
