"""The worker side of the parameter server: placement, slicing, and one frame per server per call.

Every call takes one key or a list of keys with matching values / outs. A call groups its keys' slices
by server and sends one frame to each server; pulled slices are received straight into the caller's
`out` tensors (each slice lands in its place in the flattened tensor). `push` and the `*_async`
calls return a Handle at once; the plain `pull` and `pushpull` wait for it.

With a server on this host, slices it keeps in shared memory (shared.py) skip the frame's payload:
in sync and bounded modes a push adds itself into the round's shared buffer before the frame goes
(so `push` returns once that is done), and a pull's slice is copied out of the shared value in
`Handle.wait()`, once the server replied that the version waited for is there.

Not thread-safe: one thread drives one KVStore (the per-key clocks are the caller's).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from paratrain.cluster.context import Context
from paratrain.errors import KVStoreError, RemoteError, TransportError
from paratrain.kvstore import optim, protocol
from paratrain.kvstore.api import Handle, Keys, KVStoreConfig, SparseAPI, WaitDiagnosis
from paratrain.kvstore.compressed import WorkerCompression, compression_config
from paratrain.kvstore.placement import Placement, Slice
from paratrain.kvstore.shared import ArenaMap, Region, same_host
from paratrain.kvstore.worker.checks import (
    as_lists,
    check_finite,
    check_init_value,
    check_tensors,
    explain_wait,
)
from paratrain.kvstore.worker.failover import Payload, Servers, Spared, Unreachable
from paratrain.kvstore.worker.state import (
    by_values,
    gather_state,
    read_hyper,
    read_state,
    read_tables,
    scatter_state,
    write_state,
)
from paratrain.transport.client import Future, Reply, RpcClient
from paratrain.transport.tensors import dtype_name

logger = logging.getLogger(__name__)

Sent = protocol.Push | protocol.PushPull | protocol.Pull
"""A call's request to one server, as its Handle keeps it (for `_diagnose`)."""


@dataclass
class KeyInfo:
    shape: list[int]
    dtype: torch.dtype
    slices: list[Slice]
    clock: int = 0
    """How many times this worker pushed the key: the round its next push joins."""
    regions: dict[int, Region] = field(default_factory=dict)
    """Per slice (by its start): the slice in shared memory, where its server is on this host."""

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slices)


@dataclass(slots=True)
class Frame:
    """The slices one request carries to one server (`_frames`): parallel lists, which the
    request's message takes as they are."""

    keys: list
    starts: list[int]
    stops: list[int]
    size: int
    """Bytes its slices put on the wire."""
    more: bool = False
    """More frames of the same call follow to this server (a push's `more`: server/outbox.py)."""


