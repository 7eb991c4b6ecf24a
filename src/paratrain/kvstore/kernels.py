"""The per-row loops of sparse tables, compiled with numba.

Why numba: a sparse step touches a few thousand random rows of tables of millions. Written as
vectorized numpy or torch, each step is some 25 passes over temporaries (hash, gather the bucket,
compare, select, scatter, ...) and each optimizer update a gather, five elementwise ops and a scatter
per state tensor; measured here that cost about 1.2 ms of server time per worker step, most of it
cache misses and per-call overhead. These loops do the same in one pass per row, in place. torch has
no hash table or fused sparse-row optimizer for the CPU, so there is nothing to call instead.

Every kernel releases the GIL (nogil): a server's connection threads run them side by side on
different tables. Compiled code is cached next to this file, so only the first process on a machine
pays for compiling (a few seconds).

Floating point follows torch's formulas operation by operation in float32 (the optimizers'
hyperparameters arrive as float32 scalars), so tables match torch.optim to rounding.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

_F = TypeVar("_F", bound=Callable[..., Any])
_PLAIN: dict[str, Callable[..., Any]] = {}
_compiling = threading.Lock()
_compiled = False


def jit(func: _F) -> _F:
    """`func`, compiled by numba on the first call of any kernel here. Importing numba costs a
    process about 0.25 CPU-s, and a server whose job has no sparse table never calls a kernel."""
    _PLAIN[func.__name__] = func

    @functools.wraps(func)
    def first_call(*args: Any) -> Any:
        compile_all()
        return globals()[func.__name__](*args)

    return first_call  # type: ignore[return-value]


def compile_all() -> None:
    """Binds every kernel's name here to its numba dispatcher, all at once: a kernel that calls
    another (mix64) finds a dispatcher under that name when numba compiles it. A new table calls
    it, so that numba's import is not paid inside the deadline of the table's first round."""
    global _compiled
    with _compiling:
        if _compiled:
            return
        import numba

        # error_model="numpy": x / 0 gives inf or nan as in torch, and without a zero check per
        # division the float loops vectorize (7x faster here).
        njit = numba.njit(nogil=True, cache=True, error_model="numpy")
        globals().update({name: njit(func) for name, func in _PLAIN.items()})
        _compiled = True


EMPTY, REMOVED = -1, -2
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


@jit
def mix64(value: np.int64, salt: np.uint64) -> np.uint64:
    """splitmix64's finalizer of value + salt: the scalar form of rowstore.mix64."""
    z = np.uint64(value) + salt
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


# -- id -> slot: open addressing with linear probing over (id, slot) pairs ---------------------------
@jit
def index_lookup(entries: np.ndarray, salt: np.uint64, ids: np.ndarray, out: np.ndarray) -> None:
    """out[i] = the slot of ids[i], or EMPTY where absent."""
    mask = np.uint64(len(entries) - 1)
    for i in range(len(ids)):
        key = ids[i]
        p = mix64(key, salt) & mask
        out[i] = EMPTY
        while True:
            slot = entries[p, 1]
            if slot == EMPTY:
                break
            if slot >= 0 and entries[p, 0] == key:
                out[i] = slot
                break
            p = (p + np.uint64(1)) & mask


@jit
def index_insert(entries: np.ndarray, salt: np.uint64, ids: np.ndarray, slots: np.ndarray) -> int:
    """Add absent ids at the given slots (the first free position on each probe path); returns how
    many empty positions were used (tombstones reused do not count)."""
    mask = np.uint64(len(entries) - 1)
    used = 0
    for i in range(len(ids)):
        p = mix64(ids[i], salt) & mask
        while entries[p, 1] >= 0:
            p = (p + np.uint64(1)) & mask
        if entries[p, 1] == EMPTY:
            used += 1
        entries[p, 0] = ids[i]
        entries[p, 1] = slots[i]
    return used


