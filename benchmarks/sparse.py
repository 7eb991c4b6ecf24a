"""paratrain's sparse tables against torch.nn.Embedding and a torch RPC parameter server, in one run.

    python benchmarks/sparse.py [--iters 600] [--warmup 20] [--rows 1000000] [--dim 16] [--rounds 5]

Setup: a table of `rows` x `dim` float32 (ids 0..rows-1, all rows created before timing), 2 workers and
2 servers on loopback; each worker draws batches of 1024 x 26 ids from a Zipf(exponent) law over the
rows (about 8,800 unique ids a batch at the defaults). One step: dedup the batch's ids, pull the
unique rows, form their gradients (a fixed upstream gradient per lookup, summed per row) and push
them; the servers apply them with Adagrad. Compared, in this run:

- paratrain: `kv.tables.dedup/pull/push` (what DistributedEmbedding does each step) on a
  "dist_sync" and a "dist_async" store (this file again, as a job, in its --paratrain-role mode). As
  in DistributedEmbedding, a step waits for the last step's push once its own pull is sent (the
  server reads that pull after the push): in async a push is acknowledged once applied, in sync
  once it joined its round, and the pull waits until that round was applied;
- torch.nn.Embedding(sparse=True) + torch.optim.Adagrad in one process: the same lookups and updates;
- a torch.distributed.rpc parameter server: each server holds its rows (id % 2) and their Adagrad
  sums as two tensors; a worker calls pull, then push, on each server (pushes are applied on arrival
  and acknowledged; the worker waits for the acknowledgements before its next pull).

Figures: steps/s per worker (timed steps / seconds, the slowest worker) and rows/s per server: unique
rows per step x steps/s, summed over workers, divided by servers (a row counts once though it moves
twice). For the one-process anchor, its own steps/s and rows/s. The paratrain jobs run --rounds
times each, sync and async in turns: the table shows the median run of each, and the last line
dist_sync against dist_async, the median of the rounds' ratios with their spread (min-max, and of
sync's rows/s too).

Each async round also gives a lockstep ceiling: what a sync round could reach at best if it cost
nothing but its barrier. In a sync round every worker waits for the slowest worker's push, so a sync
step takes at least the longest of the workers' steps, while an async worker only pays for its own.
Each worker prints its step times' quantiles; the ceiling is the slowest worker's mean async step
against the expected longest step when each worker draws its step from its own async step times,
independently (every pair of quantiles, one from each worker). A model, not a bound: it shows how
much of the sync/async gap the steps' spread alone accounts for (on a machine with fewer cores than
the job has busy processes the spread is large: the scheduler decides when each step runs).

The last line splits the gap in two: the CPU that all the job's processes (scheduler, servers,
workers, every thread) spent per timed step, which worker 0 reads from /proc before and after its
timed steps, and the cores they kept busy meanwhile (that CPU over the wall time). Extra work in
sync shows in the first, its phases taking turns (cores idle while the workers wait for a round) in
the second.

Why 5 rounds of 600 steps by default (until stop 18: 1 round of 300): on an idle 2-core machine one
round's sync/async ratio ranged from 0.62 to 1.32 with 150-step windows (about 0.8 s) and still from
0.75 to 1.08 with 400-step ones, so one round, or the median of three, did not tell on which side of
0.9 a change is. Longer windows narrow a round's spread, and the median of five rounds, shown with
its spread, is what a change is judged by; the run takes 4.5 minutes at load 5 to 8 on 2 cores.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed import rpc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import _anchors  # noqa: E402
import _jobs  # noqa: E402
import _plot  # noqa: E402

RESULT = re.compile(
    r"SPARSEBENCH rank=(\d+) steps_per_s=([0-9.eE+-]+) unique=([0-9.]+) step_ms_quantiles=([0-9.,]+)"
    r" job_cpu_s=([0-9.]+|none) wall_s=([0-9.]+)"
)
QUANTILES = 50  # a worker's step times, printed as the cut points of 50 equal parts
NUM_WORKERS, NUM_SERVERS, BATCH, FIELDS = 2, 2, 1024, 26


def batches(args: argparse.Namespace, rank: int) -> list[torch.Tensor]:
    """The batches of one worker: ids 0..rows-1 drawn by a Zipf law, scattered so that popular ids
    are not neighbours (as hashed features are not)."""
    from paratrain.data.criteo import zipf_ranks

    g = torch.Generator().manual_seed(1000 + rank)
    count = args.warmup + args.iters
    ranks = zipf_ranks(count * BATCH * FIELDS, args.rows, args.exponent, g) - 1
    scatter = torch.randperm(args.rows, generator=torch.Generator().manual_seed(7))
    return list(scatter[ranks].reshape(count, BATCH * FIELDS))


def upstream(args: argparse.Namespace) -> torch.Tensor:
    return torch.full((BATCH * FIELDS, args.dim), 1e-3)


def row_grads(grad: torch.Tensor, inverse: torch.Tensor, unique: int) -> torch.Tensor:
    return torch.zeros(unique, grad.shape[1]).index_add_(0, inverse, grad)


def rate(per_step_s: float) -> float:
    return 1.0 / per_step_s


class JobRun(NamedTuple):
    """One paratrain job's figures."""

    steps_per_s: float  # of the slowest worker
    unique: float  # mean unique ids a step
    ceiling: float  # the lockstep ceiling of its step times (module docstring)
    cpu_ms: float | None  # CPU of all the job's processes per timed step; None: /proc did not tell
    busy: float | None  # cores those processes kept busy over the timed steps (CPU / wall)


