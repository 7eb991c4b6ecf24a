"""Replicated servers for sparse tables: a table's rows on a server, copied to that server's backups.

With `JobConfig.replication` r >= 2, the rows a server holds of a table (the ids `shard_of` places on
it) also live on the next r - 1 servers (placement.replicas: the same chains as the dense slices).
Each server keeps, per table, its own rows and a copy of the rows of every server whose chain it is
on (`SparseTables.copies`, by (key, primary)). Workers init a table on every server, with the
chains that server is on, and send each request for a primary's rows to the first live server of
its chain, with `primary` in the meta.

After every update (a round applied, an async push applied), the serving copy sends its live
backups a delta (op `sparse_replicate`), holding the table's lock: only the rows the update touched
(ids, values, last step seen, optimizer state such as Adagrad's sums or Adam's moments and steps),
the ids evicted since the last delta, the table's version and step, and the async clocks applied
(for the (worker, clock) dedupe). A backup applies deltas in order (one connection from its
primary, handled in order) and creates the rows it did not have. One thread per server
(`TableReplicas._confirm`) waits for the backups' replies, then moves the table's `durable` version
and serves what waited for it: pulls wait for `durable`, and so do push acknowledgements (in
rounds modes for the push's own round; in async for the version its push made). So every update a
worker was told about is on every live copy.

Rows a backup never received (created by a primary's pull, never updated) need no copy: a row's
first value (`initial_rows`) and its optimizer state's (`init_rows`) are functions of its id and
the table's config, so the backup makes the same row when it first sees the id. A promoted copy
also creates the absent rows a failed-over push names (the dead primary had made them at the
worker's pull), where a primary drops such gradients. What is not copied: sightings of ids not yet
admitted (`admit_after`: a promoted copy counts afresh) and the last step seen of rows that were
only pulled (their ttl runs from the last update instead).

When a primary dies, a worker's request fails over to the next live server of the chain
(worker/failover.py), carrying the dead servers. Before that copy serves its first request, it
waits until the dead primary's connection has closed, so that every delta the primary sent is
applied; then a push that the primary applied and replicated is recognised as a repeat (rounds:
its round is applied or has it; async: its clock is in the applied clocks) and acknowledged, not
applied again.

A restarted server (rejoin.py) rejoins as a backup: while it catches up, each live server sends it a
transfer (op `sparse_install`, `send_tables`) of every table whose chain holds it and that this
server serves: every row (values, optimizer state, last step seen) with the table's dim, config,
chain, optimizer, version, step and async clocks. It goes out under the table's lock on the
connection the deltas use, so the deltas taken after it follow it in order; a delta that arrives
before its table's transfer finds no table and is dropped (the transfer is newer). Deltas go to
every other live server of the chain, the rejoined one included, which may come before the
serving copy. The restarted server's copy drains the transfer's connection before it serves (as a
promoted backup does), even for its own rows, which it no longer serves first.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from paratrain.kvstore.api import TableError
from paratrain.kvstore.server.rules import Clocks

if TYPE_CHECKING:
    from paratrain.kvstore.server.sparse_table import SparseTable

logger = logging.getLogger(__name__)

# How long a promoted copy waits for its dead primary's connection to close (every delta applied).
DRAIN_WAIT_S = 5.0


@dataclass
class TableCopy:
    """The replication state of one table's rows on one server (`SparseTable.replica`)."""

    primary: int
    chain: list[int]
    """The servers holding these rows, primary first (placement.replicas)."""
    rank: int
    """This server."""
    forward: Callable[[SparseTable, np.ndarray], None] = lambda table, slots: None
    """Called after every update, holding the table's lock, with the slots it changed."""
    durable: int = 0
    """The version the live backups hold: pulls and acknowledgements wait for it."""
    applied: dict[int, Clocks] = field(default_factory=dict)
    """Async pushes: per worker rank, the clocks applied (a repeat is dropped)."""
    evicted: list[np.ndarray] = field(default_factory=list)
    """Ids evicted since the last delta."""
    source: Any = None
    """The connection deltas came through (a backup): drained before this copy serves."""
    promoted: bool = False
    """A backup that serves the rows now (its primary died)."""

    @property
    def is_backup(self) -> bool:
        return self.primary != self.rank

    def backups(self) -> list[int]:
        """The other servers of the chain: those this copy sends its deltas to (the replicator
        skips the dead). A restarted server that rejoined may come before the serving copy."""
        return [s for s in self.chain if s != self.rank]

    def repeat(self, table: SparseTable, rank: int, clock: int, rounds: bool) -> bool:
        """Whether worker `rank`'s push `clock` was applied (or joined its round: `rounds`, the
        policy holds pushes) here already; an async push that is not is recorded as applied (the
        caller applies it under the same lock)."""
        if rounds:
            return clock < table.version or rank in table.rounds.get(clock, {})
        clocks = self.applied.setdefault(rank, Clocks())
        if clocks.has(clock):
            return True
        clocks.add(clock)
        return False

    def reset(self, version: int = 0) -> None:
        """The table's rows were replaced (load_state on every copy): start again at `version`."""
        self.durable, self.applied, self.evicted = version, {}, []


