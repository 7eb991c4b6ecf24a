"""A torch.distributed world of the workers, from paratrain's scheduler: worker 0 hosts a TCPStore on a
free port and the scheduler's barrier tells every worker where it is. Under torchrun with no servers
torchrun's own world (its store and ranks) is the workers' world and is used as it is; with servers
some of torchrun's processes are servers, so the workers make their own world as above."""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING

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
