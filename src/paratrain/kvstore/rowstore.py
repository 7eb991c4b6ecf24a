"""Server-side storage of sparse tables, with no Python object per row.

`IdIndex` maps ids to slots through a bucketed open-addressing hash table in two numpy arrays (8 ids
to a bucket, one cache line; a full bucket spills into the next), so a batch of ids is looked up or
inserted in a few vectorized passes. `RowStore` keeps the rows, their optimizer state and bookkeeping
(id, last step seen) in preallocated tensors that double when full, and reuses released slots from a
free list. The hashes here also place ids on servers (`shard_of`) and give new rows their first
values (`initial_rows`).
"""

from __future__ import annotations

import numpy as np
import torch

from paratrain.kvstore.api import TableConfig

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
SHARD_SALT, INDEX_SALT, INIT_SALT, ADMIT_SALT = 0x51A8D, 0x1DE7, 0x1417, 0xAD417
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
BOOKKEEPING_BYTES = 8 + 8 + 1  # id, last step seen, alive flag


# -- hashing --------------------------------------------------------------------------------------
def mix64(values: np.ndarray, salt: int = 0) -> np.ndarray:
    """splitmix64's finalizer of values + salt (uint64, wrapping): every input bit moves every
    output bit, so sequential and hashed ids alike spread evenly."""
    z = np.ascontiguousarray(values).view(np.uint64) + np.uint64(salt & MASK64)
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


def shard_of(ids: torch.Tensor, num_servers: int) -> torch.Tensor:
    """The server of each id (int64 tensor): high bits of a hash, independent of the bits the
    servers' index uses."""
    if num_servers == 1:
        return torch.zeros(len(ids), dtype=torch.int64)
    high = mix64(ids.numpy(), SHARD_SALT) >> _S32
    return torch.from_numpy((high % np.uint64(num_servers)).astype(np.int64))


def unit_hash(values: np.ndarray, salt: int) -> np.ndarray:
    """A uniform number in [0, 1) per value, from its hash."""
    return (mix64(values, salt) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def initial_rows(ids: np.ndarray, dim: int, config: TableConfig) -> torch.Tensor:
    """The first value of each id's row: a function of id, column and config only."""
    if config.initializer == "zeros" or config.init_scale == 0:
        return torch.zeros(len(ids), dim)
    base = mix64(ids, INIT_SALT + config.init_seed * GOLDEN)
    cells = base[:, None] + np.arange(dim, dtype=np.uint64) * np.uint64(GOLDEN)  # (n, dim), wraps
    u = unit_hash(cells, 1)
    if config.initializer == "uniform":
        values = (2.0 * u - 1.0) * config.init_scale
    else:  # Box-Muller on two independent uniforms
        radius = np.sqrt(-2.0 * np.log1p(-u))
        values = radius * np.cos(2 * np.pi * unit_hash(cells, 2)) * config.init_scale
    return torch.from_numpy(values.astype(np.float32))


# -- id -> slot -----------------------------------------------------------------------------------
class IdIndex:
    """Bucketed open addressing: an id lives in bucket hash(id) or, if that was full when it came, a
    later one. A removed id leaves a tombstone (free for inserts, but it does not end a search), so
    only a rebuild turns positions back to empty."""

    WIDTH = 8
    MAX_LOAD = 0.75
    EMPTY, REMOVED = -1, -2

    def __init__(self, expected: int = 1024) -> None:
        self._allocate(expected)

    def _allocate(self, expected: int) -> None:
        buckets = 1
        while buckets * self.WIDTH * self.MAX_LOAD / 2 < max(expected, self.WIDTH):
            buckets *= 2  # a rebuilt table is at most half as full as MAX_LOAD
        self.keys = np.zeros((buckets, self.WIDTH), np.int64)
        self.slots = np.full((buckets, self.WIDTH), self.EMPTY, np.int64)
        self._mask = buckets - 1
        self.live = 0
        self.used = 0  # positions no longer empty: live ids and tombstones

    def __len__(self) -> int:
        return self.live

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.slots.nbytes

    def _buckets(self, ids: np.ndarray) -> np.ndarray:
        return (mix64(ids, INDEX_SALT) & np.uint64(self._mask)).astype(np.int64)

    def _find(self, ids: np.ndarray) -> np.ndarray:
        """Flat position of each id in keys/slots, -1 where absent. A bucket's 8 match flags are
        read as one uint64 (np.take and byte views: several times faster than fancy indexing and
        reductions along a short axis)."""
        out = np.full(len(ids), -1, np.int64)
        todo, query, bucket = np.arange(len(ids)), ids, self._buckets(ids)
        while len(todo):
            slots = np.take(self.slots, bucket, axis=0)
            hit = (np.take(self.keys, bucket, axis=0) == query[:, None]) & (slots >= 0)
            flags = hit.view(np.uint64).ravel()  # one id matches at most one position
            found = flags != 0
            column = (np.frexp(flags[found].astype(np.float64))[1] - 1) // 8  # 2**(8 c) -> c
            out[todo[found]] = bucket[found] * self.WIDTH + column
            has_empty = (slots == self.EMPTY).view(np.uint64).ravel() != 0  # it ends the search
            go_on = ~found & ~has_empty
            todo, query, bucket = todo[go_on], query[go_on], (bucket[go_on] + 1) & self._mask
        return out

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where absent."""
        where = self._find(ids)
        held = where >= 0
        slots = np.full(len(ids), -1, np.int64)
        slots[held] = np.take(self.slots.reshape(-1), where[held])
        return slots

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Add ids, which must be unique and absent, at the given slots."""
        if self.used + len(ids) > self.MAX_LOAD * self.slots.size:
            self._rebuild(self.live + len(ids))
        self._place(ids, slots)

    def remove(self, ids: np.ndarray) -> None:
        where = self._find(ids)
        where = where[where >= 0]
        self.slots.reshape(-1)[where] = self.REMOVED
        self.live -= len(where)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, slots) of every id held."""
        held = self.slots >= 0
        return self.keys[held], self.slots[held]

    def _rebuild(self, expected: int) -> None:
        ids, slots = self.items()
        self._allocate(expected)
        self._place(ids, slots)

    def _place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Each pass puts every pending id in a free position of its current bucket: ids sharing
        a bucket take its free positions in turn; those left over move to the next bucket."""
        todo, bucket = np.arange(len(ids)), self._buckets(ids)
        while len(todo):
            where = bucket[todo]
            free = self.slots[where] < 0
            order = np.argsort(where, kind="stable")
            ranked = where[order]
            starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
            turn = np.empty(len(todo), np.int64)
            turn[order] = np.arange(len(todo)) - np.repeat(starts, np.diff(np.r_[starts, len(todo)]))
            take = free & (np.cumsum(free, axis=1) == turn[:, None] + 1)
            ok = take.any(1)
            rows, cols, pick = where[ok], take[ok].argmax(1), todo[ok]
            self.used += int((self.slots[rows, cols] == self.EMPTY).sum())
            self.keys[rows, cols] = ids[pick]
            self.slots[rows, cols] = slots[pick]
            self.live += len(pick)
            todo = todo[~ok]
            bucket[todo] = (bucket[todo] + 1) & self._mask