def job_cpu_s() -> float | None:
    """CPU seconds used so far by every process of this job: the launcher's children (this worker
    among them), their ended threads included. None where /proc does not tell (not Linux)."""
    try:
        parent = f"/proc/{os.getppid()}/task"
        children = [c for t in os.listdir(parent) for c in Path(f"{parent}/{t}/children").read_text().split()]
        ticks = 0
        for pid in children:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime and stime, in clock ticks
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# ------------------------------------------------------------------------------- paratrain
def paratrain_role(args: argparse.Namespace) -> None:
    import paratrain
    import paratrain.kvstore
    from paratrain.kvstore import TableConfig

    torch.set_num_threads(1)
    ctx = paratrain.init()
    kv = paratrain.kvstore.create(args.kind)
    kv.init_table("emb", args.dim, TableConfig(reserve_rows=args.rows // NUM_SERVERS + 4096))
    kv.set_table_optimizer("emb", torch.optim.Adagrad, lr=0.01)
    tables, grad = kv.tables, upstream(args)
    every = torch.arange(ctx.rank, args.rows, NUM_WORKERS)  # create every row before timing
    for part in every.split(65536):
        handle, _ = tables.pull("emb", tables.route(part), True)
        handle.wait()
    kv.barrier()
    mine = batches(args, ctx.rank)
    uniques, pushes, starts = [], [], []

    def step(ids: torch.Tensor) -> None:
        starts.append(time.perf_counter())
        route, where = tables.dedup(ids)
        handle, rows = tables.pull("emb", route, True)
        finish()  # the last step's push, once this pull is sent (as DistributedEmbedding.forward)
        handle.wait()
        pushes.append(tables.push("emb", route, row_grads(grad, where, len(route.ids))))
        uniques.append(len(route.ids))

    def finish() -> None:
        while pushes:
            pushes.pop().wait()

    cpu: list[float | None] = []

    def before_timing() -> None:
        kv.barrier()
        cpu.append(job_cpu_s())

    seconds = timed(step, mine, args.warmup, before_timing, finish)
    cpu.append(job_cpu_s())
    start, end = cpu
    job_cpu = None if start is None or end is None else end - start
    timed_starts = starts[args.warmup :]
    steps_ms = [1e3 * (b - a) for a, b in itertools.pairwise(timed_starts)] or [1e3 * seconds]
    cuts = statistics.quantiles(steps_ms, n=QUANTILES) if len(steps_ms) > 1 else steps_ms
    print(
        f"SPARSEBENCH rank={ctx.rank} steps_per_s={args.iters / seconds:.3f} "
        f"unique={sum(uniques) / len(uniques):.1f} step_ms_quantiles={','.join(f'{c:.4f}' for c in cuts)} "
        f"job_cpu_s={'none' if job_cpu is None else f'{job_cpu:.3f}'} wall_s={seconds:.4f}",
        flush=True,
    )


def timed(
    step: Any, inputs: list[torch.Tensor], warmup: int, before_timing: Any = None, finish: Any = None
) -> float:
    """Seconds for the steps after the first `warmup` ones; `finish` waits for what the last step
    left under way (before the clock starts and before it stops)."""
    for ids in inputs[:warmup]:
        step(ids)
    if finish is not None:
        finish()
    if before_timing is not None:
        before_timing()
    start = time.perf_counter()
    for ids in inputs[warmup:]:
        step(ids)
    if finish is not None:
        finish()
    return time.perf_counter() - start


def paratrain_job(args: argparse.Namespace, kind: str) -> JobRun | str:
    """The job's figures, or why there are none. Its CPU and busy cores are as worker 0 saw them
    over its timed steps."""
    role_args = ["--paratrain-role", "--kind", kind, "--rows", str(args.rows), "--dim", str(args.dim)]
    role_args += ["--warmup", str(args.warmup), "--iters", str(args.iters), "--exponent", str(args.exponent)]
    script = os.path.abspath(__file__)
    found = _jobs.run_role_job(script, role_args, NUM_WORKERS, NUM_SERVERS, args.timeout, RESULT)
    if found is None:
        return "failed"
    spreads = [[float(c) for c in f[3].split(",")] for f in found]
    unique = sum(float(f[2]) for f in found) / len(found)
    first = min(found, key=lambda f: int(f[0]))
    cpu_ms = busy = None
    if first[4] != "none":
        cpu_ms, busy = 1e3 * float(first[4]) / args.iters, float(first[4]) / float(first[5])
    return JobRun(min(float(f[1]) for f in found), unique, lockstep_ceiling(spreads), cpu_ms, busy)


def lockstep_ceiling(spreads: list[list[float]]) -> float:
    """The slowest worker's mean step over the expected longest step of the workers, each drawn
    independently from its own step times (given as equally likely quantiles); see the module's
    docstring. 1.0 where the steps do not vary."""
    slowest = max(statistics.fmean(s) for s in spreads)
    longest = statistics.fmean(max(draw) for draw in itertools.product(*spreads))
    return slowest / longest


# ------------------------------------------------------------------------------- torch.nn, one process
def torch_embedding(args: argparse.Namespace) -> tuple[float, float]:
    torch.set_num_threads(1)
    emb = torch.nn.Embedding(args.rows, args.dim, sparse=True)
    optimizer = torch.optim.Adagrad(emb.parameters(), lr=0.01)
    grad, inputs = upstream(args), batches(args, 0)
    uniques = [len(torch.unique(ids)) for ids in inputs[args.warmup :]]

    def step(ids: torch.Tensor) -> None:
        optimizer.zero_grad()
        emb(ids).backward(grad)
        optimizer.step()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse invariant checks: torch's own notice
        seconds = timed(step, inputs, args.warmup)
    return args.iters / seconds, sum(uniques) / len(uniques)


# ------------------------------------------------------------------------------- rpc parameter server
class _Table:
    """One RPC server's rows (ids with id % servers == rank, at id // servers) and Adagrad sums."""

    def __init__(self, rows: int, dim: int) -> None:
        self.value = torch.randn(rows, dim) * 0.01
        self.sum = torch.zeros(rows, dim)
        self.lock = threading.Lock()  # RPC runs calls on several threads: one update at a time


_table: _Table | None = None


def _rpc_pull(local: torch.Tensor) -> torch.Tensor:
    assert _table is not None
    return _table.value.index_select(0, local)


def _rpc_push(local: torch.Tensor, grads: torch.Tensor) -> bool:
    assert _table is not None
    with _table.lock:
        _apply(_table, local, grads)
    return True


def _apply(table: _Table, local: torch.Tensor, grads: torch.Tensor) -> None:
    total = table.sum.index_select(0, local).add_(grads.pow(2))
    table.sum.index_copy_(0, local, total)
    update = grads / total.sqrt_().add_(1e-10)
    table.value.index_copy_(0, local, table.value.index_select(0, local).sub_(update, alpha=0.01))


def rpc_process(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    global _table
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    name = f"worker{rank}" if rank < NUM_WORKERS else f"server{rank - NUM_WORKERS}"
    if rank >= NUM_WORKERS:
        _table = _Table(args.rows // NUM_SERVERS + 1, args.dim)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=300, num_worker_threads=8
    )
    rpc.init_rpc(name, rank=rank, world_size=NUM_WORKERS + NUM_SERVERS, rpc_backend_options=options)
    if rank < NUM_WORKERS:
        grad = upstream(args)

        def step(ids: torch.Tensor) -> None:
            unique, inverse = torch.unique(ids, return_inverse=True)
            server = unique % NUM_SERVERS
            order = torch.argsort(server, stable=True)
            counts = torch.bincount(server, minlength=NUM_SERVERS).tolist()
            parts = (unique[order] // NUM_SERVERS).split(counts)
            pulls = [rpc.rpc_async(f"server{s}", _rpc_pull, args=(p,)) for s, p in enumerate(parts)]
            torch.cat([f.wait() for f in pulls])  # the rows, in `order`
            where = torch.empty_like(order)
            where[order] = torch.arange(len(order))
            grads = row_grads(grad, where[inverse], len(unique)).split(counts)
            pushes = [
                rpc.rpc_async(f"server{s}", _rpc_push, args=(p, g))
                for s, (p, g) in enumerate(zip(parts, grads))
            ]
            torch.futures.wait_all(pushes)

        results.put(args.iters / timed(step, batches(args, rank), args.warmup))
    rpc.shutdown()


def rpc_ps(args: argparse.Namespace) -> float:
    port = _anchors.free_port()
    with _anchors.Children(args.timeout) as kids:
        for rank in range(NUM_WORKERS + NUM_SERVERS):
            kids.start(f"rpc rank {rank}", rpc_process, rank, port, args)
        return min(kids.collect(NUM_WORKERS))


# ------------------------------------------------------------------------------- driver
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=600, help="timed steps per worker")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows in the table")
    parser.add_argument("--dim", type=int, default=16, help="values per row")
    parser.add_argument("--exponent", type=float, default=1.1, help="of the Zipf law of the ids")
    parser.add_argument("--timeout", type=float, default=300.0, help="limit per measurement (s)")
    parser.add_argument("--rounds", type=int, default=5, help="paratrain sync and async jobs, in turns")
    parser.add_argument("--paratrain-role", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="dist_sync", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.iters < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--iters and --rounds must be >= 1 and --warmup >= 0")
    if args.paratrain_role:
        paratrain_role(args)
        return
    nn_result = _anchors.attempt("torch.nn.Embedding", torch_embedding, args)
    unique = nn_result[1] if isinstance(nn_result, tuple) else float("nan")
    rows = {"torch.nn.Embedding + sparse Adagrad, 1 process": (nn_result, 1, 1)}
    rpc_result = _anchors.attempt("rpc PS", rpc_ps, args)
    rows["torch.distributed.rpc PS (tensors)"] = (
        (rpc_result, unique) if isinstance(rpc_result, float) else rpc_result,
        NUM_WORKERS,
        NUM_SERVERS,
    )
    runs: dict[str, list[JobRun]] = {"dist_sync": [], "dist_async": []}
    for _ in range(args.rounds):  # taking turns: a slower minute of the machine hits both
        for kind, done in runs.items():
            result = paratrain_job(args, kind)
            if isinstance(result, JobRun):
                done.append(result)
    for kind, done in runs.items():
        run = median_run(done) if done else None
        figures = (run.steps_per_s, run.unique) if run else "failed"
        rows[f"paratrain {kind}"] = (figures, NUM_WORKERS, NUM_SERVERS)
    print_table(args, unique, rows)
    print_target(runs)


def median_run(done: list[JobRun]) -> JobRun:
    """The run of median steps/s."""
    return sorted(done, key=lambda run: run.steps_per_s)[len(done) // 2]


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def print_target(runs: dict[str, list[JobRun]]) -> None:
    """dist_sync against dist_async, the median of the rounds, with their spread (issue target:
    >= 0.9x, and >= 1M rows/s); then the async rounds' lockstep ceilings, and each kind's CPU per
    step and busy cores."""
    per_server = {
        k: [r.unique * r.steps_per_s * NUM_WORKERS / NUM_SERVERS for r in done] for k, done in runs.items()
    }
    pairs = [a / b for a, b in zip(per_server["dist_sync"], per_server["dist_async"])]
    if not pairs:
        return
    syncs = per_server["dist_sync"]
    ratio, sync = median(pairs), median(syncs)
    met = "met" if ratio >= 0.9 and sync >= 1e6 else "NOT met"
    rounds = ", ".join(f"{p:.2f}" for p in pairs)
    print(
        f"target (dist_sync >= 0.9x dist_async and >= 1,000,000 rows/s per server): {met} "
        f"(sync/async {ratio:.2f}, the median of the rounds' {rounds}, spread {min(pairs):.2f}-"
        f"{max(pairs):.2f}; sync {sync:,.0f} rows/s per server, spread {min(syncs):,.0f}-{max(syncs):,.0f})"
    )
    ceilings = [r.ceiling for r in runs["dist_async"]]
    print(
        f"lockstep ceiling from the async steps' spread (what a sync round costing only its barrier could "
        f"reach): {median(ceilings):.2f}, the median of the rounds' {', '.join(f'{c:.2f}' for c in ceilings)}"
    )
    work = []
    for kind, done in runs.items():
        cpus = [r.cpu_ms for r in done if r.cpu_ms is not None]
        busies = [r.busy for r in done if r.busy is not None]
        if cpus and busies:
            cores = f"{median(busies):.2f} of {os.cpu_count()} cores busy"
            work.append(f"{kind} {median(cpus):.2f} ms a step, {cores}")
    if work:
        print("CPU of the job's processes in the timed steps (medians of the rounds): " + "; ".join(work))


def print_table(args: argparse.Namespace, unique: float, rows: dict[str, tuple]) -> None:
    rpc_rate = None
    table = [["", "steps/s per worker", "rows/s per server", "vs rpc PS"]]
    figures = {}
    for name, (result, workers, servers) in rows.items():
        if not isinstance(result, tuple):
            figures[name] = None
            table.append([name, str(result), "-", "-"])
            continue
        steps, mean_unique = result
        per_server = mean_unique * steps * workers / servers
        figures[name] = per_server
        if name.startswith("torch.distributed.rpc"):
            rpc_rate = per_server
        table.append([name, f"{steps:.1f}", f"{per_server:,.0f}", ""])
    for line, name in zip(table[1:], rows, strict=True):
        if figures[name] is not None and rpc_rate:
            line[3] = f"{figures[name] / rpc_rate:.2f}"
    setup = (
        f"{args.rows:,} x {args.dim} float32 table, {NUM_WORKERS} workers, {NUM_SERVERS} servers, loopback, "
        f"batches {BATCH} x {FIELDS} ids, Zipf({args.exponent}), ~{unique:,.0f} unique ids a batch, "
        f"Adagrad on the servers; {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.iters} timed steps after {args.warmup}"
    )
    print(setup)
    _plot.save_table("sparse", setup, ["run", *table[0][1:]], table[1:])
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    for line in table:
        print(
            " | ".join(
                [line[0].ljust(widths[0])] + [t.rjust(w) for t, w in zip(line[1:], widths[1:], strict=True)]
            )
        )


if __name__ == "__main__":
    main()
