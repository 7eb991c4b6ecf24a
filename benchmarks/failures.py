"""Failures without loss: how long a job stalls when a process dies, against the heartbeat timeout.

    python benchmarks/failures.py [--heartbeat-timeout 3] [--workers 4]

Worker death (elastic workers, issue 15 item 1): W workers run dist_sync rounds on one server (a
pushpull of one small key per step); at step 20 worker W-1 dies, either by SIGKILL (its connections
close: the scheduler sees it at once) or frozen by SIGSTOP (a lost host: only its missing heartbeats
tell). The time to progress again is from the death to the first round worker 0 completes after it,
less one ordinary step; its ratio to the heartbeat timeout is the figure (target <= 2x). Each row is
a function returning table rows (`worker_death_rows`), so that other failure rows can join main().
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _plot  # noqa: E402

KILL_AT = 20
STEPS = 40
RESULT = re.compile(r"^\[worker 0\] (step|died) (\d+) at ([0-9.]+)$", re.M)
VICTIM = re.compile(r"^\[worker \d+\] died (\d+) at ([0-9.]+)$", re.M)


def elastic_config(timeout_s: float):  # noqa: ANN201 (paratrain is imported in the job only)
    """The jobs' config: elastic workers, heartbeats every timeout_s / 5."""
    import paratrain

    return paratrain.JobConfig(
        heartbeat_interval_s=timeout_s / 5,
        heartbeat_timeout_s=timeout_s,
        elastic=paratrain.ElasticConfig(min_workers=2),
    )


def paratrain_role(args: argparse.Namespace) -> None:
    """One worker's (or the scheduler's, the server's) part of the job."""
    import torch

    import paratrain

    ctx = paratrain.init(elastic_config(args.heartbeat_timeout))
    kv = paratrain.kvstore.create("dist_sync", ctx)
    pids = ctx.barrier(name="pids", data=os.getpid())
    kv.init("w", torch.zeros(1024))
    out, victim = torch.empty(1024), ctx.num_workers - 1
    for step in range(STEPS):
        if ctx.rank == victim and step == KILL_AT:
            print(f"died {step} at {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP if args.freeze else signal.SIGKILL)
        kv.pushpull("w", torch.ones(1024), out=out)
        if ctx.rank == 0:
            print(f"step {step} at {time.time():.6f}", flush=True)
            if args.freeze and step == KILL_AT:  # the frozen worker was dropped: end it for good
                os.kill(pids[victim], signal.SIGKILL)
        time.sleep(0.02)
    kv.close()


def stall_s(output: str) -> float:
    """Seconds from the death to worker 0's first round after it, less one ordinary step."""
    died = float(VICTIM.search(output)[2])
    steps = [float(m[3]) for m in RESULT.finditer(output) if m[1] == "step"]
    before = [t for t in steps if t < died]
    after = [t for t in steps if t > died]
    ordinary = statistics.median(b - a for a, b in zip(before, before[1:], strict=False))
    return max(0.0, after[0] - died - ordinary)


def run(args: argparse.Namespace, freeze: bool) -> float | None:
    from paratrain.launch.engines.local.job import LocalJobConfig, run_local_job

    role = ["--paratrain-role", "--heartbeat-timeout", str(args.heartbeat_timeout)]
    config = LocalJobConfig(
        script=__file__,
        args=tuple(role + (["--freeze"] if freeze else [])),
        num_workers=args.workers,
        num_servers=1,
        timeout_s=args.timeout,
        elastic=True,
    )
    import io

    out, err = io.StringIO(), io.StringIO()
    result = run_local_job(config, out=out, err=err)
    if result.exit_code != 0:
        print("\n".join(err.getvalue().splitlines()[-30:]), file=sys.stderr)
        return None
    return stall_s(out.getvalue())


def worker_death_rows(args: argparse.Namespace) -> list[list[str]]:
    """One row per way a worker dies: its stall and the stall's ratio to the heartbeat timeout."""
    rows = []
    for name, freeze in (("worker SIGKILL (connection closes)", False), ("worker frozen (SIGSTOP)", True)):
        stall = run(args, freeze)
        if stall is None:
            rows.append([name, "failed", "-", "-"])
            continue
        ratio = stall / args.heartbeat_timeout
        rows.append([name, f"{stall:.2f}", f"{ratio:.2f}x", "yes" if ratio <= 2 else "NO"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0, help="JobConfig's (s)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=180.0, help="limit per job (s)")
    parser.add_argument("--paratrain-role", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--freeze", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.paratrain_role:
        paratrain_role(args)
        return
    title = (
        f"failures: {args.workers} workers, 1 server, dist_sync, one small key per step; a worker dies "
        f"at step {KILL_AT}; heartbeat timeout {args.heartbeat_timeout} s; the anchor is that timeout"
    )
    head = ["what dies", "time to progress (s)", "/ heartbeat timeout", "<= 2x"]
    rows = worker_death_rows(args)
    print(title)
    print("\n".join(_plot.format_table(head, rows)))
    _plot.save_table("failures", title, head, rows)


if __name__ == "__main__":
    main()
