"""Replicated servers on one machine: a backup takes a slice's new value in memory, without the
bytes going over TCP (replica.py sends the rest of the copy, and the order, over TCP).

Over TCP a copy moves each byte twice through the kernel (the primary's send, the backup's
receive) and wakes both sides for every chunk: on one machine, 27 ms per round for 32 MB on a round
of 23 ms (benchmarks/failures_servers.py). Two ways here, both only between servers on one host
(shared.same_host) with the same-host path on (TransportConfig.shm_ring_bytes > 0):

**Lending (no copy at all)**, for a primary's shared slice whose round's sum becomes the value
(ShardState.lendable: rounds mode, no server optimizer; the update runs on the workers). The round
is summed in a buffer of the primary's arena (shared.py: the workers add their pushes into it) and
that buffer becomes the value; the `replicate` frame names it (`lent`: the arena, the region and
the buffer) and the backup maps it (Borrowed) and makes it its value. It answers which of the
primary's buffers it holds (`holds`), and the primary counts as lent (`ShardState.lent`) the one
the backup said it holds and every one named in a frame not answered yet: such a buffer opens for
no round and is written by no one until the backup answered a later frame (Mirrors.release, from
the confirming thread). So the primary never writes a buffer the backup holds: a primary that dies
mid-round leaves the backup its last whole value, and the mapping outlives the primary's process.
A round that finds every buffer lent waits (ShardState.stall) for one to come back. The slices one
push frame completes go to each backup in one frame {slices: [...]} (Batch, Replicator.batch),
together with those of the push frames before it while more of their round is coming (outbox.py).
A backup never writes a borrowed buffer: it never pools one, an optimizer's parameter never
borrows one, and once it takes over (its primary died or the job lost it: ShardState.disown) or
loads a checkpoint, it copies the value into its own memory first. Before a primary writes its
value in place (an optimizer set later, a checkpoint loaded: ShardState.reclaim) it sends the
backups a copy and waits until they no longer hold the buffer.

**Mirroring (one memcpy)**, for the rest (a server optimizer, async). The backup owns two buffers
per slice in its shared-memory arena (op `mirror` makes them and says where they are), and the
primary maps them. To copy a new state it copies the value into the buffer the backup does not
hold (one memcpy), then sends the usual `replicate` frame with `buffer: b` and without the value
(the optimizer state and the clocks still ride in the frame). The backup, on that frame, makes
buffer b its value (no copy) and replies. A primary that dies mid-copy never leaves the backup a
torn value: the backup's value is the buffer of the last frame it took, and the primary writes only
into the other one, and only once the backup replied to its previous frame. When the previous
frame is not answered yet (async pushes applied back to back), the copy goes over TCP. A
backup never gives its buffers to its pool of push buffers (ShardState.recycle), so a late write
of a primary the job lost (fence.py) never lands in a buffer the backup uses for something else;
frames from such a sender are refused anyway. Memory: a backup holds two sets of buffers per slice
it mirrors (its value is in one of them), where a copy over TCP needs one.

In both, the primary's acknowledgements wait for the backup's reply, as over TCP. A backup that
refuses or cannot be mapped gets copies over TCP (mirroring). Before its first loan a backup is
asked whether it maps the primary's memory (op `borrow`); one that cannot (another PID or IPC
namespace on the same host) is lent nothing and gets its copies as with mirroring.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from paratrain.errors import RemoteError, TransportError
from paratrain.kvstore import protocol
from paratrain.kvstore.api import KVError
from paratrain.kvstore.protocol import Replicate
from paratrain.kvstore.shared import TOKEN_BYTES, ArenaMap, Region
from paratrain.transport.client import Future, Reply, RpcClient
from paratrain.transport.tensors import DTYPES

if TYPE_CHECKING:
    from paratrain.kvstore.server.outbox import Outbox
    from paratrain.kvstore.server.server import KVServer
    from paratrain.kvstore.server.shard import ShardState

logger = logging.getLogger(__name__)

SETS = 2  # the set the backup holds, and the one written
MAX_SLOTS = 4  # a value and up to 3 optimizer state tensors of its size (Adam has 2) per set
MIRROR_TIMEOUT_S = 30.0  # the `mirror` call is made holding the slice's lock, once per backup


@dataclass
class Link:
    """One slice's buffers on one backup, as the primary sees them."""

    region: Region | None
    """None: this backup gets this slice's copies over TCP. Else SETS sets of `slots` buffers:
    set b is buffers[b * slots:(b + 1) * slots], the value then optimizer state tensors."""
    slots: int = 1
    held: int | None = None
    """The set the backup holds (that of the last frame with a set), None: neither."""
    last: Future | None = None
    """The last frame sent to this backup for this slice (with a buffer or not)."""

    def free(self) -> int | None:
        """The set to write the next state into, None where none is surely free: the backup has
        not answered the last frame yet (it may still hold the other set)."""
        if self.region is None or (self.last is not None and not self.last.done()):
            return None
        return 0 if self.held is None else 1 - self.held


