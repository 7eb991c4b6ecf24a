"""Replicated servers: a server's side of copying its slices' state to their backups.

With `JobConfig.replication` r >= 2, every dense slice lives on r servers (placement.replicas: the
primary, then the next servers in rank order). Workers init a slice on all of them but push and pull
only at the first live one. Whenever the primary updates a slice (a round applied, an async push
applied) it sends the backups the result, not the pushes: version, value, optimizer state and the
async clocks applied (op `replicate`), holding the slice's lock while the bytes go out. The
backups' replies are awaited by one thread per server (`_confirm`), in order, which then moves the
slice's `durable` version and serves what waited for it: pulls wait for `durable`, and so does a
push's acknowledgement (for its own round). So every update a worker was told about is on every
live copy, while the primary goes on receiving the next pushes. (Under bounded and async, a pull
of an older version that is durable may carry a newer value that is not yet: its pushes are not
acknowledged, so their workers send them again if the primary dies.)

When a primary dies, workers send what it had not acknowledged to the next live server of the
slice's chain, which serves the slice from then on (its backups are the rest of the chain that still
live). Pushes carry (worker, clock): a repeat of one that the dead primary applied and replicated is
dropped (ShardState.repeat), so nothing is lost and nothing is applied twice. A backup that cannot
be reached is taken as dead and skipped from then on.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable

from paratrain.errors import RemoteError, TransportError
from paratrain.kvstore.api import KVError
from paratrain.kvstore.server.shard import Clocks, ShardState
from paratrain.transport.config import TransportConfig
from paratrain.transport.rpc import Request, RpcClient

logger = logging.getLogger(__name__)

# A backup that died refuses connections at once; one on a lost host would hold a primary's round
# for the transport's whole connect timeout.
CONNECT_TIMEOUT_S = 5.0


class Replicator:
    """One server's links to the other servers, for the slices it is primary of."""

    def __init__(self, rank: int, secret: bytes, config: TransportConfig | None = None) -> None:
        config = config or TransportConfig()
        self.rank = rank
        self.replication = 1
        self.dead: set[int] = set()
        self._secret = secret
        self._config = dataclasses.replace(
            config, connect_timeout_s=min(config.connect_timeout_s, CONNECT_TIMEOUT_S)
        )
        self._addresses: list[tuple[str, int]] = []
        self._clients: dict[int, RpcClient] = {}
        self._lock = threading.Lock()
        self._sent: queue.SimpleQueue = queue.SimpleQueue()  # (shard, version, [(server, future)])
        self._confirming: threading.Thread | None = None
        self.on_durable: Callable[[], None] = lambda: None
        """Called (from the confirming thread) after a slice's `durable` moved: serve its waiters."""

    @property
    def enabled(self) -> bool:
        return self.replication > 1

    def configure(self, replication: int, addresses: list) -> None:
        """From the workers' `configure`: how many copies, and where the other servers listen."""
        if replication > 1 and len(addresses) < replication:
            raise KVError(f"replication={replication} needs {replication} servers, got {len(addresses)}")
        self.replication = replication
        self._addresses = [(str(host), int(port)) for host, port in addresses]

    def attach(self, shard: ShardState, chain: list[int]) -> None:
        """A new slice and the servers holding it: its updates are forwarded from now on."""
        if not self.enabled:
            return
        if self.rank not in chain:
            raise KVError(
                f"{shard.describe()} was sent to server {self.rank}, not one of its servers {chain}"
            )
        shard.chain = chain
        shard.on_applied = self.forward

    def mark_dead(self, ranks: list[int]) -> None:
        """Servers a worker found dead (it sends them with what it sends again after a fail-over)."""
        with self._lock:
            for rank in ranks:
                if rank != self.rank and rank not in self.dead:
                    logger.warning(
                        "server %d: server %d is dead, its slices are served here", self.rank, rank
                    )
                    self.dead.add(rank)

    def server_lost(self, rank: int, reason: str) -> None:
        """The scheduler lost server `rank` (a death or a partition): no copy goes to it, none
        from it is taken (fence.py), and the copies still unconfirmed by it stop waiting."""
        self.mark_dead([rank])
        with self._lock:
            client = self._clients.pop(rank, None)
        if client is not None:  # fails its pending copies: `_confirm` goes on without it
            logger.warning("server %d: closing the link to lost server %d (%s)", self.rank, rank, reason)
            threading.Thread(target=client.close, name="fence", daemon=True).start()

    def forward(self, shard: ShardState) -> None:
        """Send the slice's new state to its live backups (holds shard.cond: the bytes are out
        when this returns); `_confirm` moves its durable version once they replied."""
        with self._lock:
            backups = [s for s in shard.chain if s != self.rank and s not in self.dead]
        sent = []
        if backups:
            meta, tensors = shard.replica()
            meta["from"] = self.rank  # a backup refuses copies from a server the job lost (fence.py)
            for server in backups:
                try:
                    sent.append((server, self._client(server).request("replicate", meta, tensors)))
                except (TransportError, OSError) as exc:
                    self._lost(server, exc)
        if not sent:  # no live backup: this copy is the only one
            shard.replicated(shard.version)
            return
        with self._lock:
            if self._confirming is None:
                self._confirming = threading.Thread(target=self._confirm, name="replicas", daemon=True)
                self._confirming.start()
        self._sent.put((shard, shard.version, sent))

    def _confirm(self) -> None:
        """The backups' replies, in the order sent; then the slice's waiters may go."""
        while (item := self._sent.get()) is not None:
            shard, version, sent = item
            for server, future in sent:
                try:
                    future.wait(self._config.request_timeout_s)
                except (TransportError, TimeoutError) as exc:
                    self._lost(server, exc)
                except RemoteError as exc:  # it is not a copy any more: stop counting on it
                    logger.error(
                        "server %d: backup server %d refused %s: %s", self.rank, server, shard.describe(), exc
                    )
                    self._lost(server, exc)
            shard.replicated(version)
            self.on_durable()

    def _client(self, server: int) -> RpcClient:
        with self._lock:
            client = self._clients.get(server)
        if client is not None:
            return client
        host, port = self._addresses[server]
        client = RpcClient(
            host,
            port,
            self._secret,
            config=self._config,
            name=f"server {server} ({host}:{port})",
            on_close=lambda error: self._lost(server, error),
            origin=f"server {self.rank}",
        )
        with self._lock:
            self._clients[server] = client
        return client

    def _lost(self, server: int, error: Exception | None) -> None:
        with self._lock:
            if server in self.dead:
                return
            self.dead.add(server)
            self._clients.pop(server, None)
        logger.warning(
            "server %d: backup server %d is gone (%s); going on without it", self.rank, server, error
        )

    def close(self) -> None:
        self._sent.put(None)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            self.dead.update(range(len(self._addresses)))  # closing is not a loss to report
            self.dead.discard(self.rank)
        for client in clients:
            try:
                client.close()
            except (OSError, TransportError):
                pass
        with self._lock:
            confirming = self._confirming
        if confirming is not None:  # not inside torch when the process exits (replies.py, close_all)
            confirming.join(CONNECT_TIMEOUT_S)


def restore(shard: ShardState, request: Request) -> None:
    """A backup's side of `replicate`: take the primary's state of one slice."""
    meta, tensors = request.meta, request.tensors
    if len(tensors) != 1 + len(meta["state"]):
        raise KVError(f"replicate of {shard.describe()} carried {len(tensors)} tensors")
    if request.header.at is not None:  # views into a same-host ring, which later frames overwrite
        tensors = [tensor.clone() for tensor in tensors]
    state = dict(zip(meta["state"], tensors[1:], strict=True))
    value = tensors[0]
    applied = {
        int(rank): Clocks(int(below), {int(c) for c in ahead}) for rank, below, ahead in meta["applied"]
    }
    shard.restore(int(meta["version"]), value, state, applied)
