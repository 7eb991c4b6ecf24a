"""A sparse table's storage on one server, with and without huge pages, in one run.

    python benchmarks/sparse_storage.py [--rows 500000] [--dim 16] [--batch 4200] [--steps 300]

Setup: one server's shard of a table (`rows` ids at random, Adagrad state), as paratrain's servers
keep it (rowstore.py): its rows and optimizer state in memory of their own that the kernel is asked
to back with 2 MiB pages (`rowstore.zeros`: madvise MADV_HUGEPAGE), against the same in torch's own
allocation (torch.zeros, which does not ask: the anchor, and what the servers did before). The
index is the same in both. Each step takes `batch` random unique ids, as a
worker's pull or push brings about that many to each of 2 servers in benchmarks/sparse.py, and
times the three things a server does with them: look their slots up in the index, update their rows
with Adagrad, and read their rows for a reply. Between timed calls, 32 MB of other memory is
written, so the rows are not left in cache from the call before (as in a job, where the other
processes' work comes between). Each kind runs twice, in turns; a figure is the lower of its two
medians over the steps, and the ratio is huge pages' time over plain pages', so below 1 is faster.
Where the kernel's transparent huge pages are "never", both kinds use plain pages (ratio about 1).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import _plot  # noqa: E402

from paratrain.kvstore import kernels  # noqa: E402
from paratrain.kvstore.server import rowstore  # noqa: E402

PARTS = ("lookup", "update", "read")


def measure(args: argparse.Namespace, huge: bool) -> tuple[dict[str, float], str]:
    """Median ms of each part, for a shard whose rows are (or are not) in memory asked for huge
    pages, and how much of its rows' values the kernel put on huge pages."""
    saved = rowstore.zero_tensor
    if not huge:  # the rows as before rowstore.zero_tensor: torch's own allocation
        rowstore.zero_tensor = lambda shape, dtype: torch.zeros(shape, dtype=dtype)
    try:
        columns = {"value": ((args.dim,), torch.float32), "sum": ((args.dim,), torch.float32)}
        store = rowstore.RowStore(columns, args.rows)
    finally:
        rowstore.zero_tensor = saved
    index = rowstore.IdIndex(args.rows)
    rng = np.random.default_rng(0)
    ids = rng.choice(2**62, args.rows, replace=False).astype(np.int64)
    index.insert(ids, store.allocate(args.rows))
    value, total = store.columns["value"].numpy(), store.columns["sum"].numpy()
    other = np.zeros(8 << 20, np.float32)
    lr, eps = np.float32(0.01), np.float32(1e-10)
    times: dict[str, list[float]] = {part: [] for part in PARTS}

    def timed(part: str, call: Callable[..., Any], *call_args: Any) -> Any:
        other[:] += 1  # evict the rows the last call touched
        start = time.perf_counter()
        result = call(*call_args)
        times[part].append(time.perf_counter() - start)
        return result

    for _ in range(args.steps):
        batch = ids[rng.choice(args.rows, args.batch, replace=False)]
        slots = timed("lookup", index.lookup, batch)
        grads = rng.standard_normal((len(slots), args.dim)).astype(np.float32)
        timed("update", kernels.adagrad_rows, value, total, slots, grads, lr, eps)
        timed("read", np.take, value, slots, 0)
    return {part: 1e3 * statistics.median(t) for part, t in times.items()}, huge_pages_of(
        store.columns["value"]
    )


def huge_pages_of(tensor: torch.Tensor) -> str:
    """The huge pages of the memory mappings that hold `tensor` (AnonHugePages in /proc/self/smaps,
    Linux), beside its size: arrays side by side can share one mapping, so this can exceed it."""
    start, stop = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    kib, inside = 0, False
    try:
        for line in Path("/proc/self/smaps").read_text().splitlines():
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                inside = int(head.group(1), 16) < stop and int(head.group(2), 16) > start
            elif inside and line.startswith("AnonHugePages:"):
                kib += int(line.split()[1])
    except OSError:
        return "unknown"
    return f"{kib / 1024:.0f} MiB for {(stop - start) / 2**20:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=500_000, help="rows in the shard")
    parser.add_argument("--dim", type=int, default=16, help="values per row")
    parser.add_argument("--batch", type=int, default=4200, help="unique ids a step")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per kind")
    args = parser.parse_args()
    if min(args.rows, args.dim, args.batch, args.steps) < 1 or args.batch > args.rows:
        parser.error("--rows, --dim, --batch and --steps must be >= 1, and --batch <= --rows")
    torch.set_num_threads(1)
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        mode = "not available"
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    pages: dict[bool, str] = {}
    for _ in range(2):  # in turns, so that neither kind always runs first
        for kind, done in runs.items():
            figures, pages[kind] = measure(args, huge=kind)
            done.append(figures)
    plain, huge = ({p: min(f[p] for f in runs[kind]) for p in PARTS} for kind in (False, True))
    setup = (
        f"one shard of {args.rows:,} x {args.dim} float32 rows with Adagrad state, {args.batch:,} random ids "
        f"a step, the lower of two runs' medians over {args.steps} steps; transparent huge pages: {mode}; "
        f"the mappings holding the rows' values on huge pages: {pages[False]} (plain), {pages[True]} (huge); "
        f"{os.cpu_count()} cores, torch {torch.__version__}"
    )
    head = ["part", "plain pages (ms)", "huge pages (ms)", "huge / plain"]
    rows = [[p, f"{plain[p]:.3f}", f"{huge[p]:.3f}", f"{huge[p] / plain[p]:.2f}"] for p in PARTS]
    print(setup)
    for line in _plot.format_table(head, rows):
        print(line)
    _plot.save_table("sparse_storage", setup, head, rows)


if __name__ == "__main__":
    main()
