"""The step time a background (async) sharded checkpoint hides, under fsdp.

    python benchmarks/checkpoint.py [--mb 50] [--workers 2] [--steps 8] [--every 2]

The model: `layers` square Linear layers holding about `mb` MB of fp32 parameters, AdamW (a
checkpoint holds them three times: weights and Adam's two moments), a batch of 8 rows per worker.
Three fsdp jobs, each timing `steps` optimizer steps after a first one: no checkpoints; a checkpoint
every `every` steps written before the step returns (Trainer(async_checkpoints=False)); the same
written in the background (the default: DCP's async_save, committed once written). The time hidden
per checkpoint is (sync - async) x every; what async still costs is the copy of the state to CPU
memory that async_save takes before returning. Figures of a quiet machine: take them with nothing
else running.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import _jobs  # noqa: E402
import _plot  # noqa: E402

RESULT = re.compile(r"CKPTBENCH rank=(\d+) step_ms=([0-9.]+)")
RUNS = {"none": None, "sync": False, "async": True}
"""Run name -> Trainer(async_checkpoints=...), None: no checkpoints."""


def paratrain_role(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    import paratrain

    ctx = paratrain.init()
    torch.manual_seed(0)
    width = max(8, int((args.mb * 1e6 / 4 / args.layers) ** 0.5))
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(args.layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    background = RUNS[args.run]
    folder = args.folder if background is not None else None
    trainer = paratrain.Trainer(
        model,
        optimizer,
        strategy="fsdp",
        progress=False,
        checkpoint_dir=folder,
        checkpoint_every=args.every if folder else None,
        async_checkpoints=bool(background),
    )
    x = torch.randn(8, width)
    trainer.step(trainer.model(x).square().mean())  # optimizer state exists from here on
    ctx.barrier(name="measure")
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.step(trainer.model(x).square().mean())
    trainer.close()  # waits for the last write: its time counts
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    print(f"CKPTBENCH rank={ctx.rank} step_ms={step_ms:.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0, help="MB of fp32 parameters")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="measured optimizer steps")
    parser.add_argument("--every", type=int, default=2, help="a checkpoint every this many steps")
    parser.add_argument("--timeout", type=float, default=600.0, help="limit per job (s)")
    parser.add_argument("--paratrain-role", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run", choices=list(RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.paratrain_role:
        paratrain_role(args)
        return
    times = {}
    for run in RUNS:
        with tempfile.TemporaryDirectory(prefix="ckptbench-") as folder:
            role = ["--paratrain-role", "--run", run, "--folder", folder, "--mb", str(args.mb)]
            role += ["--layers", str(args.layers), "--steps", str(args.steps), "--every", str(args.every)]
            found = _jobs.run_role_job(os.path.abspath(__file__), role, args.workers, 0, args.timeout, RESULT)
        times[run] = max(float(f[1]) for f in found) if found else None
    title = (
        f"fsdp, {args.workers} workers, {args.mb:g} MB of parameters with AdamW, a checkpoint every "
        f"{args.every} steps, ms per step (slowest worker)"
    )
    head = ["checkpoints", "ms/step"]
    rows = [[run, f"{ms:.1f}" if ms is not None else "failed"] for run, ms in times.items()]
    sync, background = times["sync"], times["async"]
    if sync is not None and background is not None:
        rows.append(["hidden per checkpoint", f"{(sync - background) * args.every:.1f}"])
    print(title)
    print("\n".join(_plot.format_table(head, rows)))
    _plot.save_table("checkpoint", title, head, rows)


if __name__ == "__main__":
    main()
