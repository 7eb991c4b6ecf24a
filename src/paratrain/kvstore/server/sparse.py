"""Sparse tables on a server: embedding rows addressed by 64-bit ids, created on first use.

Storage (rowstore.py), with no Python object per row: an `IdIndex` from id to slot, rows and their
optimizer state in a `RowStore` of preallocated tensors. A push needs no lookup when its ids are those
of the same worker's last training pull: the pull's slots are kept, and checked to still hold those ids.

Lifecycle (`TableConfig`): a training pull of an absent id creates its row after `admit_after`
sightings, each then with probability `admit_probability`; rows not seen for `ttl_steps` steps are
evicted, and past `max_rows` / `max_bytes` the least recently seen. A step is a worker's clock for the
table (its pushes so far), which every request carries.

Optimizers are lazy (sparse_optim.py): an update changes only the pushed rows' values and state.
Without an optimizer a round's sum replaces the rows (rounds mode), or a push adds to them (async), as
for dense keys.

Protocol (KVServer hands the ops in `OPS` to `SparseTables.handle`):

    sparse_init       {key, dim, config}                      every worker; the first one creates
    sparse_pull       {key, clock, min_version, train, rank}  ids -> rows (zeros for absent ids)
    sparse_push       {key, clock, rank}                      unique ids, their gradients
    sparse_optimizer  {key, path, hyper}                      the table's own optimizer
    sparse_stats      {key}
    sparse_get_state  {key | None, full}                      tables by id: rows (+ ages and state)
    sparse_set_state  {key, names, step}                      replace a table's rows
    sparse_waiting    {key, min_version, rank}                from a worker whose pull waits long:
                                                              the round and who has not pushed it
    sparse_replicate  {key, primary, version, ...}            a delta of a primary's rows, to its
                                                              backups (sparse_replica.py)
    sparse_install    {key, primary, dim, config, chain, ...}  every row of a table, to a restarted
                                                              server that rejoins (rejoin.py)

With replication (sparse_replica.py) a worker's requests also carry `primary`, the server whose rows
they address (this server's own, or a copy of another's), and `sparse_init` the chains this server is
on; a push is acknowledged once its update is on the backups.

Consistency is the dense keys' (server.py): in rounds mode a worker's n-th push joins round n, applied
once every member pushed (pushes summed per id in rank order, then one update); a pull waits until the
table's version reaches its min_version. In async mode a push applies on arrival.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from paratrain.kvstore import consistency, kernels
from paratrain.kvstore.api import TableConfig, TableError
from paratrain.kvstore.consistency import Policy
from paratrain.kvstore.server.rowstore import (
    ADMIT_SALT,
    GOLDEN,
    Columns,
    IdIndex,
    RowStore,
    initial_rows,
    shard_of,
    unit_hash,
)
from paratrain.kvstore.server.sparse_optim import SparseOptimizer, add_rows, build_optimizer
from paratrain.kvstore.server.sparse_replica import TableCopy, TableReplicas, adopt, install

logger = logging.getLogger(__name__)

__all__ = ["IdIndex", "SparseTable", "SparseTables", "build_optimizer", "initial_rows", "shard_of"]

COUNTS = ("pulls", "pushes", "rows_pulled", "rows_pushed", "created", "not_admitted", "dropped")
COUNTS += ("evicted_age", "evicted_cap")


# -- one table ------------------------------------------------------------------------------------
@dataclass
class PendingPull:
    request: Any
    ids: np.ndarray | None
    """None: a replicated push's acknowledgement, sent once min_version is on the backups."""
    clock: int
    min_version: int
    train: bool
    rank: int | None = None


# A push waiting for its round: unique ids, their gradients, and the slots its worker's last pull
# found for the same ids with the table's eviction count then (None: look them up); the slots are
# checked again when the round is applied if rows were evicted since.
Hint = tuple[np.ndarray, int]
Push = tuple[np.ndarray, torch.Tensor, Hint | None]