# -- deltas and transfers: pure functions of a table's state -------------------------------------
def _rows(table: SparseTable, slots: np.ndarray, evicted: np.ndarray) -> tuple[dict, list[torch.Tensor]]:
    """The rows at `slots`, copied out, with the table's version, step and async clocks applied
    (holds the table's lock): a delta's or a transfer's frame."""
    copy = table.replica
    assert copy is not None
    where = torch.from_numpy(slots)
    names = [n for n in table.rows.columns if n != "value"]
    applied = [[rank, c.below, sorted(c.ahead)] for rank, c in copy.applied.items()]
    meta = {"key": table.key, "primary": copy.primary, "version": table.version, "step": table.step}
    meta |= {"applied": applied, "names": names}
    tensors = [
        torch.from_numpy(table.rows.ids[slots]),
        torch.from_numpy(evicted),
        table.rows.columns["value"].index_select(0, where),
        torch.from_numpy(table.rows.last_seen[slots]),
        *(table.rows.columns[name].index_select(0, where) for name in names),
    ]
    return meta, tensors


def delta(table: SparseTable, slots: np.ndarray) -> tuple[dict, list[torch.Tensor]]:
    """What a backup needs after an update of the rows at `slots` (holds the table's lock): the
    rows, copied out, and the evictions since the last delta."""
    copy = table.replica
    assert copy is not None
    evicted = np.concatenate(copy.evicted) if copy.evicted else np.zeros(0, np.int64)
    copy.evicted = []
    return _rows(table, np.asarray(slots, np.int64), evicted)


def transfer(table: SparseTable) -> tuple[dict, list[torch.Tensor]]:
    """Op `sparse_install`: every row of the table and what makes one on a restarted server (its
    dim, config, chain and optimizer), for a server that rejoins as a backup (holds the table's
    lock). The evictions since the last delta stay for that delta: the transfer has none of them."""
    copy = table.replica
    assert copy is not None
    meta, tensors = _rows(table, np.sort(table.rows.live_slots()), np.zeros(0, np.int64))
    optimizer = list(table.optimizer.spec) if table.optimizer is not None else []
    meta |= {"dim": table.dim, "config": dataclasses.asdict(table.config), "chain": list(copy.chain)}
    return meta | {"optimizer": optimizer, "own_optimizer": table.own_optimizer}, tensors


def _check_names(table: SparseTable, meta: dict, tensors: list[torch.Tensor]) -> list[str]:
    names = list(meta["names"])
    wanted = [n for n in table.rows.columns if n != "value"]
    if names != wanted or len(tensors) != 4 + len(names):
        raise TableError(
            f"table {table.key!r}: the primary keeps optimizer state {names}, this copy {wanted}"
        )
    return names


def _put_rows(table: SparseTable, meta: dict, tensors: list[torch.Tensor]) -> None:
    """Write a delta's or a transfer's rows (made where absent), version, step and clocks."""
    names = _check_names(table, meta, tensors)
    ids, evicted, values, last_seen = (t.numpy() for t in tensors[:4])
    _forget(table, evicted)
    slots = table.index.lookup(ids)
    absent = np.flatnonzero(slots < 0)
    if len(absent):
        created = table.rows.allocate(len(absent))
        table.rows.ids[created] = ids[absent]
        table.index.insert(ids[absent], created)
        slots[absent] = created
    where = torch.from_numpy(slots)
    table.rows.columns["value"][where] = torch.from_numpy(values)
    table.rows.last_seen[slots] = last_seen
    for name, tensor in zip(names, tensors[4:], strict=True):
        table.rows.columns[name][where] = tensor
    copy = table.replica
    assert copy is not None
    table.version, table.step = int(meta["version"]), max(table.step, int(meta["step"]))
    copy.applied = {
        int(r): Clocks(int(below), {int(c) for c in ahead}) for r, below, ahead in meta["applied"]
    }
    copy.durable = table.version


def apply_delta(table: SparseTable, meta: dict, tensors: list[torch.Tensor]) -> bool:
    """A backup's side (holds the table's lock): take a delta of the primary's rows. A delta not
    newer than the table is ignored (False); one that skips a version is refused."""
    copy = table.replica
    if copy is None:
        raise TableError(f"table {table.key!r}: a delta arrived but this server keeps no copy of it")
    version = int(meta["version"])
    if version <= table.version:
        return False
    if version != table.version + 1:
        raise TableError(
            f"table {table.key!r} (rows of server {copy.primary}): delta for version {version} "
            f"arrived at version {table.version}; one was lost"
        )
    _put_rows(table, meta, tensors)
    return True


