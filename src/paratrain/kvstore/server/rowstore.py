"""Server-side storage of sparse tables, with no Python object per row.

`IdIndex` maps ids to slots through an open-addressing hash table searched by compiled loops
(kernels.py). `RowStore` keeps the rows, their optimizer state and bookkeeping
(id, last step seen) in preallocated tensors that double when full, and reuses released slots from a
free list. The hashes here also place ids on servers (`shard_of`) and give new rows their first
values (`initial_rows`).
"""

from __future__ import annotations

import mmap

import numpy as np
import torch

from paratrain.kvstore import kernels
from paratrain.kvstore.api import TableConfig

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
SHARD_SALT, INDEX_SALT, INIT_SALT, ADMIT_SALT = 0x51A8D, 0x1DE7, 0x1417, 0xAD417
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
BOOKKEEPING_BYTES = 8 + 8 + 1  # id, last step seen, alive flag


# -- storage --------------------------------------------------------------------------------------
HUGE_PAGE = 2 << 20
HUGE_MIN_BYTES = 4 * HUGE_PAGE
"""Arrays from this size up get memory of their own, asked for huge pages (`zeros`)."""


def zeros(shape: int | tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """A zeroed array; a large one in anonymous memory of its own, 2 MiB aligned, that the kernel is
    asked to back with 2 MiB pages (madvise MADV_HUGEPAGE: taken where transparent huge pages are
    "madvise", the usual default, or "always"). A table's rows, optimizer state and id index are read
    and written at random, a few thousand rows a step out of millions: with 4 KiB pages nearly every
    row costs a TLB miss as well as a cache miss. torch's allocator does not ask (torch.zeros rows
    get 4 KiB pages); numpy asks only for the aligned middle of its own large arrays.
    benchmarks/sparse_storage.py: an Adagrad update of 4,200 random rows of a 500,000-row shard in
    0.71-0.73x the time of torch.zeros rows. Where the kernel gives none, these are plain pages."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < HUGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.zeros(shape, dtype)
    # Private (never shared with a child) and anonymous (so zeroed); a page more, to start aligned.
    memory = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        memory.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: plain pages
        pass
    raw = np.frombuffer(memory, np.uint8)  # keeps the mapping alive as long as any view of it
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def zero_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros of `shape` in `zeros`' memory (the tensor keeps it alive); a dtype numpy lacks
    gets torch's own."""
    try:
        kind = torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # bfloat16 and the like
        return torch.zeros(shape, dtype=dtype)
    return torch.from_numpy(zeros(shape, kind))


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
    """Open addressing with linear probing over (id, slot) pairs, in one int64 array of shape
    (capacity, 2), searched by the compiled loops in kernels.py: a lookup is one pass over the ids,
    and a probe usually one cache line. A removed id leaves a tombstone (free for inserts, but it does
    not end a search), so only a rebuild turns positions back to empty."""

    MAX_LOAD = 0.75
    SALT = np.uint64(INDEX_SALT)

    def __init__(self, expected: int = 1024) -> None:
        self._allocate(expected)

    def _allocate(self, expected: int) -> None:
        capacity = 16
        while capacity < 2 * expected:  # at most half full: room to grow before the next rebuild
            capacity *= 2
        self.entries = zeros((capacity, 2), np.int64)
        self.entries[:, 1] = kernels.EMPTY
        self.live = 0
        self.used = 0  # positions no longer empty: live ids and tombstones

    def __len__(self) -> int:
        return self.live

    @property
    def nbytes(self) -> int:
        return self.entries.nbytes

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where absent."""
        out = np.empty(len(ids), np.int64)
        kernels.index_lookup(self.entries, self.SALT, np.ascontiguousarray(ids, np.int64), out)
        return out

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Add ids, which must be unique and absent, at the given slots."""
        if self.used + len(ids) > self.MAX_LOAD * len(self.entries):
            self._rebuild(self.live + len(ids))
        ids, slots = np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(slots, np.int64)
        self.used += kernels.index_insert(self.entries, self.SALT, ids, slots)
        self.live += len(ids)

    def remove(self, ids: np.ndarray) -> None:
        self.live -= kernels.index_remove(self.entries, self.SALT, np.ascontiguousarray(ids, np.int64))

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, slots) of every id held."""
        held = self.entries[:, 1] >= 0
        return self.entries[held, 0], self.entries[held, 1]

    def _rebuild(self, expected: int) -> None:
        ids, slots = self.items()
        self._allocate(expected)
        self.used += kernels.index_insert(self.entries, self.SALT, ids, slots)
        self.live = len(ids)


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
            self.columns[name] = zero_tensor((capacity, *shape), dtype)
            self.columns[name][:top] = old[name][:top]
        for name in ("ids", "last_seen", "alive", "_free"):
            grown = zeros(capacity, getattr(self, name).dtype)
            grown[:top] = getattr(self, name)[:top]
            setattr(self, name, grown)
        self.capacity = capacity

    def set_columns(self, columns: Columns) -> None:
        """Change the per-row tensors: columns kept by name keep their data, new ones start at 0."""
        kept = {n: t for n, t in self.columns.items() if n in columns and self.spec[n] == columns[n]}
        self.spec = dict(columns)
        self.columns = {n: kept.get(n, zero_tensor((self.capacity, *s), t)) for n, (s, t) in columns.items()}

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
