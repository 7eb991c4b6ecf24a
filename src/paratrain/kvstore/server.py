"""The parameter server: shards of dense keys, rounds, optimizers, and deferred pulls.

Requests (meta lists are parallel; every tensor is one flat slice of one key):

    configure     {mode: "rounds" | "async", members}               from worker 0, before any init
    init          {keys, starts, stops, shapes, dtypes, numels}     values, or none: check only
    push          {keys, starts, stops, clocks, [added]}            gradients; reply once added
    pull          {keys, starts, stops, min_versions, [read]}       reply carries the values
    pushpull      push and pull of the same slices in one frame
    set_optimizer {path, hyper}                                     from worker 0
    leave         {rank}                                            that worker pushes no more
    waiting       {keys, starts, stops, min_versions, rank}         from a worker whose call waits
                  long: per slice behind min_version, its round and the workers that have not
                  pushed it (logged here too, so that no wait is silent on either side)
    get_state / set_state                                           for save_state / load_state
    sparse_*                                                        sparse tables (sparse.py)

Consistency. In "rounds" mode (sync, and bounded staleness) a worker's n-th push of a key joins round
n of that key; round n is applied (summed value, or one optimizer step on the sum) once every live
worker has pushed to it, rounds in order, and the key's version becomes n+1. A pull waits until the
version reaches the `min_version` the worker sends: its own clock for sync, minus the staleness
bound s for bounded(s) (the server itself never needs s). In "async" mode each push is applied on
arrival (an optimizer step, or, without an optimizer, added to the value) and pulls never wait.

Zero copies on the hot path: a push is received straight into a pooled buffer of its shard (or, from
a worker on this host, read in place from the shared-memory ring); the first push of a round becomes
that round's accumulator, later ones are added into it in place. A
pull is sent straight from the shard's value; a round is applied only when no pull is being sent
from that value (a reader count), so no pull ever returns a half-applied round.

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
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from paratrain.kvstore import optim
from paratrain.kvstore.compressed import ServerCompression
from paratrain.kvstore.shared import Arena, Region
from paratrain.kvstore.sparse import SparseTables
from paratrain.transport.connection import Connection
from paratrain.transport.frame import Header
from paratrain.transport.rpc import Handler, Request
from paratrain.transport.tensors import DTYPES

logger = logging.getLogger(__name__)

# Spent gradient buffers a shard keeps for reuse (a fresh big tensor costs page faults). Buffers in
# use are bounded too: one per push being received, plus one accumulator per round in flight (at
# most staleness + 1 rounds, since pulls hold workers back).
POOL_BUFFERS = 4
# Buffers of a shared shard (shared.py) besides its value: rounds that same-host workers can push
# into directly. Two let a worker push round r + 1 while round r waits for a slow worker.
ROUND_BUFFERS = 2
COUNTS = ("pushes", "pulls", "bytes_in", "bytes_out")


class KVError(Exception):
    """A request this server refuses; the worker gets the message."""


@dataclass
class Shard:
    """Elements [start, stop) of one key, held by this server."""

    key: Any
    start: int
    stop: int
    numel: int
    shape: list[int]
    dtype: str
    value: torch.Tensor
    version: int = 0
    rounds: dict[int, tuple[torch.Tensor, set[int]]] = field(default_factory=dict)
    pool: list[torch.Tensor] = field(default_factory=list)
    readers: int = 0
    param: torch.nn.Parameter | None = None
    optimizer: torch.optim.Optimizer | None = None
    cond: threading.Condition = field(default_factory=threading.Condition)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    """What this shard has served: pushes, pulls and their bytes (read by `stats`)."""
    region: Region | None = None
    """Shared shards only: the value is region.buffers[value_buffer]; opened maps a round to the
    buffer open for its pushes."""
    value_buffer: int = 0
    opened: dict[int, int] = field(default_factory=dict)

    def buffer(self) -> torch.Tensor:
        with self.cond:
            return self.pool.pop() if self.pool else torch.empty_like(self.value)

    def recycle(self, buffer: torch.Tensor) -> None:
        """Keep a spent buffer for the next push, up to POOL_BUFFERS per shard; free the rest."""
        if len(self.pool) < POOL_BUFFERS:
            self.pool.append(buffer)

    def describe(self) -> str:
        return f"key {self.key!r} [{self.start}, {self.stop})"

    def writing(self) -> AbstractContextManager[None]:
        """Hold while changing the value in place: waits for same-host workers reading it."""
        return self.region.writing(self.value_buffer) if self.region is not None else nullcontext()

    def open_free_buffers(self) -> None:
        """Open every idle shared buffer for the next round that has neither a buffer nor a
        payload-built sum; holds cond."""
        if self.region is None:
            return
        busy = {self.value_buffer, *self.opened.values()}
        for b in range(self.region.count):
            if b not in busy:
                round_ = self.version
                while round_ in self.opened or round_ in self.rounds:
                    round_ += 1
                self.region.open(b, round_)
                self.opened[round_] = b


@dataclass
class PendingPull:
    request: Request
    shards: list[Shard]
    min_versions: list[int]
    read: list[bool]
    """Per shard: the worker copies it out of shared memory itself (no tensor in the reply)."""

    def ready(self) -> bool:
        return all(s.version >= v for s, v in zip(self.shards, self.min_versions, strict=True))


class KVServer(Handler):
    ring_views = True  # same-host pushes are summed straight out of the shared-memory ring

    def __init__(self, rank: int = 0, intra_op_threads: int | None = 1) -> None:
        """`intra_op_threads`: torch's threads per operation in this (server) process, None to leave
        torch's choice. One by default: a server already runs a thread per connection, and torch's
        pool on top of them oversubscribes cores that workers share. Measured on 2 loaded cores, a
        gather of 4,150 rows of 16 took 19 ms with torch's 2 threads and 0.15 ms with one."""
        if intra_op_threads is not None:
            torch.set_num_threads(intra_op_threads)
        self.rank = rank
        self.mode = "rounds"
        self.members: set[int] = set()
        self.optimizer_spec: tuple[str, dict] | None = None
        self._shards: dict[tuple[Any, int, int], Shard] = {}
        self._lock = threading.Lock()
        self._pending: list[PendingPull] = []
        self._arena: Arena | None = None  # shared shards, made on the first same-host init
        self.tables = SparseTables(self)  # sparse tables: ops sparse_* (sparse.py)
        self.compression = ServerCompression()  # compressed pushes and pulls (compressed.py)

    # -- receiving pushes straight into pooled buffers --------------------------------------------
    def destinations(self, conn: Connection, header: Header) -> Sequence[torch.Tensor] | None:
        if header.op not in ("push", "pushpull") or header.at is not None:
            return None  # no payload, or a same-host one: read in place from the ring
        if "compression" in header.meta:
            return None  # compressed: decoded into pooled buffers in _push
        try:
            carried = [i for i, added in enumerate(self._flags(header.meta, "added")) if not added]
            return [self._shard(header.meta, i).buffer() for i in carried[: len(header.specs)]]
        except (KVError, KeyError, IndexError, TypeError):
            return None  # handle() reports it; the payload goes to fresh tensors meanwhile

    @staticmethod
    def _flags(meta: dict, name: str) -> list[bool]:
        """Per-slice flags `added` / `read` (shared shards); all false when absent."""
        flags = meta.get(name)
        if flags is None:
            return [False] * len(meta["keys"])
        if not isinstance(flags, list) or len(flags) != len(meta["keys"]):
            raise KVError(f"{name!r} must be a list with one flag per key")
        return [bool(f) for f in flags]

    def _shard(self, meta: dict, i: int) -> Shard:
        ident = (meta["keys"][i], meta["starts"][i], meta["stops"][i])
        shard = self._shards.get(ident)
        if shard is None:
            raise KVError(
                f"key {ident[0]!r} [{ident[1]}, {ident[2]}) is not on server {self.rank}: was it "
                "initialized, and did every worker init its keys in the same order?"
            )
        return shard

    # -- dispatch ---------------------------------------------------------------------------------
    def handle(self, request: Request) -> None:
        op = request.op
        try:
            if op == "push":
                self._push(request)
                request.reply({})
            elif op == "pull":
                self._pull(request, request.meta["min_versions"])
            elif op == "pushpull":
                self._push(request)
                self._pull(request, request.meta["min_versions"])
            elif op == "init":
                self._init(request)
            elif op == "configure":
                self._configure(request.meta)
                request.reply({})
            elif op == "set_optimizer":
                self._set_optimizer(request.meta["path"], request.meta["hyper"])
                request.reply({})
            elif op == "leave":
                self._leave(int(request.meta["rank"]))
                request.reply({})
            elif op == "get_state":
                self._get_state(request)
            elif op == "set_state":
                self._set_state(request)
            elif op == "ping":
                request.reply(request.meta, request.tensors)
            elif op == "stats":
                request.reply(self._stats())
            elif op == "waiting":
                request.reply({"waits": self._waiting(request.meta)})
            elif op in SparseTables.OPS:
                self.tables.handle(request)
            else:
                request.fail(f"unknown op {op!r}")
        except (KVError, ValueError, TypeError, KeyError) as exc:
            request.fail(f"server {self.rank}: {exc}")

    def _configure(self, meta: dict) -> None:
        mode, members = meta["mode"], meta["members"]
        if mode not in ("rounds", "async"):
            raise ValueError(f"mode {mode!r} is not 'rounds' or 'async'")
        with self._lock:
            self.mode = mode
            self.members = {int(rank) for rank in members}

    def _init(self, request: Request) -> None:
        """Creates or checks each slice; a worker on this host gets where the shared ones are."""
        meta, regions = request.meta, []
        same_host = request.conn.recv_ring is not None
        for i, key in enumerate(meta["keys"]):
            ident = (key, meta["starts"][i], meta["stops"][i])
            shape, dtype, numel = list(meta["shapes"][i]), meta["dtypes"][i], meta["numels"][i]
            with self._lock:
                shard = self._shards.get(ident)
                if shard is None:
                    if not request.tensors:
                        raise KVError(self._not_initialized(key, shape, dtype, ident))
                    value = request.tensors[i].reshape(-1)  # may view the ring: keep a copy
                    if value.numel() != ident[2] - ident[1] or dtype not in DTYPES:
                        raise KVError(f"init of key {key!r} sent a value of the wrong size")
                    shard = Shard(key, ident[1], ident[2], numel, shape, dtype, value)
                    if same_host and value.numel():
                        self._share(shard)
                    else:
                        shard.value = value.clone()
                    self._shards[ident] = shard
                    if self.optimizer_spec:
                        self._attach_optimizer(shard, *self.optimizer_spec)
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

    def _share(self, shard: Shard) -> None:
        """Move a new shard's value into the arena, with round buffers in rounds mode."""
        if self._arena is None:
            self._arena = Arena()
        count = 1 + (ROUND_BUFFERS if self.mode == "rounds" else 0)
        region = self._arena.region(shard.value.numel(), shard.value.dtype, count)
        region.buffers[0].copy_(shard.value)
        region.publish(0, 0)
        shard.region, shard.value, shard.value_buffer = region, region.buffers[0], 0
        with shard.cond:
            shard.open_free_buffers()

    # -- push -------------------------------------------------------------------------------------
    def _push(self, request: Request) -> None:
        meta, rank = request.meta, int(request.meta["rank"])
        owned = request.header.at is None  # else the tensors view the ring until handle() returns
        tensors = request.tensors
        if "compression" in meta:  # decoded into pooled buffers first (compressed.py)
            tensors = self.compression.decode_push(meta, tensors, lambda i: self._shard(meta, i), owned)
            owned = True
        added = self._flags(meta, "added")
        if len(tensors) != added.count(False):
            raise KVError(
                f"push of {len(meta['keys'])} slices, {added.count(True)} added, carried "
                f"{len(tensors)} tensors"
            )
        # Every slice is checked before any is counted: a frame is refused whole, never half-added.
        grads, work = iter(tensors), []
        for i, was_added in enumerate(added):
            shard = self._shard(meta, i)
            grad = None if was_added else next(grads)
            if grad is not None and (grad.dtype != shard.value.dtype or grad.numel() != shard.value.numel()):
                raise KVError(f"push to {shard.describe()}: {grad.dtype}[{grad.numel()}] does not match")
            if self.mode == "async" and grad is None:
                raise KVError(f"push to {shard.describe()}: async pushes carry their payload")
            if self.mode != "async":
                self._check_round(shard, int(meta["clocks"][i]), rank, grad is None)
            work.append((i, shard, grad))
        for i, shard, grad in work:
            shard.counts["pushes"] += 1
            shard.counts["bytes_in"] += shard.value.numel() * shard.value.element_size()
            if self.mode == "async":
                self._apply(shard, grad)  # consumed here: a view of the ring will do
                if owned:
                    with shard.cond:
                        shard.recycle(grad)
            else:
                self._add_to_round(shard, int(meta["clocks"][i]), rank, grad, owned)
        self._serve_ready_pulls()

    def _add_to_round(
        self, shard: Shard, clock: int, rank: int, grad: torch.Tensor | None, owned: bool
    ) -> None:
        """`grad` None: the worker added it into the round's shared buffer itself. _push checked
        the push (_check_round); only this worker's own frames change that check's answer."""
        with shard.cond:
            entry = shard.rounds.get(clock)
            b = shard.opened.get(clock)
            if b is not None:  # the round sums in a shared buffer
                assert shard.region is not None
                if grad is not None and not shard.region.add(clock, grad):
                    raise KVError(f"{shard.describe()}: round {clock}'s buffer closed early")
                acc = shard.region.buffers[b]
                if grad is not None and owned:
                    shard.recycle(grad)
            elif entry is None:  # the first push becomes the round's accumulator
                acc = grad if owned else shard.buffer().copy_(grad)  # cond is re-entrant
            else:
                acc = entry[0]
                acc.add_(grad)
                if owned:
                    shard.recycle(grad)
            if entry is None:
                shard.rounds[clock] = (acc, {rank})
            else:
                entry[1].add(rank)
            self._apply_complete_rounds(shard)

    @staticmethod
    def _check_round(shard: Shard, clock: int, rank: int, added: bool) -> None:
        """Whether `rank` may push to round `clock` of `shard` (`added`: into its shared buffer)."""
        with shard.cond:
            if clock < shard.version:
                raise KVError(f"push to {shard.describe()} for round {clock}, already applied")
            entry = shard.rounds.get(clock)
            if entry is not None and rank in entry[1]:
                raise KVError(f"worker {rank} pushed {shard.describe()} twice in round {clock}")
            if added and clock not in shard.opened:
                raise KVError(f"{shard.describe()}: no shared buffer is open for round {clock}")

    def _apply_complete_rounds(self, shard: Shard) -> None:
        """Apply rounds that every live worker has pushed to, in order; holds shard.cond."""
        while True:
            entry = shard.rounds.get(shard.version)
            if entry is None or not self.members <= entry[1]:
                return
            if shard.readers:  # a pull is being sent from the value: wait, then look again
                shard.cond.wait()
                continue
            del shard.rounds[shard.version]
            b = shard.opened.pop(shard.version, None)
            if b is not None:
                assert shard.region is not None
                shard.region.close_round(b)
            self._apply(shard, entry[0], locked=True, buffer=b)
            if b is None and entry[0] is not shard.value:  # spent: an optimizer's or a copy's input
                shard.recycle(entry[0])
            shard.open_free_buffers()

    def _apply(
        self, shard: Shard, grad: torch.Tensor, locked: bool = False, buffer: int | None = None
    ) -> None:
        """One update: an optimizer step, or without one the round's sum (rounds) or the running
        sum (async). Waits until no pull is reading the value. `buffer`: the shared buffer that
        holds `grad` (it is returned to the shard's free buffers)."""
        if not locked:
            with shard.cond:
                return self._apply(shard, grad, locked=True)
        while shard.readers:
            shard.cond.wait()
        if shard.optimizer is None and self.mode != "async" and (buffer is not None or shard.region is None):
            # The round's sum becomes the value: no reader holds the old one (the reader count;
            # same-host readers hold a lock on its buffer, which open_free_buffers waits for).
            if buffer is None:
                shard.recycle(shard.value)
            else:  # before the version moves: a pull found ready (without cond) reads it at once
                assert shard.region is not None
                shard.region.publish(buffer, shard.version + 1)
                shard.value_buffer = buffer
            shard.value, shard.version = grad, shard.version + 1
            return
        with shard.writing():
            if shard.optimizer is not None:
                assert shard.param is not None
                shard.param.grad = grad
                shard.optimizer.step()
                shard.param.grad = None
            elif self.mode == "async":
                shard.value.add_(grad)
            else:  # a round summed outside the shared buffers: into the shared value
                shard.value.copy_(grad)
            shard.version += 1
            if shard.region is not None:
                shard.region.stamp(shard.version)

    def _leave(self, rank: int) -> None:
        """A worker that finished early: rounds stop waiting for it."""
        with self._lock:
            self.members.discard(rank)
            shards = list(self._shards.values())
        for shard in shards:
            with shard.cond:
                self._apply_complete_rounds(shard)
        self._serve_ready_pulls()
        self.tables.members_changed()

    # -- pull -------------------------------------------------------------------------------------
    def _pull(self, request: Request, min_versions: list[int]) -> None:
        meta = request.meta
        shards = [self._shard(meta, i) for i in range(len(meta["keys"]))]
        read = self._flags(meta, "read")
        for shard, reads in zip(shards, read, strict=True):
            if reads and shard.region is None:
                raise KVError(f"{shard.describe()} is not in shared memory: it cannot be read there")
        pending = PendingPull(request, shards, [int(v) for v in min_versions], read)
        with self._lock:
            self._pending.append(pending)
        self._serve_ready_pulls()

    def _serve_ready_pulls(self) -> None:
        ready: list[PendingPull] = []
        with self._lock:
            waiting = []
            for pull in self._pending:
                (ready if pull.ready() else waiting).append(pull)
            self._pending = waiting
        for pull in ready:
            self._send_values(pull)

    def _send_values(self, pull: PendingPull) -> None:
        sent = [shard for shard, reads in zip(pull.shards, pull.read, strict=True) if not reads]
        values = []
        for shard in sent:
            with shard.cond:
                shard.readers += 1
                values.append(shard.value)
        try:
            extra, values = self.compression.encode_pull(pull.request.meta, sent, values)
            pull.request.reply({"versions": [s.version for s in sent], **extra}, values)  # readers see theirs
            for shard in pull.shards:
                shard.counts["pulls"] += 1
                shard.counts["bytes_out"] += shard.value.numel() * shard.value.element_size()
        finally:
            for shard in sent:
                with shard.cond:
                    shard.readers -= 1
                    shard.cond.notify_all()

    def _waiting(self, meta: dict) -> list[dict]:
        """The rounds that hold back a waiting worker's pulls: per slice below its min_version,
        the round applied next and the members that have not pushed it."""
        rank, waits = int(meta["rank"]), []
        with self._lock:
            members = set(self.members)
        for i in range(len(meta["keys"])):
            shard, need = self._shard(meta, i), int(meta["min_versions"][i])
            with shard.cond:
                if shard.version >= need:
                    continue
                entry = shard.rounds.get(shard.version)
                pushed = set(entry[1]) if entry is not None else set()
                missing = sorted(members - pushed)
                waits.append({"key": shard.key, "start": shard.start, "stop": shard.stop})
                waits[-1] |= {"version": shard.version, "round": shard.version, "missing": missing}
        if waits:
            logger.warning(
                "server %d: worker %d waits for %s",
                self.rank,
                rank,
                "; ".join(
                    f"round {w['round']} of key {w['key']!r} [{w['start']}, {w['stop']}), which worker(s) "
                    f"{', '.join(map(str, w['missing'])) or 'none (being applied)'} have not pushed"
                    for w in waits[:8]
                )
                + (f"; and {len(waits) - 8} more slices" if len(waits) > 8 else ""),
            )
        return waits

    def _stats(self) -> dict:
        """Per shard: its counts, version, open rounds and the pulls waiting on it (queue depth)."""
        with self._lock:
            shards = list(self._shards.values())
            waiting = [s for pull in self._pending for s in pull.shards]
        return {
            "shards": [
                {
                    "key": s.key,
                    "start": s.start,
                    "stop": s.stop,
                    "version": s.version,
                    "open_rounds": len(s.rounds),
                    "waiting_pulls": sum(1 for w in waiting if w is s),
                    **s.counts,
                }
                for s in shards
            ]
        }

    # -- optimizer --------------------------------------------------------------------------------
    def _set_optimizer(self, path: str, hyper: dict) -> None:
        optim.resolve(path)
        optim.check_hyperparameters(hyper)
        self.tables.set_default_optimizer(path, hyper)
        with self._lock:
            self.optimizer_spec = (path, hyper)
            shards = list(self._shards.values())
        for shard in shards:
            with shard.cond:
                self._attach_optimizer(shard, path, hyper)

    def _attach_optimizer(self, shard: Shard, path: str, hyper: dict) -> None:
        shard.param = torch.nn.Parameter(shard.value, requires_grad=True)
        shard.value = shard.param.data
        shard.optimizer = optim.build(path, hyper, shard.param)

    # -- state ------------------------------------------------------------------------------------
    def _get_state(self, request: Request) -> None:
        """Every shard's value and optimizer state, each tagged with its key and element range."""
        entries, tensors = [], []
        with self._lock:
            shards = list(self._shards.values())
        for shard in shards:
            with shard.cond:
                state = optim.state_tensors(shard.optimizer, shard.param) if shard.optimizer else {}
                state |= self.compression.state_tensors(shard)
                entries.append(
                    {
                        "key": shard.key,
                        "start": shard.start,
                        "stop": shard.stop,
                        "numel": shard.numel,
                        "shape": shard.shape,
                        "dtype": shard.dtype,
                        "version": shard.version,
                        "state": list(state),
                    }
                )
                tensors += [shard.value.clone()] + [t.clone() for t in state.values()]
        request.reply({"shards": entries, "optimizer": list(self.optimizer_spec or ())}, tensors)

    def _set_state(self, request: Request) -> None:
        meta, tensors, i = request.meta, request.tensors, 0
        for entry in meta["shards"]:
            shard = self._shard(
                {"keys": [entry["key"]], "starts": [entry["start"]], "stops": [entry["stop"]]}, 0
            )
            value, state = tensors[i], dict(zip(entry["state"], tensors[i + 1 :], strict=False))
            i += 1 + len(entry["state"])
            state = self.compression.load_state(shard, state)  # its pull residual (compressed.py)
            with shard.cond:
                while shard.readers:
                    shard.cond.wait()
                with shard.writing():
                    shard.value.copy_(value.reshape(-1))
                    shard.version, shard.rounds = 0, {}
                    if shard.region is not None:
                        shard.region.stamp(0)
                for b in shard.opened.values():  # every buffer opens again, from round 0
                    shard.region.close_round(b)
                shard.opened = {}
                shard.open_free_buffers()
                if state:
                    if shard.optimizer is None:
                        raise KVError("the state has optimizer state: call set_optimizer before load_state")
                    optim.load_state_tensors(shard.optimizer, shard.param, state)
        request.reply({})
