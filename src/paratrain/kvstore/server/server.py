"""The parameter server's wire side: requests in, replies out, for the shards of dense keys it holds
(their state: shard.py) and its sparse tables (sparse.py).

Requests (typed in kvstore/protocol.py and routed by one table, `KVServer._routes`; meta lists
are parallel; every tensor is one flat slice of one key):

    configure     {mode, params, members, average}       from worker 0, before any init: the
                  consistency policy by name and fields (consistency.py), who pushes, sum or mean
    init          {keys, starts, stops, shapes, dtypes, numels}     values, or none: check only
    push          {keys, starts, stops, clocks, [added], [weight], [more]}  gradients; reply once
                  added; `more`: more frames of this push follow (outbox.py)
    pull          {keys, starts, stops, min_versions, [read]}       reply carries the values
    pushpull      push and pull of the same slices in one frame
    set_optimizer {path, hyper}                                     from worker 0
    set_hyper     {keys, hyper}                                     new hyperparameters of the
                  optimizer of these keys (a parameter group's), from the next update on; kept
                  for their slices made later. In sync mode every worker sends it before its
                  pushes of the round on the same connection, so it is in place when the round
                  applies
    clip_by_norm  {}                                                from worker 0: sync rounds wait,
                  complete, for their clipping scale (shard.py, Rules.clip)
    norm_share    {clock}                                           reply {share}: round clock's
                  mean's squared norm over this server's slices, once it is complete on each
    clip_scale    {clock, scale}                                    round clock is applied scaled
    check_overflow {}                                               from worker 0: sync rounds wait,
                  complete, for every worker's overflow flag (fp16; overflow.py, Rules.overflow)
    overflow      {clock, rank, found}                              reply {overflowed} once every
                  worker's flag of round clock is in: the round is dropped if any is set
    leave         {rank}                                            that worker pushes no more
    join          {rank}                                            a worker that joined the running
                  job (elastic) takes part in every round from the next one (shard.py's offsets)
    waiting       {keys, starts, stops, min_versions, rank}         from a worker whose call waits
                  long: per slice behind min_version, its round and the workers that have not
                  pushed it (logged here too, so that no wait is silent on either side)
    get_state / set_state                                           for save_state / load_state
    replicate     {key, start, stop, version, applied, state}       a slice's state, from its
                  primary to this backup (replica.py; with replication a push's reply waits until
                  its round is on the backups); or {slices: [...]} several, each with `lent`, the
                  primary's buffer that is the value (mirror.py); reply {holds}: the primary's
                  buffer(s) this backup's value is
    mirror        {key, start, stop}                                from a same-host primary: where
                  this backup's two buffers for the slice are, which `replicate` {buffer} names
                  (mirror.py)
    borrow        {arena}                                           from a same-host primary:
                  whether this backup maps its memory, before it lends values (mirror.py)
    rejoin        {rank, address, dead}                             from a restarted server: it
                  is a backup again; reply once it has an `install` of each slice it backs up that
                  this server serves (rejoin.py), with the configuration worker 0 sent
    install       {key, start, stop, numel, shape, dtype, chain, optimizer, version, applied, state}
                  a slice's state, on a restarted server (made here if new)
    sparse_*                                                        sparse tables (sparse.py)

Consistency is the policy's (consistency.py) and a shard's state changes only through its methods
(shard.py): a push joins its round or is applied at once; a pull waits (pulls.py) until the
shard's version reaches the `min_version` the worker sent.

Zero copies on the hot path: a push is received straight into a pooled buffer of its shard (or, from
a worker on this host, read in place from the shared-memory ring). A pull is sent straight from the
shard's value, which no round changes while it is being sent (ShardState.begin_read / end_read).

Shared shards (shared.py). A shard whose init came from a worker on this host keeps its value and
ROUND_BUFFERS round sums in this server's shared-memory arena. Same-host workers add their pushes
into the open round's buffer themselves (meta `added`: true for that slice, no payload) and copy
pulls out of the value themselves (meta `read`: the reply carries no tensor for that slice), under
the arena's locks. Without an optimizer the complete round's buffer becomes the value, and the old
value's buffer opens for a later round; a payload that arrives for a round with an open buffer is
added into that buffer here.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from paratrain.errors import TransportError
from paratrain.kvstore import optim
from paratrain.kvstore import protocol as p
from paratrain.kvstore.api import KVError
from paratrain.kvstore.compressed import ServerCompression
from paratrain.kvstore.consistency import Sync, from_wire
from paratrain.kvstore.server import mirror, outbox, rejoin, replica, report
from paratrain.kvstore.server.fence import Fence
from paratrain.kvstore.server.overflow import Verdicts
from paratrain.kvstore.server.pulls import PendingPull, Pulls
from paratrain.kvstore.server.rules import Push, Rules
from paratrain.kvstore.server.shard import ShardState
from paratrain.kvstore.server.sparse import SparseTables
from paratrain.kvstore.shared import Arena, Region
from paratrain.transport.connection import Connection
from paratrain.transport.frame import Header
from paratrain.transport.message import Routes
from paratrain.transport.rpc import Handler, Request
from paratrain.transport.tensors import DTYPES

logger = logging.getLogger(__name__)

# Buffers of a shared shard (shared.py) besides its value: rounds that same-host workers can push
# into directly. Two let a worker push round r + 1 while round r waits for a slow worker.
ROUND_BUFFERS = 2
Shard = ShardState  # the name other modules knew


class KVServer(Handler):
    ring_views = True  # same-host pushes are summed straight out of the shared-memory ring

    def __init__(
        self, rank: int = 0, intra_op_threads: int | None = 1, replicator: replica.Replicator | None = None
    ) -> None:
        """`intra_op_threads`: torch's threads per operation in this (server) process, None to leave
        torch's choice. One by default: a server already runs a thread per connection, and torch's
        pool on top of them oversubscribes cores that workers share. Measured on 2 loaded cores, a
        gather of 4,150 rows of 16 took 19 ms with torch's 2 threads and 0.15 ms with one."""
        if intra_op_threads is not None:
            torch.set_num_threads(intra_op_threads)
        self.rank = rank
        self.rules = Rules()  # consistency policy, members, averaging: every shard and table reads them
        self.optimizer_spec: tuple[str, dict] | None = None
        self.key_hyper: dict[Any, dict] = {}  # set_hyper's values per key, over optimizer_spec's
        self._shards: dict[tuple[Any, int, int], Shard] = {}
        self._lock = threading.Lock()
        self._arena: Arena | None = None  # shared shards, made on the first same-host init
        self.tables = SparseTables(self)  # sparse tables: ops sparse_* (sparse.py)
        self.staleness: Counter[int] = Counter()
        """Pushed slices by how many updates their key took since the pusher's pull (report.py)."""
        self.compression = ServerCompression()  # compressed pushes and pulls (compressed.py)
        self.pulls = Pulls(rank, self.compression, self._refuse)  # waiting pulls, replies (pulls.py)
        self.replicator = replicator or replica.Replicator(rank, b"")  # backups (replica.py)
        self.replicator.on_durable = self.pulls.serve_ready
        self.replicator.on_dead = self._disown
        self._configured: frozenset[int] = frozenset()  # the members worker 0 configured
        self.configuration: dict = {}  # what worker 0's configure said (a rejoining server's too)
        self._live: frozenset[int] | None = None  # elastic: the scheduler's live workers
        self.fence = Fence(rank)  # dropped workers' pushes and lost servers' copies (fence.py)
        self.arrivals = outbox.Arrivals()  # who is part way through a round's push (outbox.py)
        self.verdicts = Verdicts(lambda: self.rules.members, self._overflow_verdict)  # overflow.py
        self._routes = Routes(self.tables.handlers() | self._handlers())
        self._receivers: dict[str, Callable[[Header], list[torch.Tensor] | None]] = {
            p.Push.op: self._push_destinations,  # where a frame's payload goes, by op
            p.PushPull.op: self._push_destinations,
            p.Replicate.op: self._copy_destination,
        }

    def _handlers(self) -> dict:
        """The dense ops' table: message type (protocol.py) -> handler(request, message)."""
        return {
            p.Push: self._on_push,
            p.Pull: lambda request, pull: self._pull(request, pull, pull.min_versions),
            p.PushPull: self._on_pushpull,
            p.Replicate: self._on_replicate,
            p.Mirror: lambda request, _: request.reply(mirror.offer(self, request.meta)),
            p.Borrow: lambda request, msg: request.reply(self.replicator.borrowed.check(msg.arena)),
            p.Rejoin: lambda request, _: rejoin.send_state(self, request, self.replicator.timeout_s),
            p.Install: self._install,
            p.Init: self._init,
            p.Configure: _replying(self._configure),
            p.SetOptimizer: _replying(lambda msg: self._set_optimizer(msg.path, msg.hyper)),
            p.SetHyper: _replying(lambda msg: self.set_hyper(msg.keys, msg.hyper)),
            p.ClipByNorm: _replying(lambda _: self._clip_by_norm()),
            p.NormShare: lambda request, msg: request.reply({"share": self.norm_share(msg.clock)}),
            p.ClipScale: _replying(lambda msg: self.clip_scale(msg.clock, msg.scale)),
            p.CheckOverflow: _replying(lambda _: self._check_overflow()),
            p.Overflow: lambda request, msg: request.reply(
                {"overflowed": self.verdicts.report(msg.clock, msg.rank, msg.found)}
            ),
            p.Join: _replying(lambda msg: self._join(msg.rank)),
            p.Leave: _replying(lambda msg: self._leave(msg.rank)),
            p.GetState: self._get_state,
            p.SetState: self._set_state,
            p.Ping: lambda request, _: request.reply(request.meta, request.tensors),
            p.Stats: lambda request, _: request.reply(report.stats(self)),
            p.Waiting: lambda request, msg: request.reply({"waits": report.waits(self, msg)}),
            p.SparsePush: self._sparse_push,
        }

    def _sparse_push(self, request: Request, push: p.SparsePush) -> None:
        self.fence.check_push(request.conn, push.rank)  # a dropped worker's late push is refused
        self.tables.push(request, push)

    # -- receiving pushes straight into pooled buffers --------------------------------------------
    def destinations(self, conn: Connection, header: Header) -> Sequence[torch.Tensor] | None:
        """Where a frame's payload goes, read before its message is (from the header's map): a
        push's into its shards' pooled buffers, a backup's copy into its shard's; else new tensors."""
        receive = self._receivers.get(header.op)
        return None if receive is None or header.at is not None else receive(header)

    def _copy_destination(self, header: Header) -> list[torch.Tensor] | None:
        meta = header.meta
        if {"buffer", "lent", "slices"} & meta.keys():  # the values are in memory (mirror.py)
            return None
        try:
            return [self.shard_of((meta["key"], meta["start"], meta["stop"])).buffer()]
        except (KVError, KeyError, TypeError):
            return None

    def _push_destinations(self, header: Header) -> list[torch.Tensor] | None:
        """A push's payload (a same-host one is read in place from the ring: no destinations)."""
        meta = header.meta
        if "compression" in meta:
            return None  # compressed: decoded into pooled buffers in _push
        try:
            keys, starts, stops = meta["keys"], meta["starts"], meta["stops"]
            carried = [
                i for i, added in enumerate(_flags(meta.get("added"), len(keys), "added")) if not added
            ]
            shards = [self.shard_of((keys[i], starts[i], stops[i])) for i in carried[: len(header.specs)]]
            return [shard.buffer() for shard in shards]
        except (KVError, KeyError, IndexError, TypeError):
            return None  # handle() reports it; the payload goes to fresh tensors meanwhile

    def shard_of(self, ident: tuple[Any, int, int]) -> Shard:
        """The slice (key, start, stop) held here; KVError naming it where it is not."""
        shard = self._shards.get(ident)
        if shard is None:
            raise KVError(
                f"key {ident[0]!r} [{ident[1]}, {ident[2]}) is not on server {self.rank}: was it "
                "initialized, and did every worker init its keys in the same order?"
            )
        return shard

    def shards_of(self, msg: p.Slices) -> list[Shard]:
        return [self.shard_of(msg.ident(i)) for i in range(len(msg.keys))]

    # -- dispatch ---------------------------------------------------------------------------------
    def handle(self, request: Request) -> None:
        try:
            self._routes.serve(request)
        except (KVError, ValueError, TypeError, KeyError) as exc:
            request.fail(f"server {self.rank}: {exc}")

    def _on_push(self, request: Request, push: p.Push) -> None:
        self._push(request, push)
        self._acknowledge(request, push)

    def _on_pushpull(self, request: Request, push: p.PushPull) -> None:
        self._push(request, push)
        self._pull(request, push, self._acknowledged_at(push, push.min_versions))

    def _install(self, request: Request, _: p.Install) -> None:
        rejoin.install(self, request)
        request.reply({})

    def _on_replicate(self, request: Request, msg: p.Replicate) -> None:
        self.fence.check_replicate(msg.sender, self.replicator.dead)
        request.reply(self._replicate(request))

    def _replicate(self, request: Request, part: dict | None = None) -> dict:
        """A backup's copy of a slice's new state (replica.py), or of several lent ones (`slices`);
        one it does not hold yet, while it catches up after a restart, is dropped: that slice's
        install follows, newer (rejoin.py)."""
        if part is None and "slices" in request.meta:
            return {"holds": [self._replicate(request, one).get("holds") for one in request.meta["slices"]]}
        meta = request.meta if part is None else part
        ident = (meta["key"], meta["start"], meta["stop"])
        if ident not in self._shards and self.replicator.catching_up:
            return {}
        shard = self.shard_of(ident)
        return replica.restore(shard, request, self.replicator.dead, self.replicator.borrowed, part)

    def _disown(self, server: int) -> None:
        """`server` is dead: values this backup borrowed (from it or another) become its own
        (mirror.py); a live primary lends its next value again."""
        with self._lock:
            shards = list(self._shards.values())
        for shard in shards:
            shard.disown()

    def configure(self, meta: dict) -> None:
        """How worker 0 configured the servers (also a restarted server's, from the others): a
        `configure` message's map."""
        self._configure(p.Configure.from_meta(meta))

    def _configure(self, msg: p.Configure) -> None:
        chosen = from_wire(msg.mode, msg.params)
        self.configuration = msg.to_meta()
        self.replicator.configure(msg.replication, msg.servers or [])
        with self._lock:
            self.rules.policy = chosen
            self._configured = frozenset(msg.members)
            live = self._configured if self._live is None else self._live
            self.rules.members = (self._configured & live) - self.rules.joiners
            self.rules.average = msg.average

    def set_members(self, workers: Sequence[int], joiners: Sequence[int]) -> None:
        """The scheduler's membership changed (elastic jobs): rounds stop waiting for workers that
        died; joiners take part from their first push (ShardState.admit)."""
        with self._lock:
            self._live = frozenset(workers)
            gone = (self.rules.members | self.rules.joiners) - self._live
            self.rules.joiners = frozenset(joiners)
            self.rules.members = (self.rules.members & self._live) - self.rules.joiners
            shards = list(self._shards.values())
        self.fence.drop(gone)
        self.arrivals.forget(gone)
        for shard in shards:
            for rank in gone:
                shard.forget(rank)
            shard.apply_complete_rounds()
        self.verdicts.check()
        self.pulls.serve_ready()
        self.tables.members_changed()

    @property
    def members(self) -> frozenset[int]:
        return self.rules.members

    @property
    def mode(self) -> str:
        """The consistency model's name (its policy: self.rules.policy)."""
        return self.rules.policy.name

    def shard_list(self) -> list[Shard]:
        with self._lock:
            return list(self._shards.values())

    def shard_at(self, ident: tuple[Any, int, int]) -> Shard:
        with self._lock:
            shard = self._shards.get(ident)
        if shard is None:
            raise KVError(f"key {ident[0]!r} [{ident[1]}, {ident[2]}) is not on server {self.rank}")
        return shard

    def arena(self) -> Arena:
        """This server's shared-memory arena (shared.py), made on first use."""
        with self._lock:
            return self._own_arena()

    def _own_arena(self) -> Arena:
        """The arena, made on first use (holds self._lock)."""
        if self._arena is None:
            self._arena = Arena()
        return self._arena

    def mirror_region(self, shard: Shard, count: int) -> Region:
        """A backup's buffers for `shard` that its same-host primary writes into (mirror.py)."""
        with self._lock:
            if shard.mirror is None:
                shard.mirror = self._own_arena().region(shard.value.numel(), shard.value.dtype, count)
            return shard.mirror

    def adopt(self, meta: dict) -> Shard:
        """The slice `meta` describes (an install: rejoin.py), made empty here if new."""
        ident = (meta["key"], int(meta["start"]), int(meta["stop"]))
        with self._lock:
            shard = self._shards.get(ident)
            if shard is None:
                if meta["dtype"] not in DTYPES:
                    raise KVError(f"install of key {ident[0]!r} has dtype {meta['dtype']!r}")
                value = torch.zeros(ident[2] - ident[1], dtype=DTYPES[meta["dtype"]])
                shape, numel = list(meta["shape"]), int(meta["numel"])
                shard = ShardState(*ident, numel, shape, meta["dtype"], value, self.rules)
                self.replicator.attach(shard, [int(s) for s in meta["chain"]])
                if self.optimizer_spec:
                    shard.attach_optimizer(*self.optimizer_of(shard.key))
                self._shards[ident] = shard
            return shard

    def _init(self, request: Request, init: p.Init) -> None:
        """Creates or checks each slice; a worker on this host gets where the shared ones are."""
        regions = []
        same_host = request.conn.recv_ring is not None
        for i, key in enumerate(init.keys):
            ident = init.ident(i)
            shape, dtype, numel = list(init.shapes[i]), init.dtypes[i], init.numels[i]
            with self._lock:
                shard = self._shards.get(ident)
                if shard is None:
                    if not request.tensors:
                        raise KVError(self._not_initialized(key, shape, dtype, ident))
                    value = request.tensors[i].reshape(-1)  # may view the ring: keep a copy
                    if value.numel() != ident[2] - ident[1] or dtype not in DTYPES:
                        raise KVError(f"init of key {key!r} sent a value of the wrong size")
                    shard = ShardState(key, ident[1], ident[2], numel, shape, dtype, value, self.rules)
                    self.replicator.attach(shard, init.chain or [self.rank])
                    if same_host and value.numel() and self._shares(shard):
                        self._share(shard)
                    else:
                        shard.value = value.clone()
                    self._shards[ident] = shard
                    if self.optimizer_spec:
                        shard.attach_optimizer(*self.optimizer_of(shard.key))
                elif (shard.shape, shard.dtype) != (shape, dtype):
                    raise KVError(
                        f"key {key!r} was initialized as {shard.dtype}{shard.shape}; "
                        f"init again as {dtype}{shape} is not allowed"
                    )
                region = shard.region
                regions.append([region.offset, region.count] if same_host and region is not None else None)
        if self._arena is not None and any(regions):
            request.reply({"arena": self._arena.describe(), "regions": regions})
        else:
            request.reply({})

    def _not_initialized(self, key: Any, shape: list[int], dtype: str, ident: tuple) -> str:
        """Why a worker's checking init found no slice: worker 0 made the key with another shape
        (so its slices lie elsewhere), or never made it. Holds self._lock."""
        other = next((s for s in self._shards.values() if s.key == key), None)
        if other is not None:
            return (
                f"key {key!r} was initialized by worker 0 as {other.dtype}{other.shape}; this worker's "
                f"init as {dtype}{shape} does not match it"
            )
        return (
            f"key {key!r} (as {dtype}{shape}, elements [{ident[1]}, {ident[2]})) is not on server "
            f"{self.rank}: worker 0 did not initialize it, or with another shape; every worker must "
            "init the same keys with the same shapes, in the same order"
        )

    def _shares(self, shard: Shard) -> bool:
        """Whether a same-host slice lives in shared memory here: with replication only on its
        primary (a backup takes copies; workers fail over to it with their payloads: failover.py)."""
        return not self.replicator.enabled or shard.chain[0] == self.rank

    def _share(self, shard: Shard) -> None:
        """Move a new shard's value into the arena, with round buffers in rounds mode (holds
        self._lock)."""
        count = 1 + self.rules.policy.round_buffers(ROUND_BUFFERS)
        shard.share(self._own_arena().region(shard.value.numel(), shard.value.dtype, count))

    # -- push -------------------------------------------------------------------------------------
    def _push(self, request: Request, msg: p.Push | p.PushPull) -> None:
        rank = msg.rank
        self.fence.check_push(request.conn, rank)
        owned = request.header.at is None  # else the tensors view the ring until handle() returns
        tensors = request.tensors
        if msg.compression is not None:  # decoded into pooled buffers first (compressed.py)
            shard_of = lambda i: self.shard_of(msg.ident(i))  # noqa: E731
            tensors = self.compression.decode_push(request.meta, tensors, shard_of, owned)
            owned = True
        added = _flags(msg.added, len(msg.keys), "added")
        if len(tensors) != added.count(False):
            raise KVError(
                f"push of {len(msg.keys)} slices, {added.count(True)} added, carried {len(tensors)} tensors"
            )
        # Every slice is checked before any is counted: a frame is refused whole, never half-added.
        grads, work = iter(tensors), []
        self.replicator.mark_dead(msg.dead or [])
        policy = self.rules.policy
        for i, was_added in enumerate(added):
            shard = self.shard_of(msg.ident(i))
            push = Push(rank, msg.clocks[i], None if was_added else next(grads), owned, msg.weight)
            push = shard.admit(push)
            if self.replicator.enabled and shard.repeat(push):
                continue  # sent again after a fail-over; the dead primary's backups had it
            shard.check(push)
            work.append((shard, push))
        self.arrivals.pushed(rank, msg.more)
        with self.replicator.batch(self.arrivals.more):  # the backups get these slices in one frame
            for shard, push in work:
                behind = policy.pushed_at(push.clock, shard.version) - shard.read.get(rank, 0)
                self.staleness[max(0, behind)] += 1
                shard.push(push)
        self.pulls.serve_ready()

    def _join(self, rank: int) -> None:
        """A worker that joined the running job (elastic), while the others wait at a barrier: every
        round from the next one on waits for it (ShardState.join)."""
        with self._lock:
            self.rules.joiners = self.rules.joiners | {rank}
            self.rules.members = self.rules.members - {rank}
            shards = list(self._shards.values())
        for shard in shards:
            shard.join(rank)

    def _leave(self, rank: int) -> None:
        """A worker that finished early: rounds stop waiting for it."""
        with self._lock:
            self.rules.members = self.rules.members - {rank}
            self.rules.joiners = self.rules.joiners - {rank}
            shards = list(self._shards.values())
        self.arrivals.forget({rank})
        for shard in shards:
            shard.forget(rank)
            shard.apply_complete_rounds()
        self.verdicts.check()
        self.pulls.serve_ready()
        self.tables.members_changed()

    def _acknowledge(self, request: Request, push: p.Push) -> None:
        """A push's reply: at once, or with replication once its updates are on the backups."""
        if not self.replicator.enabled:
            request.reply({})
            return
        shards = self.shards_of(push)
        needs = self._acknowledged_at(push, [0] * len(shards))
        self.pulls.wait(PendingPull(request, shards, needs, [True] * len(shards), ack_only=True))

    def _acknowledged_at(self, push: p.Push | p.PushPull, min_versions: list[int]) -> list[int]:
        """With replication, a push is acknowledged (or its pushpull answered) only once its
        update is on the backups: the version its push makes (the policy's), or a later one. An
        acknowledged update is never lost."""
        if not self.replicator.enabled:
            return min_versions
        made = self.rules.policy.durable_after
        slices = zip(min_versions, push.clocks, self.shards_of(push), strict=True)
        return [max(v, made(clock, shard.version)) for v, clock, shard in slices]

    # -- pull -------------------------------------------------------------------------------------
    def _pull(self, request: Request, pull: p.Pull | p.PushPull, min_versions: list[int]) -> None:
        shards = self.shards_of(pull)
        read = _flags(pull.read, len(shards), "read")
        for shard, reads in zip(shards, read, strict=True):
            if reads and shard.region is None:
                raise KVError(f"{shard.describe()} is not in shared memory: it cannot be read there")
        needs = [s.pull_version(pull.rank, v) for s, v in zip(shards, min_versions, strict=True)]
        self.pulls.wait(PendingPull(request, shards, needs, read))

    def _refuse(self, request: Request, message: str) -> None:
        try:
            request.fail(message)
        except TransportError as exc:
            logger.debug("server %d: an error to %s was not sent: %s", self.rank, request.conn.peer, exc)

    def close(self) -> None:
        """The job ended (after the RpcServer closed): the threads that send replies end before the
        process exits (replies.py, ReplySenders.close_all)."""
        self.pulls.close()
        self.tables.close()

    def disconnected(self, conn: Connection, error: Exception | None) -> None:
        self.pulls.disconnected(conn)

    # -- optimizer --------------------------------------------------------------------------------
    def set_optimizer(self, path: str, hyper: dict) -> None:
        self._set_optimizer(path, hyper)

    def _set_optimizer(self, path: str, hyper: dict) -> None:
        optim.resolve(path)
        optim.check_hyperparameters(hyper)
        self.tables.set_default_optimizer(path, hyper)
        with self._lock:
            self.optimizer_spec = (path, hyper)
            shards = list(self._shards.values())
        for shard in shards:
            shard.attach_optimizer(path, hyper | self.key_hyper.get(shard.key, {}))

    def set_hyper(self, keys: list, hyper: dict) -> None:
        optim.check_hyperparameters(hyper)
        wanted = set(keys)
        with self._lock:
            for key in keys:
                self.key_hyper[key] = self.key_hyper.get(key, {}) | hyper
            shards = [shard for shard in self._shards.values() if shard.key in wanted]
        for shard in shards:
            shard.set_hyper(hyper)

    # -- clipping by the global norm -----------------------------------------------------------------
    def _clip_by_norm(self) -> None:
        if self.rules.policy != Sync() or self.replicator.replication > 1:
            raise KVError("clipping on the servers needs sync rounds and no replication")
        self.rules.clip = True

    def norm_share(self, clock: int) -> float:
        """This server's share of the squared norm of round `clock`'s mean: blocks this worker's
        connection until each slice has the round complete (its pushes of the round came first)."""
        return sum(shard.norm_share(clock) for shard in self.shard_list())

    def clip_scale(self, clock: int, scale: float) -> None:
        for shard in self.shard_list():
            shard.set_scale(clock, float(scale))
        self.pulls.serve_ready()

    # -- fp16: every worker's overflow check of a round (overflow.py) -------------------------------
    def _check_overflow(self) -> None:
        if self.rules.policy != Sync() or self.replicator.replication > 1:
            raise KVError("overflow checks on the servers need sync rounds and no replication")
        self.rules.overflow = True

    def _overflow_verdict(self, clock: int, overflowed: bool) -> None:
        for shard in self.shard_list():
            shard.set_verdict(clock, overflowed)
        self.pulls.serve_ready()

    def optimizer_of(self, key: Any) -> tuple[str, dict]:
        """The optimizer a new slice of `key` gets: set_optimizer's, with the key's set_hyper."""
        assert self.optimizer_spec is not None
        path, hyper = self.optimizer_spec
        return path, hyper | self.key_hyper.get(key, {})

    # -- state ------------------------------------------------------------------------------------
    def _get_state(self, request: Request, _: p.GetState) -> None:
        """Every shard's value and optimizer state, each tagged with its key and element range."""
        entries, tensors = [], []
        with self._lock:
            shards = list(self._shards.values())
        for shard in shards:
            entry, parts = shard.state()
            extra = self.compression.state_tensors(shard)  # its pull residual (compressed.py)
            entry["state"] += list(extra)
            entries.append(entry)
            tensors += parts + [t.clone() for t in extra.values()]
        with self._lock:
            hyper = [[key, values] for key, values in self.key_hyper.items()]
        optimizer = list(self.optimizer_spec or ())
        request.reply({"shards": entries, "optimizer": optimizer, "hyper": hyper}, tensors)

    def _set_state(self, request: Request, msg: p.SetState) -> None:
        tensors, i = request.tensors, 0
        for entry in msg.shards:
            shard = self.shard_of((entry["key"], entry["start"], entry["stop"]))
            value, state = tensors[i], dict(zip(entry["state"], tensors[i + 1 :], strict=False))
            i += 1 + len(entry["state"])
            state = self.compression.load_state(shard, state)  # its pull residual (compressed.py)
            shard.load(value, state)
        self.verdicts.reset()
        request.reply({})


def _flags(flags: list | None, count: int, name: str) -> list[bool]:
    """Per-slice flags `added` / `read` (shared shards); all false when absent."""
    if flags is None:
        return [False] * count
    if not isinstance(flags, list) or len(flags) != count:
        raise KVError(f"{name!r} must be a list with one flag per key")
    return [bool(f) for f in flags]


def _replying(act: Callable[[Any], None]) -> Callable[[Request, Any], None]:
    """A handler that does `act(message)`, then replies `{}`."""

    def handle(request: Request, msg: Any) -> None:
        act(msg)
        request.reply({})

    return handle