# -- rows -----------------------------------------------------------------------------------------
Columns = dict[str, tuple[tuple[int, ...], torch.dtype]]


class RowStore:
    """Per-row tensors (`columns`) and bookkeeping in preallocated storage that doubles when full.
    `top` is the high-water mark; released slots below it wait on a free stack."""

    def __init__(self, columns: Columns, reserve: int) -> None:
        self.spec = dict(columns)
        self.capacity = self.top = self.count = self._nfree = 0
        self.columns: dict[str, torch.Tensor] = {
            n: torch.zeros((0, *s), dtype=t) for n, (s, t) in columns.items()
        }
        self.ids = np.zeros(0, np.int64)
        self.last_seen = np.zeros(0, np.int64)
        self.alive = np.zeros(0, bool)
        self._free = np.zeros(0, np.int64)
        self._grow(reserve)

    @property
    def row_bytes(self) -> int:
        cells = (int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for shape, dtype in self.spec.values())
        return sum(cells) + BOOKKEEPING_BYTES

    @property
    def reserved_bytes(self) -> int:
        return self.capacity * (self.row_bytes + 8)  # + the free stack

    def _grow(self, capacity: int) -> None:
        old, top = self.columns, self.top
        self.columns = {}
        for name, (shape, dtype) in self.spec.items():
            self.columns[name] = torch.zeros((capacity, *shape), dtype=dtype)
            self.columns[name][:top] = old[name][:top]
        for name in ("ids", "last_seen", "alive", "_free"):
            grown = np.zeros(capacity, getattr(self, name).dtype)
            grown[:top] = getattr(self, name)[:top]
            setattr(self, name, grown)
        self.capacity = capacity

    def set_columns(self, columns: Columns) -> None:
        """Change the per-row tensors: columns kept by name keep their data, new ones start at 0."""
        kept = {n: t for n, t in self.columns.items() if n in columns and self.spec[n] == columns[n]}
        self.spec = dict(columns)
        self.columns = {
            n: kept.get(n, torch.zeros((self.capacity, *s), dtype=t)) for n, (s, t) in columns.items()
        }

    def allocate(self, n: int) -> np.ndarray:
        reused = min(n, self._nfree)
        self._nfree -= reused
        slots = self._free[self._nfree : self._nfree + reused].copy()
        if self.top + n - reused > self.capacity:
            self._grow(max(2 * self.capacity, self.top + n - reused))
        slots = np.concatenate([slots, np.arange(self.top, self.top + n - reused)])
        self.top += n - reused
        self.alive[slots] = True
        self.count += n
        return slots

    def release(self, slots: np.ndarray) -> None:
        self.alive[slots] = False
        self._free[self._nfree : self._nfree + len(slots)] = slots
        self._nfree += len(slots)
        self.count -= len(slots)

    def live_slots(self) -> np.ndarray:
        return np.flatnonzero(self.alive[: self.top])