class Part:
    """One slice's share of a `replicate` frame that lends several slices (Batch): its reply is
    that frame's, with this slice's `holds`."""

    __slots__ = ("index", "whole", "outbox")

    def __init__(self, index: int) -> None:
        self.index = index
        self.whole: Future | None = None  # set when the frame is sent (outbox.py)
        self.outbox: Outbox | None = None  # where it waits to be sent

    def done(self) -> bool:
        return self.whole is not None and self.whole.done()

    def wait(self, timeout_s: float | None = None) -> Reply:
        if self.whole is None and self.outbox is not None:
            self.outbox.wait_sent(self)  # it waits for more of its round: not long (outbox.py)
        assert self.whole is not None, "a batch's copies are confirmed only once it is sent"
        holds = self.whole.wait(timeout_s).meta.get("holds")
        return Reply({"holds": holds[self.index] if isinstance(holds, list) else None})


@dataclass
class Batch:
    """The slices one thread's push frame completed (server.py, `_push`): each backup gets their
    lent values in one `replicate` frame, {slices: [...]}, once the frame's slices are applied."""

    frames: dict[int, tuple[list[dict], list[Part]]] = field(default_factory=dict)
    """Per backup: the slices' metas and their parts, in the order applied."""
    confirms: list[tuple] = field(default_factory=list)
    """What the confirming thread awaits (replica.py), queued once sent."""


@dataclass
class Lend:
    """One slice's value as lent to one backup, as the primary sees it."""

    held: int | None = None
    """The buffer of the primary's region the backup said it holds (its last reply)."""
    pending: deque[tuple[int | None, Future | Part]] = field(default_factory=deque)
    """The frames not yet answered: the buffer each lent (None: a copy), and its reply."""

    def lent(self) -> set[int]:
        named = {b for b, _ in self.pending if b is not None}
        return named if self.held is None else named | {self.held}