def install(table: SparseTable, meta: dict, tensors: list[torch.Tensor]) -> None:
    """A restarted server's side of a transfer (a table just made, holds its lock): every row;
    the deltas that follow on the same connection apply on top."""
    if table.replica is None or table.rows.count:
        raise TableError(f"table {table.key!r}: a transfer goes into a new copy of the table only")
    _put_rows(table, meta, tensors)


def send_tables(tables: list[SparseTable], replicator: Any, rank: int, client: Any) -> list[Any]:
    """rejoin.py, on a live server: a transfer of every table whose rows the rejoining server
    `rank` backs up and this server serves (the first live copy other than it), on the connection
    that later deltas use, each under its table's lock: the deltas taken after it follow it. Like
    a dense slice's `install`, a delta sent before it finds no table there and is dropped."""
    sent = []
    for table in tables:
        with table.lock:
            copy = table.replica
            if copy is not None and rank in copy.chain and replicator.serves(copy.chain, without=rank):
                sent.append(client.request("sparse_install", *transfer(table)))
    return sent


def _forget(table: SparseTable, ids: np.ndarray) -> None:
    """Rows the primary evicted: evicted here too."""
    if not len(ids):
        return
    slots = table.index.lookup(ids)
    slots = slots[slots >= 0]
    if len(slots):
        table.index.remove(table.rows.ids[slots])
        table.rows.release(slots)
        table.evictions += len(slots)


def adopt(table: SparseTable, ids: np.ndarray, clock: int) -> None:
    """A promoted copy: create the absent rows a failed-over push names, as the dead primary made
    them at the worker's pull (admission as for a training pull)."""
    missing = ids[table.index.lookup(ids) < 0]
    if len(missing):
        table.admit(missing, clock)


# -- one server's sending and confirming ----------------------------------------------------------
class TableReplicas:
    """One server's side: attach copies, send deltas to the backups, move `durable` once they
    replied. `replicator` is the server's replica.Replicator (its links and dead servers);
    `serve_ready(table)` serves a table's pulls and acknowledgements that may go."""

    def __init__(self, replicator: Any, serve_ready: Callable[[SparseTable], None]) -> None:
        self.replicator = replicator
        self.serve_ready = serve_ready
        self._sent: queue.SimpleQueue = queue.SimpleQueue()  # (table, version, [(server, future)])
        self._lock = threading.Lock()
        self._confirming: threading.Thread | None = None
        self._sources: dict[int, Any] = {}  # per primary: the connection its last delta came through

    @property
    def enabled(self) -> bool:
        return self.replicator.enabled

    def attach(self, table: SparseTable, chain: list[int]) -> None:
        rank = self.replicator.rank
        if rank not in chain:
            raise TableError(f"table {table.key!r}: server {rank} is not one of the chain {chain}")
        table.replica = TableCopy(chain[0], list(chain), rank, forward=self.forward)

    def serve(self, table: SparseTable, dead: list[int]) -> None:
        """A worker sends this server requests for the table's rows: if they are a backup copy, its
        primary died; first apply every delta it sent (its connection closed)."""
        self.replicator.mark_dead(dead)
        copy = table.replica
        if copy is None or copy.promoted or (not copy.is_backup and copy.source is None):
            return  # a primary's own rows; a restarted primary's came by a transfer (a backup's)
        source = copy.source or self._sources.get(copy.primary)  # a table that had no delta yet
        deadline = time.monotonic() + DRAIN_WAIT_S
        while source is not None and not source.closed and time.monotonic() < deadline:
            time.sleep(0.005)
        copy.promoted = True

    def forward(self, table: SparseTable, slots: np.ndarray) -> None:
        """After an update (holds the table's lock): the delta to the live backups."""
        copy = table.replica
        assert copy is not None
        meta, tensors = delta(table, slots)
        sent = [(s, self.replicator.send(s, "sparse_replicate", meta, tensors)) for s in copy.backups()]
        sent = [(s, future) for s, future in sent if future is not None]
        if not sent:  # no live backup: this copy is the only one
            copy.durable = table.version
            return
        with self._lock:
            if self._confirming is None:
                self._confirming = threading.Thread(target=self._confirm, name="table-replicas", daemon=True)
                self._confirming.start()
        self._sent.put((table, table.version, sent))

    def _confirm(self) -> None:
        while (item := self._sent.get()) is not None:
            table, version, sent = item
            for server, future in sent:
                self.replicator.confirm(server, future, f"table {table.key!r}")
            with table.lock:
                copy = table.replica
                copy.durable = max(copy.durable, version)
            self.serve_ready(table)

    def restore(self, table: SparseTable, request: Any) -> None:
        """Op sparse_replicate: a delta from the table's primary (or a promoted copy before it)."""
        with table.lock:
            if table.replica is not None:
                table.replica.source = self._sources[table.replica.primary] = request.conn
            apply_delta(table, request.meta, request.tensors)
        request.reply({})

    def close(self) -> None:
        self._sent.put(None)
        with self._lock:
            confirming = self._confirming
        if confirming is not None:  # not inside torch when the process exits (replies.py)
            confirming.join(DRAIN_WAIT_S)