@jit
def index_remove(entries: np.ndarray, salt: np.uint64, ids: np.ndarray) -> int:
    """Turn the ids' positions into tombstones; returns how many ids were held."""
    mask = np.uint64(len(entries) - 1)
    removed = 0
    for i in range(len(ids)):
        key = ids[i]
        p = mix64(key, salt) & mask
        while True:
            slot = entries[p, 1]
            if slot == EMPTY:
                break
            if slot >= 0 and entries[p, 0] == key:
                entries[p, 1] = REMOVED
                removed += 1
                break
            p = (p + np.uint64(1)) & mask
    return removed


# -- workers: dedup and group by server --------------------------------------------------------------
@jit
def dedup_by_server(
    ids: np.ndarray, num_servers: int, salt: np.uint64
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unique ids grouped by server, in order of first appearance within a server; where each id
    of `ids` is among them; how many each server gets). The server of an id is rowstore.shard_of's."""
    n = len(ids)
    size = 16
    while size < 2 * n:
        size *= 2
    mask = np.uint64(size - 1)
    keys = np.empty(size, np.int64)
    seen = np.full(size, -1, np.int64)  # position of the key among the unique ids
    first = np.empty(n, np.int64)
    inverse = np.empty(n, np.int64)
    unique = 0
    for i in range(n):
        key = ids[i]
        p = mix64(key, np.uint64(0x9E3779B97F4A7C15)) & mask
        while seen[p] >= 0 and keys[p] != key:
            p = (p + np.uint64(1)) & mask
        if seen[p] < 0:
            keys[p] = key
            seen[p] = unique
            first[unique] = key
            unique += 1
        inverse[i] = seen[p]
    server = np.empty(unique, np.int64)
    counts = np.zeros(num_servers, np.int64)
    for u in range(unique):
        s = np.int64((mix64(first[u], salt) >> np.uint64(32)) % np.uint64(num_servers))
        server[u] = s
        counts[s] += 1
    start = np.zeros(num_servers, np.int64)
    for s in range(1, num_servers):
        start[s] = start[s - 1] + counts[s - 1]
    position = np.empty(unique, np.int64)
    routed = np.empty(unique, np.int64)
    for u in range(unique):
        s = server[u]
        position[u] = start[s]
        routed[start[s]] = first[u]
        start[s] += 1
    for i in range(n):
        inverse[i] = position[inverse[i]]
    return routed, inverse, counts


# -- servers: a round's pushes summed per row, and the lazy optimizers ------------------------------
@jit
def combine_start(keys: np.ndarray, rows: int) -> int:
    """Empty the first entries of `keys` for a combine of `rows` gradient rows; returns how many: a
    power of two >= 2 x rows."""
    size = 16
    while size < 2 * rows:
        size *= 2
    keys[:size] = EMPTY
    return size


@jit
def combine(
    slots: np.ndarray,
    grads: np.ndarray,
    keys: np.ndarray,
    size: int,
    where: np.ndarray,
    unique: np.ndarray,
    summed: np.ndarray,
    count: int,
) -> int:
    """Add one push to a round's combine: slots not seen yet go to `unique` (first appearance order)
    after the `count` ones there, and each gradient row is added to its slot's sum in `summed`, in the
    order given; returns the new count. Slots < 0 (rows gone) are dropped.

    The position of each slot seen so far is kept in `keys`/`where`, an open-addressing table of
    `size` entries (combine_start) sized to the round, so that it stays in cache (a table by slot over
    the whole shard costs a cache miss per row). The buffers are the caller's, kept from round to
    round: fresh ones cost a page fault per 4 KiB. Measured in benchmarks/sparse.py's servers, a sync
    round's combine (the CPU it spends beyond an async push's) fell from 0.45 to 0.25 ms."""
    dim = grads.shape[1]
    mask = np.uint64(size - 1)
    for i in range(len(slots)):
        slot = slots[i]
        if slot < 0:
            continue
        p = mix64(slot, np.uint64(0)) & mask
        while keys[p] != EMPTY and keys[p] != slot:
            p = (p + np.uint64(1)) & mask
        if keys[p] == EMPTY:  # first sighting: a sum from zero (0.0 + -0.0 is 0.0)
            keys[p], where[p], unique[count] = slot, count, slot
            for j in range(dim):
                summed[count, j] = np.float32(0.0) + grads[i, j]
            count += 1
        else:
            at = where[p]
            for j in range(dim):
                summed[at, j] += grads[i, j]
    return count


