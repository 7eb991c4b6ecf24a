"""Replicated servers: a restarted server rejoins as a backup and catches up (a state transfer).

With `JobConfig.replication` r >= 2 a dead server's slices are served by their next live copies
(replica.py). `paratrain launch --max-restarts N` starts the dead server's process again, with the
same rank (the placement of slices is a function of the server count, so the rank says which slices
it backs up). Then:

1. It registers with the scheduler, which lets it in because its rank is lost, and gets the roster
   (its own new port included) and the other servers lost now.
2. It asks every other live server to `rejoin` it: `{rank, address, dead}`. Each marks it live again
   at its new address (Replicator.rejoined) and, for every slice whose chain holds it and that this
   server serves now (the first live copy other than the rejoiner: Replicator.serves), sends it the
   slice's state as an `install` on the server-to-server connection that later updates use: where
   the slice lies (key, range, shape, dtype, chain), the server's optimizer, and what `replicate`
   carries (version, value, optimizer state, async clocks applied; ShardState.replica). It is taken
   under the slice's lock, so every later update is forwarded after it, on the same connection, in
   order. An update forwarded between the rejoiner's return to life and the slice's `install` finds
   no slice and is dropped (Replicator.catching_up): the `install`, taken after it, is newer. Once
   the rejoiner confirmed its installs, the server replies with the kvstore's configuration (what
   worker 0's `configure` said).
3. It reports `caught_up` to the scheduler, which counts it as a copy again (so the job again
   survives losing r - 1 servers) and tells every node where it listens (`server_back`).

No fail-back: the rejoined server stays a backup. Workers put rejoined servers last in each chain's
fail-over order (failover.py), so the copy that took over a slice keeps serving it, and the
rejoiner serves it only if every other copy dies. Handing the primary role back would need every
worker to switch at the same round, with that round's pushes in flight; staying a backup needs
nothing of the kind, and the load it moved stays where it went until the next failure.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from paratrain.errors import RemoteError, TransportError
from paratrain.kvstore import protocol
from paratrain.kvstore.api import KVError
from paratrain.kvstore.server import replica, sparse_replica
from paratrain.kvstore.server.shard import ShardState
from paratrain.transport.client import Future
from paratrain.transport.rpc import Request

if TYPE_CHECKING:
    from paratrain.kvstore.server.server import KVServer

logger = logging.getLogger(__name__)


# -- on a live server ----------------------------------------------------------------------------
def send_state(kv: KVServer, request: Request, timeout_s: float) -> None:
    """`rejoin` from a restarted server: install every slice it backs up and this server serves."""
    meta = request.meta
    rank, (host, port) = int(meta["rank"]), meta["address"]
    replicator = kv.replicator
    if not replicator.enabled:
        raise KVError(f"server {rank} asked to rejoin, but this job's servers are not replicated")
    replicator.mark_dead([int(r) for r in meta.get("dead", [])])
    replicator.rejoined(rank, (host, port))
    client = replicator.client(rank)
    sent: list[Future] = []
    for shard in kv.shard_list():
        if rank in shard.chain:
            with shard.cond:  # forwards wait: the install goes out first, then they do
                if replicator.serves(shard.chain, without=rank):
                    optimizer = kv.optimizer_of(shard.key) if kv.optimizer_spec else None
                    install, tensors = installation(shard, optimizer)
                    sent.append(client.request(*install.wire(), tensors))
    sent += sparse_replica.send_tables(kv.tables.all_tables(), replicator, rank, client)  # their rows
    for future in sent:
        future.wait(timeout_s)
    logger.warning("server %d: sent rejoining server %d the state of %d slices", kv.rank, rank, len(sent))
    request.reply({"configuration": kv.configuration, "slices": len(sent)})


def installation(
    shard: ShardState, optimizer: tuple[str, dict] | None
) -> tuple[protocol.Install, list[torch.Tensor]]:
    """An `install` frame: what `replicate` carries and where the slice lies (holds shard.cond)."""
    copy, tensors = shard.replica()
    where = {"numel": shard.numel, "shape": shard.shape, "dtype": shard.dtype, "chain": shard.chain}
    meta = copy.to_meta() | where | {"optimizer": list(optimizer or ())}
    return protocol.Install.from_meta(meta), tensors  # each field checked here, as a receiver would


# -- on the restarted server ---------------------------------------------------------------------
def install(kv: KVServer, request: Request) -> None:
    """A slice's state from the live server that serves it: made here if new, then restored."""
    meta = request.meta
    optimizer = meta.get("optimizer") or []
    if optimizer and kv.optimizer_spec is None:
        kv.set_optimizer(str(optimizer[0]), dict(optimizer[1]))
    shard = kv.adopt(meta)
    if optimizer:  # the slice's own hyperparameters (its parameter group's, its LR schedule's)
        kv.set_hyper([shard.key], dict(optimizer[1]))
    replica.restore(shard, request)


def catch_up(kv: KVServer, lost: list[int], timeout_s: float) -> int:
    """Ask every other live server to `rejoin` this one (install what it should back up); then
    configure this server as worker 0 configured the others. Returns the slices installed."""
    replicator = kv.replicator
    replicator.mark_dead(lost)
    replicator.catching_up = True
    address = replicator.address(kv.rank)
    configuration, slices = None, 0
    for server in replicator.others():
        try:
            client = replicator.client(server)
            reply = client.call(*protocol.Rejoin(kv.rank, list(address), lost).wire(), timeout_s=timeout_s)
        except (TransportError, OSError) as exc:  # died meanwhile: the scheduler decides what that ends
            logger.warning("server %d: server %d did not answer its rejoin: %s", kv.rank, server, exc)
            continue
        except RemoteError as exc:
            raise KVError(f"server {server} refused to send server {kv.rank} its slices: {exc}") from None
        configuration = configuration or reply.meta.get("configuration")
        slices += int(reply.meta["slices"])
    if configuration is None:
        raise KVError(f"server {kv.rank} rejoined, but no live server answered (lost: {lost})")
    kv.configure(dict(configuration, servers=[list(a) for a in replicator.addresses()]))
    replicator.catching_up = False
    return slices
