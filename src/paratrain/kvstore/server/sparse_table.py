"""One sparse table's shard on one server: its rows, rounds and updates (the wire side, which
serves the sparse_* ops with these tables, is sparse.py).

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

Rounds: in rounds modes a worker's n-th push joins round n, applied once every member pushed (pushes
summed per id in rank order, then one update); in async mode a push applies on arrival. A round's
pushes are added to its sum as they arrive (sparse_fold.py), so its end has only the last one left.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from paratrain.kvstore import kernels
from paratrain.kvstore.api import TableConfig, TableError
from paratrain.kvstore.consistency import Policy
from paratrain.kvstore.server.rowstore import (
    ADMIT_SALT,
    GOLDEN,
    Columns,
    IdIndex,
    RowStore,
    initial_rows,
    unit_hash,
)
from paratrain.kvstore.server.sparse_fold import RoundSum, fold_order_holds, may_fold
from paratrain.kvstore.server.sparse_optim import SparseOptimizer, add_rows
from paratrain.kvstore.server.sparse_replica import TableCopy

__all__ = ["PendingRows", "SparseTable"]

COUNTS: tuple[str, ...] = ("pulls", "pushes", "rows_pulled", "rows_pushed", "created", "not_admitted")
COUNTS += ("dropped", "evicted_age", "evicted_cap")


# Slots found for some ids earlier, with the table's eviction count then: checked again where rows
# were evicted since, and looked up again where absent then (SparseTable._slots).
Hint = tuple[np.ndarray, int]
# A push waiting for its round: unique ids, their gradients, and the slots its worker's last pull
# found for the same ids (None: look them up when the round is applied).
Push = tuple[np.ndarray, torch.Tensor, Hint | None]


@dataclass
class PendingRows:
    """A sparse pull waiting for its table's version to reach `min_version`, then answered with
    its rows (a dense pull waits on its shards' versions instead: pulls.PendingPull)."""

    request: Any
    ids: np.ndarray | None
    """None: a replicated push's acknowledgement, sent once min_version is on the backups."""
    clock: int
    min_version: int
    train: bool
    rank: int | None = None
    hint: Hint | None = None
    """The ids' slots, looked up while the pull waits (SparseTable.find): once its round is
    applied, only the rows are left to read."""


class SparseTable:
    """One table's shard on one server. Every method but `__init__` expects `lock` to be held."""

    def __init__(self, key: Any, dim: int, config: TableConfig, optimizer: SparseOptimizer | None) -> None:
        kernels.compile_all()
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
        self.pending: list[PendingRows] = []
        self.counts = dict.fromkeys(COUNTS, 0)
        self.pulled: dict[int, tuple[np.ndarray, Hint]] = {}  # by rank: its last training pull
        self.evictions = 0  # rows evicted so far: a pull's slots stay valid while this is unchanged
        self.broken: str | None = None  # why a round failed to apply: every pull fails with it
        self._combining = kernels.combine_buffers(0, dim)  # kept from round to round (kernels.combine)
        self.folding = RoundSum(dim)  # the next round's sum, push by push as they come (sparse_fold.py)
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
    def find(self, ids: np.ndarray) -> Hint:
        """The slots of `ids` now, for a read later (`read`'s hint): a pull that waits for its round
        looks its rows up while the round's pushes come in, not after the round's update."""
        return self.index.lookup(ids), self.evictions

    def read(
        self, ids: np.ndarray, clock: int, train: bool, rank: int | None = None, hint: Hint | None = None
    ) -> torch.Tensor:
        """The rows of `ids` (zeros where absent). A training read admits absent ids and marks the
        rows seen at `clock`; it keeps the slots it found for worker `rank`'s push of the same ids
        (a worker pushes the rows it pulled: that push then needs no lookup). `hint`: the ids' slots
        from `find`, checked here."""
        self.step = max(self.step, clock)
        slots = self._slots(ids, hint)
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
        policy: Policy,
        members: frozenset,
        apply: bool = True,
    ) -> None:
        """Worker `rank`'s gradients for unique `ids`: applied now (async) or with round `clock`
        (`apply=False`: the caller applies complete rounds later)."""
        self.counts["pushes"] += 1
        self.counts["rows_pushed"] += len(ids)
        pulled = self.pulled.pop(rank, None)
        hint = pulled[1] if pulled is not None and np.array_equal(pulled[0], ids) else None
        if policy.on_table_push(self, rank, clock, (ids, grads, hint), apply) and apply:
            self.apply_complete_rounds(members)

    def join_round(self, rank: int, clock: int, entry: tuple) -> None:
        """Worker `rank`'s push joins round `clock` (applied once complete)."""
        if clock < self.version:
            raise TableError(f"push to table {self.key!r} for round {clock}, already applied")
        pushed = self.rounds.setdefault(clock, {})
        if rank in pushed:
            raise TableError(f"worker {rank} pushed table {self.key!r} twice in round {clock}")
        pushed[rank] = entry

    def completes(self, rank: int, clock: int, members: frozenset) -> bool:
        """Whether `rank`'s push for round `clock` would complete the next round to apply: then it
        is applied before its pusher's request is done (SparseTables._push)."""
        return clock == self.version and members.issubset({rank, *self.rounds.get(clock, ())})

    def apply_complete_rounds(self, members: frozenset) -> None:
        """Fold the next round's new pushes into its sum (sparse_fold.py), then apply, in order, the
        rounds every member has pushed to."""
        self._fold(members)
        while (pushed := self.rounds.get(self.version)) is not None and members.issubset(pushed):
            del self.rounds[self.version]
            order, folding = sorted(pushed), self.folding
            stamp = (self.evictions, self.counts["created"])
            if (
                folding.round == self.version
                and fold_order_holds(folding.ranks, order)
                and folding.valid(stamp)
            ):
                for rank in order:
                    if rank not in folding.ranks:
                        self._fold_in(rank, pushed[rank])
                self.counts["dropped"] += folding.dropped
                self._update(*folding.take(), self.version, add=False)
            else:  # summed again from the stored pushes
                folding.drop()
                self.apply([pushed[rank] for rank in order], self.version, add=False)
            self._fold(members)

    def _fold(self, members: frozenset) -> None:
        """Add the pushes of the next round that may go in now (sparse_fold.may_fold) to its sum.
        A round that is complete before its first fold is summed at once instead (`_combine`)."""
        pushed = self.rounds.get(self.version)
        folding = self.folding
        if pushed is None or (folding.round != self.version and members.issubset(pushed)):
            return
        order = sorted(members.union(pushed))
        if len(order) < 2:
            return
        if folding.round != self.version:
            rows = max(len(p[0]) for p in pushed.values()) * len(order)
            folding.start(self.version, rows, (self.evictions, self.counts["created"]))
        added = True
        while added:  # a push held for a lower rank may go in once that rank's did
            added = False
            for rank in order:
                if rank in pushed and rank not in folding.ranks and may_fold(rank, folding.ranks, order):
                    self._fold_in(rank, pushed[rank])
                    added = True

    def _fold_in(self, rank: int, push: Push) -> None:
        ids, grads, hint = push
        self.folding.add(rank, self._slots(ids, hint), grads)

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
        self._update(*self._combine(pushes), clock, add)

    def _update(self, slots: np.ndarray, grads: torch.Tensor, clock: int, add: bool) -> None:
        """One update of the rows at unique `slots`, one gradient row each."""
        self.step = max(self.step, clock)
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
        self.folding.drop()
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