def combine_buffers(rows: int, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """keys, where, unique and summed for a `combine` of up to `rows` gradient rows."""
    size = 16
    while size < 2 * rows:
        size *= 2
    return (
        np.empty(size, np.int64),
        np.empty(size, np.int64),
        np.empty(rows, np.int64),
        np.empty((rows, dim), np.float32),
    )


@jit
def add_rows(value: np.ndarray, slots: np.ndarray, delta: np.ndarray, alpha: np.float32) -> None:
    """value[slots] += alpha * delta, for unique slots (torch's add_ with alpha)."""
    for i in range(len(slots)):
        row = value[slots[i]]
        for j in range(value.shape[1]):
            row[j] = row[j] + alpha * delta[i, j]


@jit
def gather(table: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """table[slots] as a new contiguous array. A plain copy loop keeps many cache misses in flight
    at once, where a loop that also computes on each row waits for each row in turn."""
    dim = table.shape[1]
    out = np.empty((len(slots), dim), table.dtype)
    for i in range(len(slots)):
        s = slots[i]
        for j in range(dim):
            out[i, j] = table[s, j]
    return out


@jit
def scatter(table: np.ndarray, slots: np.ndarray, rows: np.ndarray) -> None:
    dim = table.shape[1]
    for i in range(len(slots)):
        s = slots[i]
        for j in range(dim):
            table[s, j] = rows[i, j]


@jit
def adagrad_rows(
    value: np.ndarray,
    total: np.ndarray,
    slots: np.ndarray,
    grads: np.ndarray,
    lr: np.float32,
    eps: np.float32,
) -> None:
    """torch.optim.Adagrad's sparse step on the given rows: sum += g*g; value -= lr * g / (sqrt(sum)
    + eps). Gathered, updated and scattered back: see `gather`."""
    rows, sums = gather(value, slots), gather(total, slots)
    r, t, g = rows.ravel(), sums.ravel(), grads.ravel()
    for k in range(len(r)):
        t[k] = t[k] + g[k] * g[k]
        r[k] = r[k] + (-lr) * (g[k] / (np.sqrt(t[k]) + eps))
    scatter(value, slots, rows)
    scatter(total, slots, sums)


@jit
def adam_rows(
    value: np.ndarray,
    avg: np.ndarray,
    avg_sq: np.ndarray,
    steps: np.ndarray,
    slots: np.ndarray,
    grads: np.ndarray,
    lr: float,
    beta1: float,
    beta2: float,
    eps: np.float32,
) -> None:
    """Adam on the given rows, each with its own step count for the bias correction."""
    b1, b2 = np.float32(1 - beta1), np.float32(1 - beta2)
    rows, ms, vs = gather(value, slots), gather(avg, slots), gather(avg_sq, slots)
    for i in range(len(slots)):
        t = steps[slots[i]] + 1
        steps[slots[i]] = t
        size = np.float32(lr * np.sqrt(1 - beta2**t) / (1 - beta1**t))
        for j in range(rows.shape[1]):
            g = grads[i, j]
            m = (g - ms[i, j]) * b1 + ms[i, j]
            v = (g * g - vs[i, j]) * b2 + vs[i, j]
            ms[i, j] = m
            vs[i, j] = v
            rows[i, j] = rows[i, j] - m / (np.sqrt(v) + eps) * size
    scatter(value, slots, rows)
    scatter(avg, slots, ms)
    scatter(avg_sq, slots, vs)
