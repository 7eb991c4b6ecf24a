"""Failures without loss, collective: how long an elastic all-reduce job stalls when a worker dies.

    python benchmarks/failures_collective.py [--heartbeat-timeout 3] [--workers 4]

W workers train a small MLP under `collective` (DDP) with JobConfig.elastic; at step 20 worker W-1 is
SIGKILLed. The survivors' all-reduce raises, they wait for the scheduler to drop the dead worker,
re-form the group, restore their commit and go on. The time to progress again is from the death to
the first step worker 0 completes after it, less one ordinary step; its ratio to the heartbeat
timeout is the figure (target <= 2x), beside the same job's ordinary step. A peer frozen rather than
killed (a lost host) keeps its connections open: the survivors then wait for the group's timeout,
max(60 s, 4 x heartbeat timeout), which is not measured here.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _plot  # noqa: E402
from failures import KILL_AT, STEPS, elastic_config, stall_s  # noqa: E402 (the same protocol and measure)


def paratrain_role(args: argparse.Namespace) -> None:
    """One worker's (or the scheduler's) part of the job."""
    import torch
    from torch import nn

    import paratrain

    ctx = paratrain.init(elastic_config(args.heartbeat_timeout))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = paratrain.Trainer(model, optimizer, strategy="collective", progress=False)
    victim = ctx.num_workers - 1
    x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))
    for step in range(STEPS):
        if ctx.rank == victim and step == KILL_AT:
            print(f"died {step} at {time.time():.6f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        trainer.step(nn.functional.cross_entropy(trainer.model(x), y))
        if ctx.rank == 0:
            print(f"step {step} at {time.time():.6f}", flush=True)
        time.sleep(0.02)
    trainer.close()


def run(args: argparse.Namespace) -> tuple[float, float] | None:
    """(stall, ordinary step) in seconds, or None if the job failed."""
    from failures import RESULT

    from paratrain.launch.engines.local.job import LocalJobConfig, run_local_job

    config = LocalJobConfig(
        script=__file__,
        args=("--paratrain-role", "--heartbeat-timeout", str(args.heartbeat_timeout)),
        num_workers=args.workers,
        num_servers=0,
        timeout_s=args.timeout,
        elastic=True,
    )
    out, err = io.StringIO(), io.StringIO()
    result = run_local_job(config, out=out, err=err)
    if result.exit_code != 0 or "died" not in out.getvalue():
        print("\n".join(err.getvalue().splitlines()[-30:]), file=sys.stderr)
        print("\n".join(out.getvalue().splitlines()[-30:]), file=sys.stderr)
        return None
    steps = sorted(float(m[3]) for m in RESULT.finditer(out.getvalue()) if m[1] == "step")
    gaps = sorted(b - a for a, b in zip(steps, steps[1:], strict=False))
    return stall_s(out.getvalue()), gaps[len(gaps) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0, help="JobConfig's (s)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=180.0, help="limit per job (s)")
    parser.add_argument("--paratrain-role", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.paratrain_role:
        paratrain_role(args)
        return
    title = (
        f"failures, collective: {args.workers} workers, DDP on a 256-256-10 MLP; worker "
        f"{args.workers - 1} SIGKILLed at step {KILL_AT}; heartbeat timeout {args.heartbeat_timeout} s; "
        "the anchor is that timeout"
    )
    head = ["what dies", "time to progress (s)", "/ heartbeat timeout", "<= 2x", "ordinary step (s)"]
    measured = run(args)
    if measured is None:
        rows = [["worker SIGKILL (collective)", "failed", "-", "-", "-"]]
    else:
        stall, step = measured
        ratio = stall / args.heartbeat_timeout
        rows = [
            [
                "worker SIGKILL (collective)",
                f"{stall:.2f}",
                f"{ratio:.2f}x",
                "yes" if ratio <= 2 else "NO",
                f"{step:.3f}",
            ]
        ]
    print(title)
    print("\n".join(_plot.format_table(head, rows)))
    _plot.save_table("failures_collective", title, head, rows)


if __name__ == "__main__":
    main()