class Mirrors:
    """A primary's maps of its same-host backups' buffers, per backup and slice, and what it
    lends them of its own."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._arenas: dict[int, ArenaMap | None] = {}  # None: cannot be mapped, TCP for all
        self._links: dict[tuple[int, Any, int, int], Link] = {}
        self._lends: dict[tuple[Any, int, int], dict[int, Lend]] = {}  # by slice, then backup
        self._tokens: dict[int, bytes] = {}  # this server's arena's token, by its descriptor
        self._borrowers: dict[int, bool] = {}  # by backup: whether it maps this server's arena
        self._retired: list[ArenaMap] = []
        self._lock = threading.Lock()  # one `mirror` call and map per backup and slice

    def send(
        self, server: int, client: RpcClient, shard: ShardState, copy: Replicate, tensors: list[torch.Tensor]
    ) -> Future:
        """Send one slice's copy (holds shard.cond): lend the value where the shard allows it, else
        the value through the backup's buffer where one is free, else in the frame."""
        lends = self._lends.get((shard.key, shard.start, shard.stop), {})
        lend = lends.get(server)
        if shard.lendable() and self.lends_to(server, client, shard):
            assert shard.region is not None
            if lend is None:
                lend = lends[server] = Lend()
                self._lends[(shard.key, shard.start, shard.stop)] = lends
            region, b = shard.region, shard.value_buffer
            lent = [*self._own_arena(shard), region.offset, region.count, b]
            future = client.request(*dataclasses.replace(copy, lent=lent).wire(), tensors[1:])
        else:
            b, future = None, self._copy(server, client, shard, copy, tensors)
        if lend is not None:
            lend.pending.append((b, future))
            shard.lent = frozenset(self._lent(shard))
        return future

    def lends_to(self, server: int, client: RpcClient, shard: ShardState) -> bool:
        """Whether `server` maps this server's memory, asked once (op `borrow`, holding the
        slice's lock, as `mirror` is): a backup that cannot (another PID or IPC namespace on the
        same host) gets its copies through its own buffers or over TCP instead of being lent."""
        known = self._borrowers.get(server)
        if known is not None:
            return known
        try:
            borrow = protocol.Borrow(self._own_arena(shard))
            reply = client.call(*borrow.wire(), timeout_s=MIRROR_TIMEOUT_S)
        except (RemoteError, TransportError, TimeoutError) as exc:  # asked again at the next copy
            logger.info(
                "server %d: server %d did not say whether it maps this server: %s", self.rank, server, exc
            )
            return False
        maps = self._borrowers[server] = reply.meta.get("maps") is True
        if not maps:
            why = reply.meta.get("why")
            logger.warning(
                "server %d: server %d cannot map this server's memory (%s): no lending",
                self.rank,
                server,
                why,
            )
        return maps

    def defer(self, server: int, shard: ShardState, copy: Replicate, batch: Batch) -> Part:
        """Lend the value to `server` in `batch`'s next frame to it, sent by Batch.flush (holds
        shard.cond; shard.lendable()): the buffer counts as lent from now on."""
        assert shard.region is not None
        ident = (shard.key, shard.start, shard.stop)
        lends = self._lends.setdefault(ident, {})
        lend = lends.get(server)
        if lend is None:
            lend = lends[server] = Lend()
        region, b = shard.region, shard.value_buffer
        metas, parts = batch.frames.setdefault(server, ([], []))
        lent = [*self._own_arena(shard), region.offset, region.count, b]
        metas.append(dataclasses.replace(copy, lent=lent).to_meta())
        parts.append(part := Part(len(parts)))
        lend.pending.append((b, part))
        shard.lent = frozenset(self._lent(shard))
        return part

    def release(self, shard: ShardState) -> None:
        """After the backups answered copies of `shard` (from the confirming thread): the buffers
        they gave back open for rounds, and what waits for one goes on."""
        with shard.cond:
            for lend in list(self._lends.get((shard.key, shard.start, shard.stop), {}).values()):
                while lend.pending and lend.pending[0][1].done():
                    _, future = lend.pending.popleft()
                    try:
                        holds = future.wait(0).meta.get("holds")
                    except (RemoteError, TransportError, TimeoutError):
                        continue  # that backup is taken as dead (replica.py): forgotten
                    lend.held = _ours(holds, shard)
            lent = frozenset(self._lent(shard))
            if lent != shard.lent:
                shard.lent = lent
                shard.open_free_buffers()
                shard.cond.notify_all()

    def _lent(self, shard: ShardState) -> set[int]:
        lends = list(self._lends.get((shard.key, shard.start, shard.stop), {}).values())
        return set().union(*(lend.lent() for lend in lends))

    def _own_arena(self, shard: ShardState) -> list:
        """What a backup needs to map this server's arena (shared.ArenaMap.open)."""
        assert shard.region is not None
        fd = shard.region.fd
        if fd not in self._tokens:
            self._tokens[fd] = os.pread(fd, TOKEN_BYTES, 0)
        return [os.getpid(), fd, self._tokens[fd]]

    def _copy(
        self, server: int, client: RpcClient, shard: ShardState, copy: Replicate, tensors: list[torch.Tensor]
    ) -> Future:
        link = self._link(server, client, shard)
        b = link.free()
        if b is None:
            future = client.request(*copy.wire(), tensors)
        else:
            assert link.region is not None
            buffers = link.region.buffers[b * link.slots : (b + 1) * link.slots]
            buffers[0].copy_(tensors[0])
            mirrored: list[str] = []
            rest: list[torch.Tensor] = []
            names = copy.state or []
            for name, tensor in zip(names, tensors[1:], strict=True):
                if len(mirrored) + 1 < link.slots and fits(tensor, tensors[0]):
                    buffers[len(mirrored) + 1].copy_(tensor)
                    mirrored.append(name)
                else:
                    rest.append(tensor)
            rest_names = [n for n in names if n not in mirrored]
            through = dataclasses.replace(copy, state=rest_names, buffer=b, mirrored=mirrored)
            future = client.request(*through.wire(), rest)
            link.held = b
        link.last = future
        return future

    def forget(self, server: int) -> None:
        """`server` died or was restarted: its buffers are no more (a new process makes new ones),
        and it holds none of ours (given back at the next `release` of each slice)."""
        self._links = {k: v for k, v in self._links.items() if k[0] != server}
        self._borrowers.pop(server, None)
        for by_server in list(self._lends.values()):  # in place: a copy may be lending meanwhile
            by_server.pop(server, None)
        arena = self._arenas.pop(server, None)
        if arena is not None:
            self._retired.append(arena)  # a copy may be writing into it: closed at the end

    def close(self) -> None:
        for arena in [*self._retired, *(a for a in self._arenas.values() if a is not None)]:
            arena.close()
        self._arenas, self._links, self._lends, self._retired = {}, {}, {}, []

    def _link(self, server: int, client: RpcClient, shard: ShardState) -> Link:
        ident = (server, shard.key, shard.start, shard.stop)
        link = self._links.get(ident)
        if link is None:
            with self._lock:
                link = self._links.get(ident)
                if link is None:
                    slots = min(MAX_SLOTS, 1 + sum(fits(t, shard.value) for t in tensors_of(shard)))
                    link = Link(self._map(server, client, shard, slots), slots)
                    unmappable = server in self._arenas and self._arenas[server] is None
                    if link.region is not None or unmappable:  # else: ask again at the next copy
                        self._links[ident] = link
        return link

    def _map(self, server: int, client: RpcClient, shard: ShardState, slots: int) -> Region | None:
        """Ask the backup for the slice's buffers and map them; None (TCP) where that fails. A
        backup that cannot be mapped gets every copy over TCP (its arena is None); one that did not
        answer (it died, or is catching up and lacks the slice) is asked again at the next copy."""
        where = protocol.Mirror(shard.key, shard.start, shard.stop, SETS * slots)
        try:
            if self._arenas.get(server, True) is None:
                return None
            reply = client.call(*where.wire(), timeout_s=MIRROR_TIMEOUT_S)
            if server not in self._arenas:
                self._arenas[server] = ArenaMap.open(reply.meta["arena"])
            arena = self._arenas[server]
            assert arena is not None
            offset, count = (int(x) for x in reply.meta["region"])
            return arena.region(offset, shard.value.numel(), shard.value.dtype, count)
        except (RemoteError, TransportError, TimeoutError, KeyError) as exc:
            what = shard.describe()
            logger.info("server %d: no buffers for %s on server %d yet: %s", self.rank, what, server, exc)
        except (OSError, ValueError) as exc:
            logger.warning("server %d: copies to server %d go over TCP: %s", self.rank, server, exc)
            self._arenas[server] = None
        return None