def flat_cpu(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous().reshape(-1)


class DistKVStore(SparseAPI):
    """kvstore kinds dist_sync, dist_async and bounded staleness, talking to the job's servers."""

    def __init__(
        self,
        ctx: Context,
        config: KVStoreConfig,
        members: list[int] | None = None,
        barrier: Callable[[str], Any] | None = None,
        weight: int = 1,
    ) -> None:
        """`members`: the workers that push (default all); `barrier(name)`: how they meet (default
        the scheduler's barrier of all workers); `weight`: how many workers' gradients each of this
        store's pushes sums (a host's leader pushes its host's sum: KVStoreConfig.average)."""
        if not ctx.servers:
            raise KVStoreError("a distributed kvstore needs servers: launch the job with -s 1 or more")
        assert ctx.spec is not None
        config.policy.check_job(ctx.num_workers if members is None else len(members), ctx.config.replication)
        self.config = config
        self._ctx = ctx
        self.rank, self.num_workers = ctx.rank, ctx.num_workers
        self._timeout_s = ctx.config.transport.request_timeout_s
        self._clients: list[Any] = [self._reach(i, host, port) for i, (host, port) in enumerate(ctx.servers)]
        # Smaller slices only where every slice of a key is at one version after each round (sync),
        # and where the servers are on several hosts (on one, more frames only cost CPU).
        spread = len({host for host, _ in ctx.servers if host}) > 1  # "": a server lost before the start
        most = config.max_slice_bytes if config.policy.cuts_keys() and spread else None
        self._placement = Placement(len(self._clients), config.slice_elements, most)
        self._frame_bytes = config.frame_bytes if most is None else min(config.frame_bytes, most)
        self._servers = Servers(self._clients, ctx.config.replication)  # copies, fail-over
        if ctx.link is not None and ctx.config.replication > 1:
            ctx.link.on_server_lost(self._server_dropped)
            for rank, why in list(ctx.link.lost_servers.items()):  # lost before this hook
                self._server_dropped(rank, why)
        if ctx.config.replication > 1 and ctx.link is not None:  # a restarted server caught up
            ctx.link.on_server_back(self._server_back)
        self._keys: dict[Any, KeyInfo] = {}
        self._arenas: dict[int, ArenaMap] = {}  # per same-host server: its shared shards
        self._closed = False
        self._tables: Any = None  # embedding.TableClient, made on first use of a sparse table
        self._compression: WorkerCompression | None = None  # set_gradient_compression
        self._server_optimizer = False  # set_optimizer was called: pulls are weights
        self._members = list(range(ctx.num_workers)) if members is None else members
        self._weight = weight
        self._barrier = barrier or (lambda name: ctx.barrier(name=name))
        # A worker that joined a running elastic job finds the servers configured, initialized and
        # with their optimizer: it skips the start's barriers and worker 0's duties (the others are
        # training), and its pushes join the rounds from the next one its first push reaches.
        self._joined = ctx.joined
        if self.rank == 0 and not self._joined:
            mode, params = config.policy.to_wire()
            replicated = ctx.config.replication > 1
            configure = protocol.Configure(
                mode,
                list(self._members),
                params or None,
                config.average,
                ctx.config.replication,
                [list(address) for address in ctx.servers] if replicated else None,
            )
            self._all_servers(*configure.wire())
        if not self._joined:
            self._barrier("kvstore-create")
        atexit.register(self.close)

    def _reach(self, rank: int, host: str, port: int) -> RpcClient | Unreachable:
        """Server `rank`'s client. With replication, a server the scheduler lost before this
        worker reached it (it may never have registered) is dead from the start: no waiting for
        its connect timeout."""
        link = self._ctx.link
        if self._ctx.config.replication == 1 or link is None:
            return self._connect(rank, host, port)
        name = f"server {rank}"
        if rank in link.lost_servers:
            return Unreachable(name, link.lost_servers[rank])
        try:
            return self._connect(rank, host, port, give_up=lambda: link.lost_servers.get(rank))
        except TransportError:
            if rank not in link.lost_servers:
                raise
            return Unreachable(name, link.lost_servers[rank])

    def _connect(
        self, rank: int, host: str, port: int, give_up: Callable[[], str | None] | None = None
    ) -> RpcClient:
        ctx = self._ctx
        assert ctx.spec is not None
        return RpcClient(
            host,
            port,
            ctx.spec.secret,
            config=ctx.config.transport,
            name=f"server {rank} ({host}:{port})",
            same_host=same_host(host, ctx.spec.host),
            on_close=functools.partial(self._server_lost, rank),
            origin=f"worker {ctx.rank} at {ctx.spec.host}",
            give_up=give_up,
        )

    def _server_back(self, rank: int, host: str, port: int) -> None:
        """A restarted server caught up (replicated servers): a backup again, at its new address."""
        if not self._closed:
            for info in self._keys.values():  # its shared memory was its dead process's
                for piece in info.slices:
                    if piece.server == rank:
                        info.regions.pop(piece.start, None)
            self._arenas.pop(rank, None)
            self._servers.back(rank, self._connect(rank, host, port))

    def _server_lost(self, rank: int, error: Exception | None) -> None:
        """The scheduler hears it from us first: the job's end then names the server, not us.
        With replication the job goes on: this worker's requests go to the server's backups."""
        if getattr(self, "_closed", False):
            return  # the job's end: servers stop
        if hasattr(self, "_servers"):
            self._servers.lost(rank, error)
            self._servers.fail_over(rank)  # its unanswered requests go to the next copies now
        if self._ctx.link is not None:
            self._ctx.link.peer_lost("server", rank, error)

    def _server_dropped(self, rank: int, reason: str) -> None:
        """The scheduler lost that server (it may be alive behind a partition, its connection
        open): close the connection, so that what waits on it fails over to the backups now."""
        if self._servers.lost(rank, reason):
            threading.Thread(target=self._clients[rank].close, name="fence", daemon=True).start()

    @property
    def tables(self) -> Any:
        """The sparse tables' half of the API (SparseAPI; kvstore/worker/embedding.py does the work)."""
        if self._tables is None:
            from paratrain.kvstore.worker.embedding import TableClient

            self._tables = TableClient(
                self._clients, self.rank, self.config, self._barrier, self._timeout_s, self._servers
            )
        return self._tables

    # -- helpers ----------------------------------------------------------------------------------
    def _all_servers(self, op: str, meta: dict) -> list:
        return [reply.meta for _, reply in self._every_live(op, meta)]

    def _every_live(self, op: str, meta: dict) -> list[tuple[int, Reply]]:
        """(server, reply) of every live server; with replication, one lost meanwhile is left out."""
        return self._answered([(s, self._servers.submit(s, op, meta)) for s in self._servers.live()])

    def _answered(self, sent: list[tuple[int, Future | Spared]]) -> list[tuple[int, Reply]]:
        """The replies to requests sent to one server each, but of those lost meanwhile (Spared)."""
        replies = self._wait([future for _, future in sent])
        return [
            (server, reply)
            for (server, future), reply in zip(sent, replies, strict=True)
            if not _lost(future)
        ]

    def _wait(self, futures: list[Future | Spared]) -> list:
        try:
            return [f.wait(self._timeout_s) for f in futures]
        except (RemoteError, TransportError, TimeoutError) as exc:
            raise KVStoreError(str(exc)) from None

    def _info(self, key: Any) -> KeyInfo:
        try:
            return self._keys[key]
        except KeyError:
            raise KVStoreError(f"key {key!r} was never initialized (call kv.init first)") from None

    def _frames(
        self, keys: list, max_bytes: int | None = None, compressed: bool = False
    ) -> list[tuple[int, Frame]]:
        """(server, frame) per request: the slices `keys` have on that server. With `max_bytes`, a
        server's slices go in frames of at most that many bytes (whole slices: a bigger one alone),
        sent in the order `_interleaved` gives; `compressed`: counted as the slices of compressed
        keys go on the wire (both ways)."""
        frames: dict[int, list[Frame]] = {}
        compression = self._compression if compressed else None
        for key in keys:
            info = self._info(key)
            itemsize = info.dtype.itemsize
            packed = compression is not None and compression.wire_bytes(info.dtype, info.numel) is not None
            for piece in info.slices:
                chunks = frames.setdefault(piece.server, [])
                size = piece.numel * itemsize
                if packed:
                    assert compression is not None
                    size = compression.codec.wire_bytes(piece.numel, itemsize)
                if chunks and (max_bytes is None or chunks[-1].size + size <= max_bytes):
                    frame = chunks[-1]
                    frame.keys.append(key)
                    frame.starts.append(piece.start)
                    frame.stops.append(piece.stop)
                    frame.size += size
                else:
                    if chunks:
                        chunks[-1].more = True
                    chunks.append(Frame([key], [piece.start], [piece.stop], size))
        return self._interleaved(frames)

    def _interleaved(self, frames: dict[int, list[Frame]]) -> list[tuple[int, Frame]]:
        """Every server's first frame, then every server's second, and so on; each worker starts
        from server `rank`. Workers that push at once then load every server's link from the start
        (not all queueing at server 0), and each server's early frames complete their rounds (and
        go back as pulls) while later frames are still arriving: both directions of a link work."""
        count = len(self._clients)
        order = sorted(frames, key=lambda s: (s - self.rank) % count)
        depth = max((len(chunks) for chunks in frames.values()), default=0)
        return [(s, frames[s][j]) for j in range(depth) for s in order if j < len(frames[s])]

    def _min_versions(self, keys: list) -> dict[Any, int]:
        """Per key: the version a pull of it waits for (from its clock: the policy's rule)."""
        min_version, infos = self.config.policy.min_version, self._keys
        return {key: min_version(infos[key].clock) for key in keys}

    # -- the API ----------------------------------------------------------------------------------
    def init(self, keys: Keys, values: Any) -> None:
        """The first init of a key sets its value (worker 0's); a later one must match its shape
        and dtype. Every worker inits the same keys in the same order."""
        keys, values = as_lists(keys, values)
        for key, value in zip(keys, values, strict=True):  # all checked before any is recorded
            check_init_value(key, value)
            known = self._keys.get(key)
            if known is not None and (known.shape, known.dtype) != (list(value.shape), value.dtype):
                raise ValueError(
                    f"key {key!r} was initialized as {known.dtype}{known.shape}; "
                    f"init as {value.dtype}{list(value.shape)} is not allowed"
                )
        if len(set(keys)) != len(keys):
            raise ValueError(f"init lists a key twice: {keys!r}")
        for key, value in zip(keys, values, strict=True):
            known = self._keys.get(key)
            shape, dtype = list(value.shape), value.dtype
            if known is None:
                # Compressed keys are cut by their compressed size: set compression before init
                # (as the Trainer does), on every worker alike, or their slices stay small.
                compression, numel = self._compression, value.numel()
                wire = None if compression is None else compression.wire_bytes(dtype, numel)
                slices = self._placement.place(numel, value.element_size(), wire)
                self._keys[key] = KeyInfo(shape, dtype, slices)
        flat = {key: flat_cpu(v) for key, v in zip(keys, values, strict=True)}
        inits = [(s, self._init_message(frame)) for s, frame in self._frames(keys)]

        def send(with_values: bool) -> None:
            sent: list[tuple[int, protocol.Init, Future | Spared]] = []
            # Without copies a dead server is the call's error (the scheduler ends the job).
            live = set(self._servers.live() if self._servers.replication > 1 else range(len(self._clients)))
            for s, init in inits:  # to every copy of the slices (only the primary: no replication)
                chain = self._servers.chain(s)
                where = zip(init.keys, init.starts, init.stops, strict=True)
                tensors = [flat[k][a:b] for k, a, b in where] if with_values else ()
                for t in chain:
                    if t in live:
                        copy = dataclasses.replace(init, chain=chain) if len(chain) > 1 else init
                        sent.append((t, init, self._servers.submit(t, *copy.wire(), tensors)))
            replies = self._wait([future for _, _, future in sent])
            for (t, init, future), reply in zip(sent, replies, strict=True):
                if not _lost(future):
                    self._map_regions(t, init, reply.meta)

        if self._joined:
            send(with_values=False)
            return
        if self.rank == 0:
            send(with_values=True)
        self._barrier("kvstore-init")
        if self.rank != 0:
            send(with_values=False)  # checks shape and dtype against worker 0's

    def _init_message(self, frame: Frame) -> protocol.Init:
        infos = [self._keys[key] for key in frame.keys]
        return protocol.Init(
            keys=frame.keys,
            starts=frame.starts,
            stops=frame.stops,
            rank=self.rank,
            shapes=[info.shape for info in infos],
            dtypes=[dtype_name(info.dtype) for info in infos],
            numels=[info.numel for info in infos],
        )

    def _map_regions(self, server: int, init: protocol.Init, reply: dict) -> None:
        """Map the slices a same-host server keeps in shared memory (its init reply says where)."""
        if "arena" not in reply:
            return
        try:
            if server not in self._arenas:
                self._arenas[server] = ArenaMap.open(reply["arena"])
            slices = zip(init.keys, init.starts, init.stops, reply["regions"], strict=True)
            for key, start, stop, where in slices:
                info = self._keys[key]
                if where is not None and start not in info.regions:
                    arena = self._arenas[server]
                    info.regions[start] = arena.region(int(where[0]), stop - start, info.dtype, int(where[1]))
        except (OSError, ValueError, TypeError, IndexError) as exc:  # payloads go in frames instead
            logger.warning("server %d's shared memory is not usable here: %s", server, exc)

    def push(self, keys: Keys, values: Any) -> Handle:
        """Starts the push and returns (slices for a same-host server's shared memory are added
        there first); values must not change until handle.wait()."""
        return self._push(keys, values, pull_into=None)

    def pull_async(self, keys: Keys, out: Any) -> Handle:
        keys, outs = as_lists(keys, out)
        futures: list[Any] = []
        after: list[Callable[[], None]] = []
        views = self._out_views(keys, outs, after)
        compression = self._pull_compression()
        needs = self._min_versions(keys)
        reads: list[tuple[Region, torch.Tensor]] = []
        sent: list[tuple[int, Sent]] = []
        for s, frame in self._frames(keys, self._frame_bytes, compressed=compression is not None):
            first = len(reads)
            in_place = self._servers.in_place(s)
            out, read = (
                (None, None) if compression is not None else self._dests(frame, views, reads, in_place)
            )
            pull = protocol.Pull(
                keys=frame.keys,
                starts=frame.starts,
                stops=frame.stops,
                rank=self.rank,
                min_versions=[needs[key] for key in frame.keys],
                pull_compression=compression,
                read=read,
            )
            payload = self._payload(pull, None, views, reads, first) if len(reads) > first else None
            futures.append(self._servers.request(s, *pull.wire(), (), out=out, payload=payload))
            sent.append((s, pull))
            if compression is not None:
                after.insert(0, self._decoder(pull, futures[-1], views))
        return self._handle("pull", keys, sent, futures, after, reads)

    def _handle(
        self, op: str, keys: list, sent: list[tuple[int, Sent]], futures: list, after: list, reads: list
    ) -> Handle:
        """A Handle whose long waits say what they wait for: the servers are asked (`_diagnose`).
        sent: (server, message) of each request, in the order of futures."""
        what = f"{op} of key {keys[0]!r}" + (f" and {len(keys) - 1} more" if len(keys) > 1 else "")
        return Handle(
            futures,
            after,
            self._timeout_s,
            reads,
            what=f"worker {self.rank}'s {what}",
            diagnose=lambda pending: self._diagnose([sent[i] for i in pending], op != "push"),
            warn_after_s=self.config.wait_warning_s,
        )

    def _diagnose(self, waiting: list[tuple[int, Sent]], pulls: bool) -> WaitDiagnosis:
        """Ask the servers that have not replied what the call waits for: the rounds its pulls
        need and the workers that have not pushed them (the servers log the same)."""
        probes = []
        for s, request in waiting:
            needs = request.min_versions if pulls and request.min_versions else [0] * len(request.keys)
            query = protocol.Waiting(request.keys, request.starts, request.stops, needs, request.rank)
            probes.append((self._clients[self._servers.serving(s)], *query.wire()))
        return explain_wait(probes, self._timeout_s)

    def pull(self, keys: Keys, out: Any) -> int | None:
        """Returns when `out` holds the value (in sync mode: of the round this worker last pushed);
        returns the oldest version pulled."""
        handle = self.pull_async(keys, out)
        handle.wait()
        return handle.version

    def pushpull_async(self, keys: Keys, values: Any, out: Any) -> Handle:
        return self._push(keys, values, pull_into=out)

    def pushpull(self, keys: Keys, values: Any, out: Any) -> int | None:
        """Push then pull, one round trip per server; returns when `out` holds the value, with the
        oldest version pulled."""
        handle = self.pushpull_async(keys, values, out)
        handle.wait()
        return handle.version

    def _push(self, keys: Keys, values: Any, pull_into: Any) -> Handle:
        outs = as_lists(keys, pull_into)[1] if pull_into is not None else None
        keys, values = as_lists(keys, values)
        if len(set(keys)) != len(keys):
            raise ValueError(f"a push lists a key twice: {keys!r}")
        # Every argument is checked before a clock moves: a refused call must leave no trace, or
        # this worker's next push would join a later round than the others'.
        check_tensors("push", keys, values, self._spec)
        after: list[Callable[[], None]] = []
        views = self._out_views(keys, outs, after) if outs is not None else None
        flat = {key: flat_cpu(value) for key, value in zip(keys, values, strict=True)}
        if self.config.refuse_non_finite:
            check_finite(keys, list(flat.values()), self.rank)
        clocks = {key: self._info(key).clock for key in keys}
        for key in keys:
            self._info(key).clock += 1
        needs = self._min_versions(keys)
        kind = protocol.Push if views is None else protocol.PushPull
        pull_compression = None if views is None else self._pull_compression()
        compression = None if self._compression is None else self._compression.wire
        # A joiner's clocks are its own (the server shifts them): it never adds in place. Where
        # the policy does not add in place, the server applies each push itself.
        adds = not self._joined and self.config.policy.adds_in_place()
        futures: list[Any] = []
        reads: list[tuple[Region, torch.Tensor]] = []
        sent: list[tuple[int, Sent]] = []
        compressed = views is None or pull_compression is not None  # a pushpull's replies too
        for s, frame in self._frames(keys, self._frame_bytes, compressed):
            in_place = self._servers.in_place(s)
            tensors, added, frame_clocks = self._pushed(frame, clocks, flat, adds and in_place)
            first = len(reads)
            out, read = (
                self._dests(frame, views, reads, in_place)
                if views is not None and pull_compression is None
                else (None, None)
            )
            push = kind(
                keys=frame.keys,
                starts=frame.starts,
                stops=frame.stops,
                rank=self.rank,
                clocks=frame_clocks,
                min_versions=[needs[key] for key in frame.keys],
                more=frame.more,
                weight=self._weight,
                compression=compression,
                added=added,
                pull_compression=pull_compression,
                read=read,
            )
            payload = self._payload(push, flat, views, reads, first) if added or len(reads) > first else None
            futures.append(self._servers.request(s, *push.wire(), tensors, out=out, payload=payload))
            sent.append((s, push))
            if pull_compression is not None:
                after.insert(0, self._decoder(push, futures[-1], views))
        return self._handle(kind.op, keys, sent, futures, after, reads)

    def _pushed(
        self, frame: Frame, clocks: dict, flat: dict, adds: bool
    ) -> tuple[list[torch.Tensor], list[bool] | None, list[int]]:
        """What a frame pushes: (its payload; per slice whether this worker added it into the
        open round's shared buffer of a same-host server itself, so it is not in the payload,
        None: none was; per slice its clock). `adds`: it may add them there."""
        tensors: list[torch.Tensor] = []
        added: list[bool] = []
        pushed: list[int] = []
        compression = self._compression
        for k, a, b in zip(frame.keys, frame.starts, frame.stops, strict=True):
            clock = clocks[k]
            pushed.append(clock)
            if compression is not None:  # never through shared memory (compressed.py)
                added.append(False)
                tensors += compression.encode(k, a, flat[k][a:b], self._keys[k].numel)
                continue
            region = self._keys[k].regions.get(a) if adds else None
            piece = flat[k][a:b]
            added.append(region is not None and region.add(clock, piece))
            if not added[-1]:
                tensors.append(piece)
        return tensors, added if any(added) else None, pushed

    def _spec(self, key: Any) -> tuple[list[int], torch.dtype]:
        info = self._info(key)
        return info.shape, info.dtype

    def _out_views(self, keys: list, outs: list, after: list) -> dict[Any, torch.Tensor]:
        """Flat CPU views of the outs; a GPU or non-contiguous out is filled through a staging copy."""
        check_tensors("out", keys, outs, self._spec)
        views = {}
        for key, out in zip(keys, outs, strict=True):
            info = self._info(key)
            if out.device.type == "cpu" and out.is_contiguous():
                views[key] = out.view(-1)
            else:
                staging = torch.empty(info.numel, dtype=info.dtype)
                views[key] = staging
                after.append(lambda out=out, staging=staging: out.copy_(staging.view(out.shape)))
        return views

    def _dests(
        self, frame: Frame, views: dict, reads: list, in_place: bool
    ) -> tuple[list[torch.Tensor], list[bool] | None]:
        """Where a pull's slices land: (the tensors the reply's slices go into, and which slices
        the server keeps in shared memory, None: none). Those are queued on `reads`: the worker
        copies them out itself, and the request says so (its `read`)."""
        dests, read = [], []
        for k, a, b in zip(frame.keys, frame.starts, frame.stops, strict=True):
            region = self._keys[k].regions.get(a) if in_place else None
            read.append(region is not None)
            if region is not None:
                reads.append((region, views[k][a:b]))
            else:
                dests.append(views[k][a:b])
        return dests, read if any(read) else None

    def _payload(
        self, request: Sent, flat: dict | None, views: dict | None, reads: list, first: int
    ) -> Payload | None:
        """The request as a backup needs it, should the same-host primary die before replying:
        every push in it (`flat`: the pushed values), every pulled value in the reply (failover.py)."""
        if self._servers.replication == 1:
            return None
        where = list(zip(request.keys, request.starts, request.stops, strict=True))
        plain = {k: v for k, v in request.to_meta().items() if k not in ("added", "read")}  # no shared memory
        tensors = [flat[k][a:b] for k, a, b in where] if flat is not None else []
        out = [views[k][a:b] for k, a, b in where] if views is not None else None
        return Payload(plain, tensors, out, reads, reads[first:])

    # -- compression (compressed.py) -------------------------------------------------------------
    def set_gradient_compression(self, compression: Any) -> None:
        """Compress this worker's pushes from now on, in MXNet's form
        (`{"type": "2bit", "threshold": 0.5}`, or "topk", "fp16", "bf16"; None: off), with error
        feedback per key. Where the servers run no optimizer (rounds sum gradients), the pulled
        sums come compressed too, with the servers' own error feedback. Every worker calls it,
        best before init: keys initialized after it are sliced by their compressed size (fewer,
        bigger slices: with servers on several hosts in sync mode, `max_slice_bytes` caps the bytes
        a slice puts on the wire)."""
        config = compression_config(compression)
        if config is not None and self._servers.replication > 1:
            raise KVStoreError("gradient compression is not replicated yet: use JobConfig(replication=1)")
        self._compression = None if config is None else WorkerCompression(config)

    def _pulls_compressed(self) -> bool:
        """Whether pulled values come compressed: gradient sums only (no optimizer on the servers,
        rounds)."""
        policy = self.config.policy
        return self._compression is not None and not self._server_optimizer and policy.adds_in_place()

    def _pull_compression(self) -> dict | None:
        """How pulled values come compressed (a request's `pull_compression`); None: plain."""
        if not self._pulls_compressed():
            return None
        assert self._compression is not None
        return self._compression.wire

    def _decoder(self, request: Sent, future: Any, views: dict | None) -> Callable[[], None]:
        compression = self._compression
        assert compression is not None
        assert views is not None
        return lambda: compression.decode_reply(request, future.wait(0), views)

    def set_optimizer(self, optimizer: str | type, **hyperparameters: Any) -> None:
        """Run `optimizer` (a torch.optim class or its path) on the servers, once per round."""
        path = optim.class_path(optimizer)
        optim.resolve(path)
        hyper = optim.check_hyperparameters(hyperparameters)
        self._server_optimizer = True
        if self._joined:
            return  # the servers have it, with its state
        if self.rank == 0:
            self._all_servers(*protocol.SetOptimizer(path, hyper).wire())
        self._barrier("kvstore-optimizer")

    def set_hyperparameters(self, keys: Keys, **hyperparameters: Any) -> Handle:
        """New values of some hyperparameters of the servers' optimizer for `keys` (a parameter
        group's keys: an LR schedule's step, a group's own weight decay), from the next update on.
        Sent to every server ahead of this worker's next pushes, on the same connections (which a
        server reads in order): no round trip is added; wait on the handle when convenient."""
        keys = list(keys) if isinstance(keys, (list, tuple)) else [keys]
        for key in keys:
            self._info(key)
        message = protocol.SetHyper(keys, optim.check_hyperparameters(hyperparameters))
        futures: list = [self._servers.submit(i, *message.wire()) for i in self._servers.live()]
        return Handle(futures, timeout_s=self._timeout_s, what=f"set_hyper of {len(keys)} key(s)")

    def clip_by_norm(self) -> None:
        """From now on each sync round's mean waits on the servers, unapplied, for the scale that
        clips it by the global L2 norm: get the norm's shares with `norm_shares`, send the scale
        with `clip_scale` (every worker, or one). Call it on every worker, before any push."""
        if self._servers.replication > 1:
            raise KVStoreError("clipping on the servers is not replicated yet: use JobConfig(replication=1)")
        if self._joined:
            return  # the servers have it
        if self.rank == 0:
            self._all_servers(*protocol.ClipByNorm().wire())
        self._barrier("kvstore-clip")

    def norm_shares(self, clock: int) -> list[float]:
        """Per server: the squared L2 norm of round `clock`'s mean over its slices (each answers once
        every worker has pushed the round to it). Their sum is the square of the global norm."""
        return [float(meta["share"]) for meta in self._all_servers(*protocol.NormShare(clock).wire())]

    def clip_scale(self, clock: int, scale: float) -> Handle:
        """Round `clock` is applied multiplied by `scale`; the pulls of the round wait for it."""
        message = protocol.ClipScale(clock, float(scale))
        futures: list = [self._servers.submit(i, *message.wire()) for i in self._servers.live()]
        return Handle(futures, timeout_s=self._timeout_s, what=f"clip_scale of round {clock}")

    def check_overflow(self) -> None:
        """From now on each sync round waits on the servers, unapplied, until every worker has
        sent `overflow` for it (fp16's loss scaling: a round any worker's gradient overflowed in is
        dropped everywhere). Call it on every worker, before any push."""
        if self._servers.replication > 1:
            raise KVStoreError(
                "overflow checks on the servers are not replicated yet: use JobConfig(replication=1)"
            )
        if self._joined:
            return  # the servers have it
        if self.rank == 0:
            self._all_servers(*protocol.CheckOverflow().wire())
        self._barrier("kvstore-overflow")

    def overflow(self, clock: int, found: bool) -> Handle:
        """Whether this worker's pushes of round `clock` held inf or NaN, to every server, after
        its last push of the round. After wait(), each server's `overflowed` is in the handle's
        replies: the same on all of them (every server has every worker's flag)."""
        message = protocol.Overflow(clock, self.rank, bool(found))
        futures = [self._clients[i].submit(*message.wire(), ()) for i in self._servers.live()]
        return Handle(futures, timeout_s=self._timeout_s, what=f"overflow check of round {clock}")

    def join(self) -> None:
        """A worker that joined a running elastic job: every round from the next one on waits for
        it. Call it while the other workers wait (at a barrier), so that none is in flight."""
        self._all_servers(*protocol.Join(self.rank).wire())

    def barrier(self) -> None:
        self._barrier("kvstore-barrier")

    def stats(self) -> dict[Any, dict[str, int]]:
        """What the servers counted per key so far (summed over a key's slices): pushes, pulls,
        bytes in and out, the key's oldest version, open rounds and pulls waiting on it."""
        # Every slice sees each push and pull of its key: counts are the same on all of them.
        combine = {"version": min, "pushes": max, "pulls": max, "late": max}
        per_key: dict[Any, dict[str, int]] = {}
        for reply in self._serving(self._every_live(*protocol.Stats().wire())):
            for shard in reply.meta["shards"]:
                total = per_key.setdefault(shard["key"], {"slices": 0})
                total["slices"] += 1
                for name, value in shard.items():
                    if name not in ("key", "start", "stop"):
                        both = combine.get(name, lambda a, b: a + b)
                        total[name] = both(total[name], value) if name in total else value
        return per_key

    def _serving(self, replies: list[tuple[int, Reply]]) -> list[Reply]:
        """Stats replies of the live servers, keeping each slice's copy on the server serving it."""
        if self._servers.replication == 1:
            return [reply for _, reply in replies]
        primary = {(key, p.start): p.server for key, info in self._keys.items() for p in info.slices}
        for server, reply in replies:
            shards = reply.meta["shards"]
            serving = self._servers.serving
            reply.meta["shards"] = [s for s in shards if serving(primary[(s["key"], s["start"])]) == server]
        return [reply for _, reply in replies]

    # -- state ------------------------------------------------------------------------------------
    def save_state(self, path: str | os.PathLike[str]) -> None:
        """Every worker calls it; worker 0 writes the servers' values and optimizer state, per key,
        so the file loads into any number of servers. Written to a temporary file, then renamed."""
        self.barrier()
        if self.rank == 0:
            replies = [reply for _, reply in self._every_live(*protocol.GetState().wire())]
            optimizer: list = next((r.meta["optimizer"] for r in replies if r.meta["optimizer"]), [])
            tables = self._tables.gather() if self._tables is not None and self._tables.tables else ()
            hyper = {key: values for r in replies for key, values in r.meta.get("hyper", [])}
            write_state(path, gather_state(replies), optimizer, tables, hyper)
        if self._compression is not None:  # every worker's own push residuals
            self._compression.save(path, self.rank)
        self.barrier()

    def load_state(self, path: str | os.PathLike[str]) -> None:
        """Every worker calls it after init (and set_optimizer, if the file has optimizer state)."""
        self.barrier()
        if self.rank == 0:
            per_server = scatter_state(read_state(path), self._keys)
            live = set(self._servers.live())
            futures = [  # to every live copy
                self._servers.submit(t, *protocol.SetState(meta).wire(), tensors)
                for s, (meta, tensors) in per_server.items()
                for t in self._servers.chain(s)
                if t in live
            ]
            self._wait(futures)
            hyper = {key: values for key, values in read_hyper(path).items() if key in self._keys}
            for keys, values in by_values(hyper):  # each key's own, over the optimizer's
                self._all_servers(*protocol.SetHyper(keys, values).wire())
            if self._tables is not None:
                self._tables.load(read_tables(path))
        for info in self._keys.values():
            info.clock = 0
        if self._compression is not None:
            self._compression.load(path, self.rank)
        if self._tables is not None:
            self._tables.reset_clocks()
        self.barrier()

    def close(self) -> None:
        """Leave the job's rounds (the others stop waiting for this worker) and disconnect."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        # Runs at exit too (atexit), where an error would only print a traceback: a server that
        # is gone or refuses is the scheduler's to report, so a failed leave is logged, not raised.
        leaving = []
        for client in self._clients:
            try:
                leaving.append((client, client.request(*protocol.Leave(self.rank).wire())))
            except TransportError as exc:
                logger.debug("worker %d could not leave %s's rounds: %s", self.rank, client.name, exc)
        deadline = time.monotonic() + min(10.0, self._timeout_s or 10.0)
        for client, future in leaving:
            try:
                future.wait(max(0.0, deadline - time.monotonic()))
            except (RemoteError, TransportError, TimeoutError) as exc:
                logger.debug("worker %d could not leave %s's rounds: %s", self.rank, client.name, exc)
        for client in self._clients:
            try:
                client.close()
            except (OSError, TransportError) as exc:
                logger.debug("closing the connection to %s: %s", client.name, exc)
        for info in self._keys.values():
            info.regions = {}
        for arena in self._arenas.values():
            arena.close()
        self._arenas = {}


def _lost(future: Future | Spared) -> bool:
    """Whether the server of this part of a call to every live server or copy was lost meanwhile."""
    return isinstance(future, Spared) and future.lost
