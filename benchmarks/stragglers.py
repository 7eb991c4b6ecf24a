"""Parameter-server training with one straggler: sync, sync with backup workers, and async.

    python benchmarks/stragglers.py [--workers 4] [--slowdown 3] [--compute-ms 20] [--seconds 10]

Every worker's forward takes `--compute-ms` (a sleep: a step of a real model's length, which the
load on a shared machine does not stretch) and one worker's (the last rank's) `--slowdown` times
that; the model is a small MLP on random data, batch 32 per worker, SGD on one server, every
process one thread. Each worker trains for `--seconds` after a few untimed steps; worker 0 reads
the servers' counters (kv.stats) when its timed span begins and ends. Measured, each a figure over the
timed span and a ratio to plain sync without a straggler (the anchor, in the same run):

- updates/s: the updates the server applied: rounds in sync and with backup workers, pushes in
  async (each is its own update).
- samples/s: the samples whose gradients were applied (a late push dropped with backup workers
  does not count): pushes applied x batch.

Runs: sync without a straggler, then with one: sync, `dist_sync:backup_workers=1`, async.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import _jobs  # noqa: E402
import _plot  # noqa: E402

BATCH = 32
RESULT = re.compile(r"STRAGGLERBENCH rank=(\d+) steps=(\d+)(?: updates=(\d+) applied=(\d+) seconds=(\S+))?")


def role(args: argparse.Namespace) -> None:
    """One process of a job (this file again, as a paratrain job)."""
    import paratrain

    torch.set_num_threads(1)
    ctx = paratrain.init()
    slow = ctx.rank == ctx.num_workers - 1
    pause = args.compute_ms / 1000 * (args.slowdown if slow else 1.0)

    class Sleepy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(pause)
            return self.net(x)

    torch.manual_seed(ctx.rank)
    model = Sleepy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = paratrain.Trainer(model, optimizer, strategy=args.strategy, progress=False)
    x, y = torch.randn(BATCH, 64), torch.randint(0, 10, (BATCH,))

    def step() -> None:
        trainer.step(nn.functional.cross_entropy(trainer.model(x), y))

    for _ in range(args.warmup):
        step()
    # No barrier here: with backup workers a worker behind may be waiting for a round that the
    # others, at a barrier, would never push (docs/concepts/backup_workers.md). Each worker times its
    # own span; worker 0's counters measure the job over its span.
    before = counters(trainer) if ctx.rank == 0 else None
    start = time.monotonic()
    steps = 0
    while time.monotonic() - start < args.seconds:
        step()
        steps += 1
    line = f"STRAGGLERBENCH rank={ctx.rank} steps={steps}"
    if before is not None:  # read before the others leave the rounds (their spans end later)
        after, elapsed = counters(trainer), time.monotonic() - start
        updates, applied = (a - b for a, b in zip(after, before, strict=True))
        line += f" updates={updates} applied={applied} seconds={elapsed:.6f}"
    print(line, flush=True)
    trainer.close()


def counters(trainer) -> tuple[int, int]:  # noqa: ANN001
    """(updates applied, pushes applied) of the model's first key, as the servers count them."""
    stats = trainer.engine.kv.stats()
    first = stats[min(stats, key=str)]
    return first["version"], first["pushes"] - first.get("late", 0)


def job(args: argparse.Namespace, strategy: str, slowdown: float) -> tuple[float, float] | None:
    """(updates/s, samples/s) of one job, None where it failed; prints each worker's steps."""
    role_args = ["--paratrain-role", "--strategy", strategy, "--slowdown", str(slowdown)]
    role_args += ["--compute-ms", str(args.compute_ms), "--seconds", str(args.seconds)]
    role_args += ["--warmup", str(args.warmup)]
    found = _jobs.run_role_job(os.path.abspath(__file__), role_args, args.workers, 1, args.timeout, RESULT)
    if found is None:
        return None
    steps = {int(rank): int(n) for rank, n, *_ in found}
    print(f"  {strategy}, slowdown {slowdown:g}: steps per worker {[steps[r] for r in sorted(steps)]}")
    _, _, updates, applied, seconds = next(f for f in found if f[0] == "0")
    return int(updates) / float(seconds), int(applied) * BATCH / float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slowdown", type=float, default=3.0, help="the straggler's compute, x the others'")
    parser.add_argument("--compute-ms", type=float, default=20.0, help="every forward's time (a sleep)")
    parser.add_argument("--seconds", type=float, default=10.0, help="timed span of each job")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each; the median is shown")
    parser.add_argument("--timeout", type=float, default=300.0, help="limit per job (s)")
    parser.add_argument("--paratrain-role", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.workers < 2 or args.slowdown < 1 or args.seconds <= 0:
        parser.error("--workers must be >= 2, --slowdown >= 1 and --seconds > 0")
    if args.paratrain_role:
        role(args)
        return
    runs = {
        "sync, no straggler": ("dist_sync", 1.0),
        "sync": ("dist_sync", args.slowdown),
        "sync, backup_workers=1": ("dist_sync:backup_workers=1", args.slowdown),
        "async": ("dist_async", args.slowdown),
    }
    measured: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(args.rounds):  # rounds interleave the runs, so a busy spell hits all of them
        for name, (strategy, slowdown) in runs.items():
            result = job(args, strategy, slowdown)
            if result is not None:
                measured[name].append(result)
    setup = (
        f"{args.workers} workers, 1 server, MLP 64->128->10 with a {args.compute_ms:g} ms forward (a "
        f"sleep), the last worker's {args.slowdown:g}x; batch {BATCH} per worker, SGD, 1 thread each, "
        f"{os.cpu_count()} cores, torch {torch.__version__}; {args.seconds:g} s timed after "
        f"{args.warmup} steps, median of {args.rounds} round(s)"
    )
    print(setup)
    anchor = _medians(measured["sync, no straggler"])
    head, rows = ["run", "updates/s", "x anchor", "samples/s", "x anchor"], []
    for name, values in measured.items():
        got = _medians(values)
        if got is None or anchor is None:
            rows.append([name, "failed" if got is None else f"{got[0]:.1f}", "-", "-", "-"])
            continue
        rows.append(
            [name, f"{got[0]:.1f}", f"{got[0] / anchor[0]:.2f}", f"{got[1]:.0f}", f"{got[1] / anchor[1]:.2f}"]
        )
    for line in _plot.format_table(head, rows):
        print(line)
    print("anchor: sync without a straggler; samples/s counts only the gradients the server applied")
    _plot.save_table("stragglers", setup, head, rows)


def _medians(values: list[tuple[float, float]]) -> tuple[float, float] | None:
    if not values:
        return None
    return statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)


if __name__ == "__main__":
    main()