def _ours(holds: Any, shard: ShardState) -> int | None:
    """A backup's `holds` ([pid, region offset, buffer]) as a buffer of this shard's region."""
    if not isinstance(holds, list) or len(holds) != 3 or shard.region is None:
        return None
    pid, offset, b = (int(x) for x in holds)
    return b if pid == os.getpid() and offset == shard.region.offset else None


class Borrowed:
    """A backup's maps of its same-host primaries' regions whose buffers it takes as values."""

    def __init__(self) -> None:
        self._arenas: dict[tuple[int, int, bytes], ArenaMap] = {}
        self._regions: dict[tuple[int, int, bytes, int], Region] = {}
        self._origins: dict[int, list[int]] = {}  # id(region): [pid, offset]
        self._lock = threading.Lock()

    def value(self, shard: ShardState, lent: list) -> torch.Tensor:
        """A `replicate` frame's `lent` [pid, fd, token, offset, count, buffer]: the buffer, mapped
        (holds shard.cond). A value in another primary's region (an earlier one) is copied first."""
        pid, fd, token = int(lent[0]), int(lent[1]), bytes(lent[2])
        offset, count, b = int(lent[3]), int(lent[4]), int(lent[5])
        if not 0 <= b < count:
            raise KVError(f"replicate of {shard.describe()} lends buffer {b} of {count}")
        with self._lock:
            region = self._regions.get((pid, fd, token, offset))
            if region is None:
                try:
                    arena = self._arena(pid, fd, token)
                    region = arena.region(offset, shard.value.numel(), shard.value.dtype, count)
                except (OSError, ValueError) as exc:
                    raise KVError(f"cannot map server process {pid}'s buffers of {shard.describe()}: {exc}")
                self._regions[(pid, fd, token, offset)] = region
                self._origins[id(region)] = [pid, offset]
        if shard.borrowed is not region:
            shard.disown()
            shard.borrowed = region
        return region.buffers[b]

    def check(self, arena: list) -> dict:
        """A backup's side of `borrow`: whether it maps the primary's arena [pid, fd, token] (it
        keeps the map for the lends to come)."""
        try:
            with self._lock:
                self._arena(int(arena[0]), int(arena[1]), bytes(arena[2]))
        except (OSError, ValueError) as exc:
            return {"maps": False, "why": str(exc)}
        return {"maps": True}

    def _arena(self, pid: int, fd: int, token: bytes) -> ArenaMap:
        """The primary's arena, mapped on first use (holds self._lock)."""
        arena = self._arenas.get((pid, fd, token))
        if arena is None:
            arena = self._arenas[(pid, fd, token)] = ArenaMap.open([pid, fd, token])
        return arena

    def holds(self, shard: ShardState) -> list[int] | None:
        """What a backup answers a `replicate`: the primary's buffer its value is, if any."""
        b = shard.holding()
        if b is None or shard.borrowed is None:
            return None
        return [*self._origins[id(shard.borrowed)], b]

    def close(self) -> None:
        with self._lock:
            for arena in self._arenas.values():
                arena.close()
            self._arenas, self._regions, self._origins = {}, {}, {}


