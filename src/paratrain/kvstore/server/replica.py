"""Replicated servers: a server's side of copying its slices' state to their backups.

With `JobConfig.replication` r >= 2, every dense slice lives on r servers (placement.replicas: the
primary, then the next servers in rank order). Workers init a slice on all of them but push and pull
only at the first live one. Whenever the primary updates a slice (a round applied, an async push
applied) it sends the backups the result, not the pushes: version, value, optimizer state and the
async clocks applied (op `replicate`), holding the slice's lock while the bytes go out (to a backup
on this host, the value is lent: the backup maps the primary's buffer; or with a server optimizer
the value and the optimizer state tensors of its size go through that backup's own buffers:
mirror.py; the lent slices one push frame completes go in one frame, `batch`, with those of the
push frames before it while more of their round is coming: outbox.py). The
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
be reached is taken as dead and skipped from then on, until it is restarted and rejoins as a
backup (rejoin.py: the state transfer that catches it up).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from paratrain.errors import RemoteError, TransportError
from paratrain.kvstore import protocol
from paratrain.kvstore.api import KVError
from paratrain.kvstore.server.mirror import Batch, Borrowed, Mirrors, restored
from paratrain.kvstore.server.outbox import Outbox
from paratrain.kvstore.server.rules import Clocks
from paratrain.kvstore.server.shard import ShardState
from paratrain.kvstore.shared import same_host
from paratrain.transport.client import Future, RpcClient
from paratrain.transport.config import TransportConfig
from paratrain.transport.rpc import Request

logger = logging.getLogger(__name__)

# A backup that died refuses connections at once; one on a lost host would hold a primary's round
# for the transport's whole connect timeout.
CONNECT_TIMEOUT_S = 5.0
_EMPTY = object()  # no copy waits to be confirmed


class Replicator:
    """One server's links to the other servers, for the slices it is primary of."""

    def __init__(self, rank: int, secret: bytes, config: TransportConfig | None = None) -> None:
        config = config or TransportConfig()
        self.rank = rank
        self.replication = 1
        self.dead: set[int] = set()
        self.back: set[int] = set()
        """Servers that rejoined after a restart (rejoin.py): only this server's own lost connection
        takes one for dead again, not a worker's older list of the dead."""
        self.catching_up = False
        """This server is a restarted one that is catching up (rejoin.py): an update of a slice it
        does not hold yet is dropped (its state transfer follows, newer)."""
        self._secret = secret
        self._config = dataclasses.replace(
            config, connect_timeout_s=min(config.connect_timeout_s, CONNECT_TIMEOUT_S)
        )
        self._addresses: list[tuple[str, int]] = []
        self._clients: dict[int, RpcClient] = {}
        self._lock = threading.Lock()
        self._connecting = threading.Lock()
        self._sent: queue.SimpleQueue = queue.SimpleQueue()  # (shard, version, [(server, future)])
        self._local = threading.local()  # a thread's Batch (batch())
        self._confirming: threading.Thread | None = None
        self._mirrors = Mirrors(rank)  # same-host backups: values go through their memory (mirror.py)
        self._outboxes: dict[int, Outbox] = {}  # per backup: lent slices waiting (outbox.py)
        self.borrowed = Borrowed()  # same-host primaries' values this backup holds (mirror.py)
        self.on_dead: Callable[[int], None] = lambda rank: None
        """Called (outside the lock) for a server newly taken as dead: a value borrowed from it
        becomes this server's own (ShardState.disown)."""
        self.on_durable: Callable[[], None] = lambda: None
        """Called (from the confirming thread) after a slice's `durable` moved: serve its waiters."""

    @property
    def timeout_s(self) -> float:
        return self._config.request_timeout_s

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
        shard.on_stall = self.send_all

    def mark_dead(self, ranks: list[int]) -> None:
        """Servers a worker found dead (it sends them with what it sends again after a fail-over)."""
        newly = []
        with self._lock:
            for rank in ranks:
                if rank != self.rank and rank not in self.dead and rank not in self.back:
                    logger.warning(
                        "server %d: server %d is dead, its slices are served here", self.rank, rank
                    )
                    self.dead.add(rank)
                    newly.append(rank)
        for rank in newly:
            self.on_dead(rank)

    def addresses(self) -> list[tuple[str, int]]:
        with self._lock:
            return list(self._addresses)

    def address(self, server: int) -> tuple[str, int]:
        with self._lock:
            return self._addresses[server]

    def others(self) -> list[int]:
        """The other servers not known dead."""
        with self._lock:
            return [s for s in range(len(self._addresses)) if s != self.rank and s not in self.dead]

    def serves(self, chain: list[int], without: int) -> bool:
        """Whether this server is the first live one of `chain` other than `without`: the one that
        sends a rejoining `without` the slice's state (rejoin.py)."""
        with self._lock:
            live = [s for s in chain if s != without and s not in self.dead]
        return bool(live) and live[0] == self.rank

    def rejoined(self, server: int, address: tuple[str, int]) -> None:
        """A restarted `server` listens at `address`: forward to it again (rejoin.py)."""
        with self._lock:
            self._addresses[server] = (str(address[0]), int(address[1]))
            old = self._clients.pop(server, None)
            self.dead.discard(server)
            self.back.add(server)
            self._mirrors.forget(server)
            outbox = self._outboxes.pop(server, None)
        if outbox is not None:  # lends to its earlier process: its install carries the state
            outbox.fail(TransportError(f"server {server} restarted"))
        if old is not None:
            try:
                old.close()
            except (OSError, TransportError):
                pass
        logger.warning("server %d: server %d rejoined; it backs up its slices again", self.rank, server)

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
        batch: Batch | None = getattr(self._local, "batch", None)
        if (
            batch is not None
            and backups
            and shard.lendable()
            and all(self._lends_to(s, shard) for s in backups)
        ):
            self._defer(shard, backups, batch)
            return
        sent = []
        if backups and self._outboxes:  # after the lent slices waiting (a reclaim's copy: same version)
            self.send_all()
        if backups:
            copy, tensors = shard.replica(sender=self.rank)
            for server in backups:
                client = None
                try:
                    client = self._client(server)
                    if self._mirrored(server):
                        future = self._mirrors.send(server, client, shard, copy, tensors)
                    else:
                        future = client.request(*copy.wire(), tensors)
                    sent.append((server, client, future))
                except (TransportError, OSError) as exc:
                    self._lost(server, exc, client)
        if not sent:  # no live backup: this copy is the only one
            shard.replicated(shard.version)
            return
        self._start_confirming()
        self._sent.put((shard, shard.version, sent))

    def _defer(self, shard: ShardState, backups: list[int], batch: Batch) -> None:
        copy, _ = shard.replica()  # no optimizer: the value is all, and it is lent
        parts = []
        for server in backups:
            client = None
            try:
                client = self._client(server)
                parts.append((server, client, self._mirrors.defer(server, shard, copy, batch)))
            except (TransportError, OSError) as exc:
                self._lost(server, exc, client)
        if not parts:
            shard.replicated(shard.version)
            return
        batch.confirms.append((shard, shard.version, parts))

    @contextmanager
    def batch(self, more: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """Within it, this thread's updates of lent slices go to each backup in one frame, sent
        when it ends (or before this thread waits for a buffer a backup holds: send_all), or
        later with the next ones where `more()` says more of their round is coming (outbox.py)."""
        if not self.enabled or getattr(self._local, "batch", None) is not None:
            yield
            return
        self._local.batch = Batch()
        try:
            yield
        finally:
            self.flush(more)
            self._local.batch = None

    def flush(self, more: Callable[[], bool] = lambda: False) -> None:
        """Post this thread's batch (Replicator.batch) to each backup's outbox (outbox.py); it is
        confirmed as single copies are."""
        batch: Batch | None = getattr(self._local, "batch", None)
        if batch is None or not batch.confirms:
            return
        self._local.batch = Batch()
        coming = more()
        for server, (metas, parts) in batch.frames.items():
            self._outbox(server).post(metas, parts, coming)
        self._start_confirming()
        for confirm in batch.confirms:
            self._sent.put(confirm)

    def send_all(self) -> None:
        """Send every lent slice that waits (this thread's batch and the outboxes): before a
        thread waits for a buffer a backup holds, and before a copy that must follow them."""
        self.flush()
        with self._lock:
            outboxes = list(self._outboxes.values())
        for outbox in outboxes:
            outbox.drain()

    def _outbox(self, server: int) -> Outbox:
        with self._lock:
            outbox = self._outboxes.get(server)
            if outbox is None:
                outbox = self._outboxes[server] = Outbox(lambda metas: self._send_lent(server, metas))
            return outbox

    def _send_lent(self, server: int, metas: list[dict]) -> Future:
        """One `replicate` frame of lent slices (outbox.py); a failed reply where `server` is gone."""
        whole = Future(f"replicate to server {server}", None)
        with self._lock:
            dead = server in self.dead
        if dead:
            whole._set(None, TransportError(f"server {server} is dead"))
            return whole
        try:
            return self._client(server).request(
                *protocol.Replicate(sender=self.rank, slices=metas).wire(), []
            )
        except (TransportError, OSError) as exc:
            whole._set(None, exc)
            self._lost(server, exc)
            return whole

    def _start_confirming(self) -> None:
        with self._lock:
            if self._confirming is None:
                self._confirming = threading.Thread(target=self._confirm, name="replicas", daemon=True)
                self._confirming.start()

    def _lends_to(self, server: int, shard: ShardState) -> bool:
        """Whether `server` may borrow `shard`'s value (mirror.py): on this host, and it maps ours."""
        try:
            return self._mirrored(server) and self._mirrors.lends_to(server, self._client(server), shard)
        except (TransportError, OSError):  # unreachable: forward's copy below finds it lost
            return False

    def _mirrored(self, server: int) -> bool:
        """Whether copies to `server` may go through its memory: on this host, same-host path on."""
        with self._lock:
            mine, theirs = self._addresses[self.rank][0], self._addresses[server][0]
        return self._config.shm_ring_bytes > 0 and same_host(theirs, mine)

    def send(self, server: int, op: str, meta: dict, tensors: list) -> Future | None:
        """One frame to another server (a sparse table's delta: sparse_replica.py); None where
        that server is dead or cannot be reached."""
        with self._lock:
            if server in self.dead:
                return None
        try:
            return self._client(server).request(op, meta, tensors)
        except (TransportError, OSError) as exc:
            self._lost(server, exc)
            return None

    def confirm(self, server: int, future: Future, what: str) -> None:
        """Wait for a backup's reply to `send`; one that fails or refuses is taken as dead."""
        try:
            future.wait(self._config.request_timeout_s)
        except (TransportError, TimeoutError) as exc:
            self._lost(server, exc)
        except RemoteError as exc:
            logger.error("server %d: backup server %d refused %s: %s", self.rank, server, what, exc)
            self._lost(server, exc)

    def _confirm(self) -> None:
        """The backups' replies, in the order sent; then the slice's waiters may go: at once, or
        where the next slice's copies are answered already, after that one too (the slices of a
        round are confirmed together, and the waiting pulls looked at once)."""
        item = self._sent.get()
        while item is not None:
            self._confirm_one(*item)
            try:
                item = self._sent.get_nowait()
            except queue.Empty:
                item = _EMPTY
            if item is _EMPTY or item is None or not all(f.done() for _, _, f in item[2]):
                self.on_durable()
            if item is _EMPTY:
                item = self._sent.get()

    def _confirm_one(self, shard: ShardState, version: int, sent: list) -> None:
        for server, client, future in sent:
            try:
                future.wait(self._config.request_timeout_s)
            except (TransportError, TimeoutError) as exc:
                self._lost(server, exc, client)
            except RemoteError as exc:  # it is not a copy any more: stop counting on it
                logger.error(
                    "server %d: backup server %d refused %s: %s", self.rank, server, shard.describe(), exc
                )
                self._lost(server, exc, client)
        shard.replicated(version)
        self._mirrors.release(shard)

    def client(self, server: int) -> RpcClient:
        """The connection to another server (updates and state transfers go out on it, in order)."""
        return self._client(server)

    def _client(self, server: int) -> RpcClient:
        with self._lock:
            client = self._clients.get(server)
        if client is not None:
            return client
        with self._connecting:  # one connection per server: a state transfer and the updates
            with self._lock:  # after it must arrive in order (rejoin.py)
                client = self._clients.get(server)
            return client if client is not None else self._connect(server)

    def _connect(self, server: int) -> RpcClient:
        host, port = self._addresses[server]
        made: list[RpcClient] = []
        client = RpcClient(
            host,
            port,
            self._secret,
            config=self._config,
            name=f"server {server} ({host}:{port})",
            on_close=lambda error: self._lost(server, error, made[0] if made else None),
            origin=f"server {self.rank}",
        )
        made.append(client)
        with self._lock:
            self._clients[server] = client
        return client

    def _lost(self, server: int, error: Exception | None, client: RpcClient | None = None) -> None:
        """`server` is dead; where `client` is given, only if that is still the connection to it
        (one to a server's earlier process, which has rejoined since, tells nothing of the new)."""
        with self._lock:
            if client is not None and self._clients.get(server) is not client:
                return
            if server in self.dead:
                return
            self.dead.add(server)
            self.back.discard(server)
            self._clients.pop(server, None)
            self._mirrors.forget(server)
            outbox = self._outboxes.pop(server, None)
        if outbox is not None:
            outbox.fail(error or TransportError(f"server {server} is gone"))
        logger.warning(
            "server %d: backup server %d is gone (%s); going on without it", self.rank, server, error
        )

    def close(self) -> None:
        self._sent.put(None)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            self.dead.update(range(len(self._addresses)))  # closing is not a loss to report
            self.dead.discard(self.rank)
            outboxes, self._outboxes = list(self._outboxes.values()), {}
        for outbox in outboxes:
            outbox.fail(TransportError(f"server {self.rank} is closing"))
        for client in clients:
            try:
                client.close()
            except (OSError, TransportError):
                pass
        with self._lock:
            confirming = self._confirming
        if confirming is not None:  # not inside torch when the process exits (replies.py, close_all)
            confirming.join(CONNECT_TIMEOUT_S)
        self._mirrors.close()
        self.borrowed.close()


def restore(
    shard: ShardState,
    request: Request,
    dead: set[int] | frozenset[int] = frozenset(),
    borrowed: Borrowed | None = None,
    part: dict | None = None,
) -> dict:
    """A backup's side of `replicate`: take the primary's state of one slice. Not from a sender
    known `dead`: a frame it sent just before dying may be read after this server took over the
    slice and applied pushes sent again to it (a worker marks the sender dead here before those);
    the frame's version may then equal this server's own, and taking it would lose them. The sender
    died before it could acknowledge what that frame carried.

    Returns the reply: which of the primary's buffers the value is now (`holds`, mirror.py), so
    that the primary writes none that this server holds. `part`: one slice's meta of a frame
    {slices: [...]} (Replicator.batch)."""
    meta, tensors = request.meta, request.tensors
    if part is not None:  # one slice of a frame of several (Replicator.batch)
        meta = part | {"sender": meta.get("sender")}
    with shard.cond:  # atomic with the pushes applied here (mark_dead comes before them)
        shard.settle()  # before the check: pushes may be applied here while it waits
        if meta.get("sender") in dead:
            logger.warning("server: dropped %s's state from dead server %s", shard.describe(), meta["sender"])
        else:
            _restore(shard, meta, tensors, request.header.at is not None, borrowed)
        return {} if borrowed is None else {"holds": borrowed.holds(shard)}


def _restore(shard: ShardState, meta: dict, tensors: list, ring: bool, borrowed: Borrowed | None) -> None:
    if ring:  # views into a same-host ring, which later frames overwrite
        tensors = [tensor.clone() for tensor in tensors]
    names = meta["state"]
    if "lent" in meta:  # the value is the primary's buffer, mapped here (mirror.py)
        if borrowed is None:
            raise KVError(f"replicate of {shard.describe()} lends a buffer where none can be taken")
        tensors = [borrowed.value(shard, meta["lent"]), *tensors]
    if "buffer" in meta:  # the value (and state) in this server's buffers (mirror.py)
        names, tensors = restored(shard.mirror, meta, tensors)
    if len(tensors) != 1 + len(names):
        raise KVError(
            f"replicate of {shard.describe()} carried {len(tensors) - 1} tensors, {len(names)} named"
        )
    state = dict(zip(names, tensors[1:], strict=True))
    value = tensors[0]
    applied = {
        int(rank): Clocks(int(below), {int(c) for c in ahead}) for rank, below, ahead in meta["applied"]
    }
    shard.restore(int(meta["version"]), value, state, applied)