class SparseTable:
    """One table's shard on one server. Every method but `__init__` expects `lock` to be held."""

    def __init__(self, key: Any, dim: int, config: TableConfig, optimizer: SparseOptimizer | None) -> None:
        self.key, self.dim, self.config = key, dim, config
        self.lock = threading.Lock()
        self.optimizer = optimizer
        self.own_optimizer = False  # set by set_table_optimizer: the store's default no longer applies
        self.index = IdIndex(config.reserve_rows)
        self.rows = RowStore(self._columns(), config.reserve_rows)
        self.seen_index = IdIndex(64)  # ids sighted but not admitted yet, with their counts
        self.seen = RowStore({"count": ((), torch.int64)}, 64)
        self.version = self.step = 0
        self.next_sweep = 0
        self.rounds: dict[int, dict[int, Push]] = {}
        self.pending: list[PendingPull] = []
        self.counts = dict.fromkeys(COUNTS, 0)
        self.pulled: dict[int, tuple[np.ndarray, Hint]] = {}  # by rank: its last training pull
        self.evictions = 0  # rows evicted so far: a pull's slots stay valid while this is unchanged
        self.broken: str | None = None  # why a round failed to apply: every pull fails with it
        self._combining = kernels.combine_buffers(0, dim)  # kept from round to round (kernels.combine)
        self.replica: TableCopy | None = None  # replicated servers: copies and deltas (sparse_replica.py)

    @property
    def visible(self) -> int:
        """The version pulls and acknowledgements wait for: with replication, the backups'."""
        return self.version if self.replica is None else self.replica.durable

    def _columns(self) -> Columns:
        extra = self.optimizer.columns(self.dim) if self.optimizer else {}
        return {"value": ((self.dim,), torch.float32), **extra}

    @property
    def max_rows(self) -> int:
        """The cap on rows held here from max_rows and max_bytes (0: none)."""
        caps = [self.config.max_rows] if self.config.max_rows else []
        if self.config.max_bytes:
            caps.append(max(1, self.config.max_bytes // self.rows.row_bytes))
        return min(caps) if caps else 0

    def set_optimizer(self, optimizer: SparseOptimizer | None) -> None:
        """A new optimizer starts every held row's state afresh (as torch's does for a parameter)."""
        self.optimizer = optimizer
        self.rows.set_columns(self._columns())
        if optimizer is not None:
            optimizer.init_rows(self.rows.columns, torch.from_numpy(self.rows.live_slots()))

    # -- pull -------------------------------------------------------------------------------------
    def read(self, ids: np.ndarray, clock: int, train: bool, rank: int | None = None) -> torch.Tensor:
        """The rows of `ids` (zeros where absent). A training read admits absent ids and marks the
        rows seen at `clock`; it keeps the slots it found for worker `rank`'s push of the same ids
        (a worker pushes the rows it pulled: that push then needs no lookup)."""
        self.step = max(self.step, clock)
        slots = self.index.lookup(ids)
        if train:
            missing = np.flatnonzero(slots < 0)
            if len(missing):  # unique first: a request with repeated ids must not make two rows
                absent, inverse = np.unique(ids[missing], return_inverse=True)
                slots[missing] = self._admit(absent, clock)[inverse.reshape(-1)]
        held = slots >= 0
        values = self.rows.columns["value"]
        if held.all():
            out = torch.from_numpy(np.take(values.numpy(), slots, axis=0))  # numpy's gather: faster
        else:
            out = torch.zeros(len(ids), self.dim)
            where = np.flatnonzero(held)
            out[torch.from_numpy(where)] = values.index_select(0, torch.from_numpy(slots[where]))
        if train:
            self.rows.last_seen[slots[held]] = clock
            if rank is not None:
                self.pulled[rank] = (ids.copy(), (slots, self.evictions))
            self._enforce_cap()
        self.counts["pulls"] += 1
        self.counts["rows_pulled"] += len(ids)
        return out

    def admit(self, ids: np.ndarray, clock: int) -> np.ndarray:
        """Create the rows of unique absent `ids` that admission lets in (sparse_replica.adopt)."""
        return self._admit(ids, clock)

    def _admit(self, ids: np.ndarray, clock: int) -> np.ndarray:
        """Slots of the ids admitted now (new rows at their first value), -1 for the others."""
        admit = np.ones(len(ids), bool)
        if self.config.admit_after > 1:
            admit &= self._sighted(ids, clock) >= self.config.admit_after
        if self.config.admit_probability < 1:
            admit &= unit_hash(ids, ADMIT_SALT + clock * GOLDEN) < self.config.admit_probability
        slots = np.full(len(ids), -1, np.int64)
        new = ids[admit]
        if len(new):
            created = self.rows.allocate(len(new))
            where = torch.from_numpy(created)
            self.rows.ids[created] = new
            self.rows.columns["value"][where] = initial_rows(new, self.dim, self.config)
            if self.optimizer is not None:
                self.optimizer.init_rows(self.rows.columns, where)
            self.index.insert(new, created)
            slots[admit] = created
            if self.config.admit_after > 1:
                self._forget_sightings(new)
        self.counts["created"] += len(new)
        self.counts["not_admitted"] += len(ids) - len(new)
        return slots

    def _sighted(self, ids: np.ndarray, clock: int) -> np.ndarray:
        """Count one more sighting of each (absent) id; returns the counts."""
        slots = self.seen_index.lookup(ids)
        new = np.flatnonzero(slots < 0)
        if len(new):
            slots[new] = self.seen.allocate(len(new))
            self.seen.ids[slots[new]] = ids[new]
            self.seen.columns["count"][torch.from_numpy(slots[new])] = 0
            self.seen_index.insert(ids[new], slots[new])
        counts = self.seen.columns["count"].numpy()
        counts[slots] += 1
        self.seen.last_seen[slots] = clock
        return counts[slots]

    def _forget_sightings(self, ids: np.ndarray) -> None:
        slots = self.seen_index.lookup(ids)
        slots = slots[slots >= 0]
        self.seen_index.remove(self.seen.ids[slots])
        self.seen.release(slots)

    # -- push -------------------------------------------------------------------------------------
    def push(
        self,
        rank: int,
        clock: int,
        ids: np.ndarray,
        grads: torch.Tensor,
        policy: Policy | str,
        members: frozenset,
        apply: bool = True,
    ) -> None:
        """Worker `rank`'s gradients for unique `ids`: applied now (async) or with round `clock`
        (`apply=False`: the caller applies complete rounds later)."""
        self.counts["pushes"] += 1
        self.counts["rows_pushed"] += len(ids)
        pulled = self.pulled.pop(rank, None)
        hint = pulled[1] if pulled is not None and np.array_equal(pulled[0], ids) else None
        if isinstance(policy, str):  # a consistency model's name (consistency.py)
            policy = consistency.policy(policy)
        if not policy.rounds:  # applied on arrival (async)
            self.apply([(ids, grads, hint)], clock, add=True)
            return
        if clock < self.version:
            raise TableError(f"push to table {self.key!r} for round {clock}, already applied")
        pushed = self.rounds.setdefault(clock, {})
        if rank in pushed:
            raise TableError(f"worker {rank} pushed table {self.key!r} twice in round {clock}")
        pushed[rank] = (ids, grads, hint)
        if apply:
            self.apply_complete_rounds(members)

    def apply_complete_rounds(self, members: frozenset) -> None:
        """Apply, in order, the rounds every member has pushed to."""
        while (pushed := self.rounds.get(self.version)) is not None and members.issubset(pushed):
            del self.rounds[self.version]
            self.apply([pushed[rank] for rank in sorted(pushed)], self.version, add=False)

    def _slots(self, ids: np.ndarray, hint: Hint | None) -> np.ndarray:
        """The slot of each id now (-1: absent): the hint where it still holds that id."""
        if hint is None:
            return self.index.lookup(ids)
        slots, evictions = hint  # the pull's own array, used once: mended in place below
        if evictions == self.evictions:  # no row left since the pull: its slots still hold its ids
            stale = np.flatnonzero(slots < 0)
        else:
            valid = np.flatnonzero(slots >= 0)
            kept = self.rows.alive[slots[valid]] & (self.rows.ids[slots[valid]] == ids[valid])
            stale = np.concatenate([np.flatnonzero(slots < 0), valid[~kept]])
        if len(stale):  # evicted since the pull, or absent then
            slots[stale] = self.index.lookup(ids[stale])
        return slots

    def _combine(self, pushes: list[Push]) -> tuple[np.ndarray, torch.Tensor]:
        """Unique held slots and one gradient each: the pushes' sum, added in the given (rank) order,
        a deterministic update. Gradients of absent rows are dropped."""
        found = [self._slots(ids, hint) for ids, _, hint in pushes]
        rows = sum(len(slots) for slots in found)
        held = sum(int(np.count_nonzero(slots >= 0)) for slots in found)
        self.counts["dropped"] += rows - held
        if len(pushes) == 1 and held == rows:
            return found[0], pushes[0][1].contiguous()  # one push's ids are unique
        if len(self._combining[2]) < rows:
            self._combining = kernels.combine_buffers(rows + rows // 4, self.dim)
        keys, where, unique, summed = self._combining
        size, count = kernels.combine_start(keys, rows), 0
        for slots, (_, grads, _) in zip(found, pushes, strict=True):  # no concatenated copy
            count = kernels.combine(
                slots, grads.contiguous().numpy(), keys, size, where, unique, summed, count
            )
        return unique[:count], torch.from_numpy(summed[:count])  # views: used before the lock is let go

    def apply(self, pushes: list[Push], clock: int, add: bool) -> None:
        """One update of the rows of the pushes' ids (a round's, or one async push)."""
        self.step = max(self.step, clock)
        slots, grads = self._combine(pushes)
        self.rows.last_seen[slots] = clock
        values = self.rows.columns["value"]
        if self.optimizer is not None:
            self.optimizer.step(self.rows.columns, slots, grads)
        elif add:
            add_rows(values, slots, grads)
        else:
            kernels.scatter(values.numpy(), slots, grads.numpy())
        self.version += 1
        self._sweep(clock)
        if self.replica is not None:  # the touched rows to the backups (sparse_replica.py)
            self.replica.forward(self, slots)

    # -- eviction ---------------------------------------------------------------------------------
    def _sweep(self, clock: int) -> None:
        """Evict rows (and sightings) not seen in ttl_steps steps, every sweep_every steps."""
        ttl = self.config.ttl_steps
        if not ttl or clock < self.next_sweep:
            return
        self.next_sweep = clock + self.config.sweep_every
        live = self.rows.live_slots()
        self._evict(live[self.rows.last_seen[live] <= clock - ttl], "evicted_age")
        sighted = self.seen.live_slots()
        old = sighted[self.seen.last_seen[sighted] <= clock - ttl]
        self.seen_index.remove(self.seen.ids[old])
        self.seen.release(old)

    def _enforce_cap(self) -> None:
        excess = self.rows.count - self.max_rows
        if self.max_rows and excess > 0:
            live = self.rows.live_slots()
            oldest = np.argpartition(self.rows.last_seen[live], excess - 1)[:excess]
            self._evict(live[oldest], "evicted_cap")

    def _evict(self, slots: np.ndarray, reason: str) -> None:
        if len(slots):
            if self.replica is not None:
                self.replica.evicted.append(self.rows.ids[slots])
            self.index.remove(self.rows.ids[slots])
            self.rows.release(slots)
            self.counts[reason] += len(slots)
            self.evictions += len(slots)

    # -- figures and state ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        rows = self.rows.count
        reserved = (
            self.rows.reserved_bytes + self.index.nbytes + self.seen.reserved_bytes + self.seen_index.nbytes
        )
        return {
            "rows": rows,
            "bytes": rows * self.rows.row_bytes,
            "row_bytes": self.rows.row_bytes,
            "reserved_bytes": reserved,
            "capacity": self.rows.capacity,
            "sighted": self.seen.count,
            "version": self.version,
            "step": self.step,
            "open_rounds": len(self.rounds),
            "waiting_pulls": len(self.pending),
            **self.counts,
        }

    def state(self, full: bool) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """ids and values of every row; `full`: also each row's age in steps and optimizer state."""
        slots = np.sort(self.rows.live_slots())
        where = torch.from_numpy(slots)
        names = [n for n in self.rows.columns if n != "value"] if full else []
        meta = {"key": self.key, "dim": self.dim, "names": names, "step": self.step}
        meta["config"] = dataclasses.asdict(self.config)
        meta["optimizer"] = self.optimizer.spec if self.optimizer is not None and self.own_optimizer else []
        tensors = [
            torch.from_numpy(self.rows.ids[slots].copy()),
            self.rows.columns["value"].index_select(0, where),
        ]
        if full:
            tensors.append(torch.from_numpy(self.step - self.rows.last_seen[slots]))
            tensors += [self.rows.columns[n].index_select(0, where) for n in names]
        return meta, tensors

    def load(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        """Replace every row with the given ones: ids, values, ages, then state by `names`."""
        ids, values, ages, state = (
            tensors[0],
            tensors[1],
            tensors[2],
            dict(zip(names, tensors[3:], strict=True)),
        )
        wanted = [n for n in self.rows.columns if n != "value"]
        if state and sorted(state) != sorted(wanted):
            raise TableError(
                f"table {self.key!r}: the state file keeps optimizer state {sorted(state)} but this "
                f"table's optimizer keeps {wanted}: set the same optimizer before load_state"
            )
        shapes = (tuple(values.shape), tuple(ages.shape), ids.dtype, ages.dtype)
        if shapes != ((len(ids), self.dim), (len(ids),), torch.int64, torch.int64):
            raise TableError(f"table {self.key!r}: rows of the wrong shape or dtype")
        self.index = IdIndex(max(len(ids), self.config.reserve_rows))
        self.rows = RowStore(self._columns(), max(len(ids), self.config.reserve_rows))
        self.seen_index, self.seen = IdIndex(64), RowStore({"count": ((), torch.int64)}, 64)
        self.version = self.step = self.next_sweep = 0
        self.rounds, self.pending, self.pulled = {}, [], {}
        if self.replica is not None:
            self.replica.reset()
        slots = self.rows.allocate(len(ids))
        where = torch.from_numpy(slots)
        ids_np = ids.numpy().copy()
        self.rows.ids[slots] = ids_np
        self.rows.last_seen[slots] = -ages.numpy()  # ages carry over; the workers' clocks restart at 0
        self.rows.columns["value"][where] = values
        if self.optimizer is not None:
            self.optimizer.init_rows(self.rows.columns, where)
        for name, tensor in state.items():
            self.rows.columns[name][where] = tensor
        self.index.insert(ids_np, slots)


# -- the server's side of the protocol ------------------------------------------------------------
class SparseTables:
    """The sparse ops of one KVServer; reads its rules (consistency policy, members) and default
    optimizer."""

    OPS = frozenset(
        ("sparse_init", "sparse_pull", "sparse_push", "sparse_optimizer", "sparse_stats")
        + ("sparse_get_state", "sparse_set_state", "sparse_waiting", "sparse_replicate", "sparse_install")
    )

    def __init__(self, server: Any) -> None:
        self.server = server
        self.tables: dict[Any, SparseTable] = {}
        self.copies: dict[tuple[Any, int], SparseTable] = {}
        """Replicated servers: other servers' rows of each table, by (key, primary) (sparse_replica.py)."""
        self._lock = threading.Lock()
        self._default: tuple[str, dict] | None = None
        self._replicas: TableReplicas | None = None

    @property
    def replicas(self) -> TableReplicas | None:
        """Copying rows to the backups (sparse_replica.py); None without replication."""
        replicator = getattr(self.server, "replicator", None)
        if replicator is None or not replicator.enabled:
            return None
        with self._lock:
            if self._replicas is None:
                self._replicas = TableReplicas(replicator, self.serve_ready)
            return self._replicas

    def all_tables(self, key: Any = None) -> list[SparseTable]:
        """This server's tables (or those of `key`): its own rows and its copies."""
        with self._lock:
            tables = [*self.tables.values(), *self.copies.values()]
        return [t for t in tables if key is None or t.key == key]

    def handle(self, request: Any) -> None:
        op, meta = request.op, request.meta
        if op == "sparse_pull":
            self._pull(request)
        elif op == "sparse_push":
            self._push(request)
        elif op == "sparse_init":
            self._init(meta["key"], int(meta["dim"]), TableConfig(**meta["config"]), meta.get("chains"))
            request.reply({})
        elif op == "sparse_optimizer":
            self._table(meta["key"])
            for table in self.all_tables(meta["key"]):  # with replication, the copies too
                built = build_optimizer(meta["path"], meta["hyper"])
                with table.lock:
                    table.set_optimizer(built)
                    table.own_optimizer = True
            request.reply({})
        elif op == "sparse_replicate":
            replicas = self.replicas
            if replicas is None:
                raise TableError(f"server {self.server.rank} keeps no copies: replication is off")
            table = self._copy_of(meta)
            if table is None:  # while catching up after a restart: that table's transfer follows
                request.reply({})
                return
            replicas.restore(table, request)
        elif op == "sparse_install":
            self._install(request)
        elif op == "sparse_stats":
            table = self._table(meta["key"], meta.get("primary"))
            with table.lock:
                stats = table.stats()
            request.reply(stats)
        elif op == "sparse_get_state":
            self._get_state(request)
        elif op == "sparse_waiting":
            request.reply({"waits": self._waiting(meta)})
        elif op == "sparse_set_state":
            table = self._table(meta["key"], meta.get("primary"))
            with table.lock:
                table.load(list(meta["names"]), request.tensors)
            request.reply({})

    def _waiting(self, meta: dict) -> list[dict]:
        """What holds a waiting worker's pull back: the table's next round and the members that
        have not pushed it (logged here too, so that the wait is not silent on this side)."""
        table, need = self._table(meta["key"], meta.get("primary")), int(meta["min_version"])
        members = frozenset(self.server.members)
        with table.lock:
            if table.version >= need:
                return []
            round_, missing = table.version, sorted(members - set(table.rounds.get(table.version, {})))
        logger.warning(
            "server %d: worker %s waits for round %d of table %r, which worker(s) %s have not pushed",
            self.server.rank,
            meta.get("rank"),
            round_,
            table.key,
            ", ".join(map(str, missing)) or "none (being applied)",
        )
        return [{"kind": "table", "key": table.key, "round": round_, "missing": missing}]

    def _table(self, key: Any, primary: int | None = None) -> SparseTable:
        """The table's rows of server `primary` (None: this server's own)."""
        if primary is not None and int(primary) != self.server.rank:
            table = self.copies.get((key, int(primary)))
            if table is None:
                raise TableError(
                    f"server {self.server.rank} keeps no copy of server {primary}'s rows of table {key!r}"
                )
            return table
        table = self.tables.get(key)
        if table is None:
            raise TableError(f"table {key!r} is not on server {self.server.rank}: call init_table first")
        return table

    def _copy_of(self, meta: dict) -> SparseTable | None:
        """The table a delta is for; None where this server is a restarted one catching up and has
        no transfer of it yet (rejoin.py: the transfer, taken after the delta, is newer)."""
        try:
            return self._table(meta["key"], meta["primary"])
        except TableError:
            if not self.server.replicator.catching_up:
                raise
            return None

    def _install(self, request: Any) -> None:
        """Op sparse_install: a table's rows, sent to this restarted server by the server that
        serves them (sparse_replica.send_tables); made here afresh, then the deltas follow."""
        meta, replicas = request.meta, self.replicas
        if replicas is None:
            raise TableError(f"server {self.server.rank} keeps no copies: replication is off")
        chain, key = [int(s) for s in meta["chain"]], meta["key"]
        optimizer = build_optimizer(*meta["optimizer"]) if meta["optimizer"] else None
        table = SparseTable(key, int(meta["dim"]), TableConfig(**meta["config"]), optimizer)
        table.own_optimizer = bool(meta["own_optimizer"])
        replicas.attach(table, chain)
        with table.lock:
            install(table, meta, request.tensors)
            table.replica.source = request.conn  # drained before this copy serves (TableReplicas.serve)
        with self._lock:
            if chain[0] == self.server.rank:
                self.tables[key] = table
            else:
                self.copies[(key, chain[0])] = table
        request.reply({})

    def _serving(self, meta: dict) -> SparseTable:
        """The table a worker's pull or push is for; with replication, a copy whose primary died
        first takes every delta that primary sent (sparse_replica.py)."""
        table = self._table(meta["key"], meta.get("primary"))
        replicas = self.replicas
        if replicas is not None:
            replicas.serve(table, [int(s) for s in meta.get("dead", [])])
        return table

    def _init(self, key: Any, dim: int, config: TableConfig, chains: list | None = None) -> None:
        """Creates or checks the table; with replication, one per chain this server is on (its
        own rows and its copies of other servers')."""
        if not isinstance(dim, int) or dim < 1:
            raise TableError(f"table {key!r}: dim={dim!r} must be an int >= 1")
        replicas = self.replicas
        chains = [[int(s) for s in chain] for chain in chains or []] if replicas is not None else []
        with self._lock:
            for chain in chains or [[self.server.rank]]:
                own = chain[0] == self.server.rank
                table = self.tables.get(key) if own else self.copies.get((key, chain[0]))
                if table is None:
                    table = SparseTable(key, dim, config, self._default_optimizer(key))
                    if replicas is not None:
                        replicas.attach(table, chain)
                    if own:
                        self.tables[key] = table
                    else:
                        self.copies[(key, chain[0])] = table
                elif (table.dim, table.config) != (dim, config):
                    raise TableError(
                        f"table {key!r} was declared with dim {table.dim} and {table.config}; "
                        f"dim {dim} and {config} is not allowed"
                    )

    def _default_optimizer(self, key: Any) -> SparseOptimizer | None:
        """The sparse form of the store's optimizer; none (until set_table_optimizer) where it has none."""
        if self._default is None:
            return None
        try:
            return build_optimizer(*self._default)
        except TableError as exc:
            logger.warning("table %r starts without an optimizer: %s", key, exc)
            return None

    def set_default_optimizer(self, path: str, hyper: dict) -> None:
        """The store's optimizer (set_optimizer) becomes that of every table without its own."""
        with self._lock:
            tables = [t for t in [*self.tables.values(), *self.copies.values()] if not t.own_optimizer]
            built = [build_optimizer(path, hyper) for _ in tables]  # refuse before changing anything
            self._default = (path, hyper)
        for table, optimizer in zip(tables, built, strict=True):
            with table.lock:
                table.set_optimizer(optimizer)

    def members_changed(self) -> None:
        """A worker left: rounds stop waiting for it."""
        for table in self.all_tables():
            with table.lock:
                table.apply_complete_rounds(frozenset(self.server.members))
                ready = self._take_ready(table)
            self._send(ready)

    # -- pull and push ----------------------------------------------------------------------------
    def _pull(self, request: Any) -> None:
        meta, table = request.meta, self._serving(request.meta)
        ids = self._ids(request, table)
        rank = meta.get("rank")
        pull = PendingPull(request, ids, int(meta["clock"]), int(meta["min_version"]), bool(meta["train"]))
        pull.rank = None if rank is None else int(rank)
        with table.lock:
            ready = self._catch_up(table)
            if table.broken is not None:
                self._send(ready)
                raise TableError(table.broken)
            if table.visible < pull.min_version:
                if request.header.at is not None:  # a view of the shared-memory ring: keep a copy
                    pull.ids = ids.copy()
                table.pending.append(pull)
                rows = None
            else:
                rows, version = table.read(ids, pull.clock, pull.train, pull.rank), table.version
        self._send(ready)
        if rows is not None:
            request.reply({"versions": [version]}, [rows])

    def _push(self, request: Any) -> None:
        meta, table = request.meta, self._serving(request.meta)
        ids = self._ids(request, table)
        grads = request.tensors[1]
        if grads.dtype != torch.float32 or tuple(grads.shape) != (len(ids), table.dim):
            raise TableError(
                f"push to table {table.key!r}: gradients must be float32 [{len(ids)}, {table.dim}]"
            )
        rules = self.server.rules
        members, rounds = rules.members, rules.policy.rounds
        if request.header.at is not None and rounds:  # kept past this call
            ids, grads = ids.copy(), grads.clone()
        with table.lock:
            rank, clock = int(meta["rank"]), int(meta["clock"])
            copy = table.replica
            repeat = copy is not None and copy.repeat(table, rank, clock, rounds)  # after a fail-over
            if copy is not None and copy.promoted and not repeat:  # rows the dead primary made
                adopt(table, ids, clock)
            if not repeat:
                table.push(rank, clock, ids, grads, rules.policy, members, apply=not rounds)
            if copy is not None:  # acknowledged once its update is on the backups (sparse_replica.py)
                need = clock + 1 if rounds else table.version
                table.pending.append(PendingPull(request, None, clock, need, False))
            ready = [] if rounds and not repeat else self._take_ready(table)
        if repeat:
            self._send(ready)
            return
        if copy is None:
            request.reply({})  # in rounds modes a push is done once it joined its round
        if rounds:  # the round's update runs while the pusher goes on to its next step
            ready = self._apply_rounds(table, members)
        self._send(ready)

    def _apply_rounds(self, table: SparseTable, members: frozenset) -> list:
        """Apply the table's complete rounds; the pulls that may go on. A round that fails to apply
        fails the waiting pulls and every later one: workers get the error, never a hang."""
        with table.lock:
            return self._applied(table, members)

    def _applied(self, table: SparseTable, members: frozenset) -> list:
        """_apply_rounds, holding table.lock."""
        try:
            table.apply_complete_rounds(members)
        except Exception as exc:
            logger.exception("table %r: a round failed to apply", table.key)
            table.broken = f"server {self.server.rank}: table {table.key!r} could not apply a round: {exc!r}"
        if table.broken is not None:
            failed, table.pending = table.pending, []
            return [(pull.request, None, table.broken) for pull in failed]
        return self._take_ready(table)

    def _catch_up(self, table: SparseTable) -> list:
        """Before a read (holds table.lock): apply a round whose pushes were all acknowledged but
        that its last pusher's thread has not applied yet (it replies first, _push). So a request
        sent after a round's pushes were acknowledged sees that round, as with dense keys (whose
        rounds apply before the reply): e.g. a bounded pull after kv.barrier() sees every round.
        Returns the pulls that may go now."""
        members = self.server.rules.members
        waiting = table.rounds.get(table.version)
        if waiting is None or not members.issubset(waiting):
            return []
        return self._applied(table, members)

    @staticmethod
    def _ids(request: Any, table: SparseTable) -> np.ndarray:
        ids = request.tensors[0] if request.tensors else None
        if ids is None or ids.dtype != torch.int64 or ids.dim() != 1:
            raise TableError(f"request for table {table.key!r} must carry a 1-D int64 tensor of ids")
        return ids.numpy()

    @staticmethod
    def _take_ready(table: SparseTable) -> list[tuple[Any, torch.Tensor | None, int | str]]:
        """Serve the pulls the table's version now allows (holds table.lock)."""
        ready, waiting = [], []
        for pull in table.pending:
            if table.visible < pull.min_version:
                waiting.append(pull)
                continue
            if pull.ids is None:  # a replicated push's acknowledgement: no rows
                ready.append((pull.request, None, table.version))
                continue
            try:
                rows = table.read(pull.ids, pull.clock, pull.train, pull.rank)
                ready.append((pull.request, rows, table.version))
            except Exception as exc:  # that pull fails, not this push
                ready.append((pull.request, None, f"server: {exc!r}"))
        table.pending = waiting
        return ready

    @staticmethod
    def _send(ready: list[tuple[Any, torch.Tensor | None, int | str]]) -> None:
        for request, rows, version in ready:
            if isinstance(version, str):
                request.fail(version)
            elif rows is None:
                request.reply({})
            else:
                request.reply({"versions": [version]}, [rows])

    def close(self) -> None:
        """The server ends: the thread confirming the backups' copies ends first (replies.py)."""
        if self._replicas is not None:
            self._replicas.close()

    def serve_ready(self, table: SparseTable) -> None:
        """Serve the table's pulls and acknowledgements that may go now (its durable version moved)."""
        with table.lock:
            ready = self._take_ready(table)
        self._send(ready)

    # -- state ------------------------------------------------------------------------------------
    def _get_state(self, request: Any) -> None:
        key, full = request.meta.get("key"), bool(request.meta.get("full", True))
        primary = request.meta.get("primary")  # with replication: that server's rows, from a copy
        with self._lock:
            if primary is not None and int(primary) != self.server.rank:
                tables = [t for (k, p), t in self.copies.items() if p == int(primary) and key in (None, k)]
            else:
                tables = [self._table(key)] if key is not None else list(self.tables.values())
        entries, tensors = [], []
        for table in tables:
            with table.lock:
                ready = self._catch_up(table)
                meta, parts = table.state(full)
            self._send(ready)
            entries.append(meta | {"tensors": len(parts)})
            tensors += parts
        request.reply({"tables": entries}, tensors)