def offer(kv: KVServer, meta: dict) -> dict:
    """A backup's side of `mirror`: the slice's two buffers in this server's arena (made once)."""
    ident = (meta["key"], int(meta["start"]), int(meta["stop"]))
    shard = kv.shard_at(ident)
    if shard.value.dtype not in DTYPES.values():
        raise KVError(f"{shard.describe()} has dtype {shard.value.dtype}")
    count = int(meta["count"])
    if count % SETS or not SETS <= count <= SETS * MAX_SLOTS:
        raise KVError(f"mirror of {shard.describe()}: count={count!r} must be {SETS} sets of 1..{MAX_SLOTS}")
    region = kv.mirror_region(shard, count)
    return {"arena": kv.arena().describe(), "region": [region.offset, region.count]}


def fits(tensor: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether an optimizer state tensor goes in a buffer of the value's size and dtype."""
    return tensor.dtype == value.dtype and tensor.numel() == value.numel()


def tensors_of(shard: ShardState) -> list[torch.Tensor]:
    """The slice's optimizer state tensors now (holds shard.cond)."""
    _, tensors = shard.replica()
    return tensors[1:]


def restored(mirror: Region | None, meta: dict, tensors: list) -> tuple[list[str], list[torch.Tensor]]:
    """A backup's `replicate` frame with a set (`buffer`): the state's names and tensors, value
    first, as a frame without one carries them (the value in the set, the optimizer state
    tensors `mirrored` too, the others in the frame)."""
    mirrored = [str(n) for n in meta.get("mirrored", [])]
    if mirror is None:
        raise KVError("a replicate frame names a buffer, but this server made none for the slice")
    slots = mirror.count // SETS
    b = int(meta["buffer"])
    if not 0 <= b < SETS or len(mirrored) >= slots:
        raise KVError(
            f"replicate names set {b!r} with {len(mirrored)} state tensors; there are {SETS} of {slots}"
        )
    buffers = mirror.buffers[b * slots : (b + 1) * slots]
    return [*mirrored, *meta["state"]], [*buffers[: 1 + len(mirrored)], *tensors]
