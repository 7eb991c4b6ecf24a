"""paratrain's pipelines: the measured bubble against (p-1)/(m+p-1), and a deep MLP in 2 stages
against one process, in one run.

    python benchmarks/pipeline.py [--steps 5] [--warmup 2] [--width 512] [--rows 32]

Bubble: a job of p workers (p = 2, 4; one thread each) runs a model of p equal blocks (each 4 x
Linear(width, width) + ReLU), one block per stage, with micro-batches of `rows` rows, under GPipe and
1F1B for m = 4, 8, 16 micro-batches. Each stage measures its bubble as 1 - compute time / wall time of
the step (StepStats.bubble_fraction: the time its forward, loss and backward ran, against the step's
wall time, waits for peers included); a figure is the mean over stages of each stage's median over
the timed steps. The ideal ignores communication and assumes equal stages.

Throughput: an MLP of `depth` blocks Linear(width, width) + ReLU trained by SGD on batches of `batch`
rows, in samples per second (median step). Anchors, in this process: the whole batch at once on 1
and on 2 threads, and on 1 thread the batch as m micro-batches whose gradients add up (the small
matrix products each pipeline stage runs, which are slower per row on a CPU). Then a 2-stage
pipeline of 2 processes with 1 thread each (the split balanced by measured time), GPipe and 1F1B.
The last column isolates what pipelining gains from what smaller micro-batches cost.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import _plot  # noqa: E402

RESULT = re.compile(r"PIPEBENCH (\S+)")
STAGES, MICRO_BATCHES, SCHEDULES = (2, 4), (4, 8, 16), ("gpipe", "1f1b")
THROUGHPUT_RUNS = (("gpipe", 8), ("1f1b", 8), ("1f1b", 4))


def mlp(blocks: int, layers_per_block: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)

    def block() -> nn.Sequential:
        return nn.Sequential(
            *[m for _ in range(layers_per_block) for m in (nn.Linear(width, width), nn.ReLU())]
        )

    return nn.Sequential(*[block() for _ in range(blocks)])


def timed_steps(step, warmup: int, steps: int) -> list[float]:  # noqa: ANN001
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def train_step(pipe, opt, x, y, after=None):  # noqa: ANN001, ANN201
    """One SGD step of the pipeline `pipe` on (x, y) as a function; `after()` runs after each."""

    def step() -> None:
        opt.zero_grad()
        pipe.step(x, y)
        opt.step()
        if after is not None:
            after()

    return step


# ------------------------------------------------------------------------------- job workers
def bubble_role(args: argparse.Namespace) -> None:
    """Each worker of a p-worker job: its stage's median bubble for every schedule and m."""
    import paratrain
    from paratrain.pipeline import PipelineConfig, pipeline_for

    ctx = paratrain.init()
    p = ctx.num_workers
    for schedule in SCHEDULES:
        for m in MICRO_BATCHES:
            config = PipelineConfig(p, m, schedule, split_points=tuple(range(1, p)))
            pipe = pipeline_for(mlp(p, 4, args.width), config, loss_fn=nn.functional.mse_loss, ctx=ctx)
            opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
            x, y = torch.randn(m * args.rows, args.width), torch.randn(m * args.rows, args.width)
            bubbles = []
            step = train_step(pipe, opt, x, y, lambda: bubbles.append(pipe.bubble_fraction))  # noqa: B023
            timed_steps(step, args.warmup, 0)
            bubbles.clear()
            timed_steps(step, 0, args.steps)
            print(
                f"PIPEBENCH bubble,{p},{schedule},{m},{pipe.stage},{statistics.median(bubbles)}", flush=True
            )


def throughput_role(args: argparse.Namespace) -> None:
    """Each worker of a 2-worker job: samples per second of the 2-stage MLP (printed by the last)."""
    import paratrain
    from paratrain.pipeline import PipelineConfig, pipeline_for

    ctx = paratrain.init()
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    for schedule, m in THROUGHPUT_RUNS:
        config = PipelineConfig(2, m, schedule)
        model = mlp(args.depth, 1, args.width)
        pipe = pipeline_for(model, config, loss_fn=nn.functional.mse_loss, sample_input=x[:32], ctx=ctx)
        opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        step = train_step(pipe, opt, x, y)
        times = timed_steps(step, args.warmup, args.steps)
        if pipe.is_last_stage:
            print(f"PIPEBENCH throughput,{schedule},{m},{args.batch / statistics.median(times)}", flush=True)


# ------------------------------------------------------------------------------- driver
def run_job(args: argparse.Namespace, role: str, workers: int) -> list[list[str]]:
    """The PIPEBENCH records the job's workers printed (comma-separated fields), [] if it failed."""
    from paratrain.launch.engines.local.job import LocalJobConfig, run_local_job

    role_args = [role, "--steps", str(args.steps), "--warmup", str(args.warmup), "--width", str(args.width)]
    role_args += ["--rows", str(args.rows), "--depth", str(args.depth), "--batch", str(args.batch)]
    config = LocalJobConfig(
        script=os.path.abspath(__file__), args=tuple(role_args), num_workers=workers, timeout_s=args.timeout
    )
    out, err = io.StringIO(), io.StringIO()
    result = run_local_job(config, out=out, err=err)
    if result.exit_code != 0:
        tail = "\n".join(err.getvalue().splitlines()[-40:])
        print(f"{role} job of {workers} workers failed:\n{tail}", file=sys.stderr)
        return []
    return [m[1].split(",") for m in RESULT.finditer(out.getvalue())]


def one_process(args: argparse.Namespace, threads: int, micro_batches: int = 1) -> float:
    """Samples per second of the whole MLP trained in this process on `threads` threads, each batch
    as `micro_batches` micro-batches whose gradients add up (what each stage of a pipeline computes on)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    model = mlp(args.depth, 1, args.width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)

    def step() -> None:
        opt.zero_grad()
        for xs, ys in zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches)):
            (nn.functional.mse_loss(model(xs), ys) * (len(xs) / len(x))).backward()
        opt.step()

    times = timed_steps(step, args.warmup, args.steps)
    torch.set_num_threads(before)
    return args.batch / statistics.median(times)


def print_bubbles(args: argparse.Namespace, records: list[list[str]]) -> None:
    from paratrain.pipeline import ideal_bubble

    by_config: dict[tuple[int, str, int], list[float]] = {}
    for _, p, schedule, m, _stage, bubble in records:
        by_config.setdefault((int(p), schedule, int(m)), []).append(float(bubble))
    print(
        f"bubble: p equal stages of 4 x Linear({args.width}, {args.width}) + ReLU, micro-batches of "
        f"{args.rows} rows, mean over stages of the median of {args.steps} steps"
    )
    rows = [["p", "m", "(p-1)/(m+p-1)", "gpipe measured", "1f1b measured"]]
    for p in STAGES:
        for m in MICRO_BATCHES:
            cells = []
            for schedule in SCHEDULES:
                values = by_config.get((p, schedule, m))
                cells.append(f"{statistics.fmean(values):.3f}" if values and len(values) == p else "failed")
            rows.append([str(p), str(m), f"{ideal_bubble(p, m):.3f}", *cells])
    print_rows(rows)
    _plot.save_table("pipeline-bubble", "bubble fraction per p stages, m micro-batches", rows[0], rows[1:], 2)
    if max(STAGES) > (os.cpu_count() or 1):
        print(f"(p > {os.cpu_count()} cores: a stage waiting for a CPU counts as bubble)")


def print_rows(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(" | ".join(text.rjust(width) for text, width in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", choices=("bubble", "throughput"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per figure")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--width", type=int, default=512, help="width of every Linear")
    parser.add_argument("--rows", type=int, default=32, help="rows per micro-batch (bubble)")
    parser.add_argument("--depth", type=int, default=16, help="Linear layers of the MLP (throughput)")
    parser.add_argument("--batch", type=int, default=256, help="batch rows (throughput)")
    parser.add_argument("--timeout", type=float, default=600.0, help="limit per job (s)")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    torch.set_num_threads(1)
    if args.role == "bubble":
        return bubble_role(args)
    if args.role == "throughput":
        return throughput_role(args)
    print(f"{os.cpu_count()} cores, torch {torch.__version__}, one thread per process unless said\n")
    records = [r for p in STAGES for r in run_job(args, "bubble", p)]
    print_bubbles(args, records)
    whole = {threads: one_process(args, threads) for threads in (1, 2)}
    split = {m: one_process(args, 1, m) for m in sorted({m for _, m in THROUGHPUT_RUNS})}
    piped = {(s, int(m)): float(v) for _, s, m, v in run_job(args, "throughput", 2)}
    print(
        f"\nthroughput: MLP of {args.depth} x Linear({args.width}, {args.width}) + ReLU, SGD, batches of "
        f"{args.batch} rows, median of {args.steps} steps"
    )
    rows = [["run", "processes x threads", "samples/s", "vs 1 x 1 whole", "vs 1 x 1 same micro-batches"]]
    runs = [("one process, whole batch", "1 x 1", whole[1], None)]
    runs += [("one process, whole batch", "1 x 2", whole[2], None)]
    runs += [(f"one process, m={m}", "1 x 1", value, value) for m, value in split.items()]
    runs += [(f"2 stages, {s}, m={m}", "2 x 1", piped.get((s, m)), split[m]) for s, m in THROUGHPUT_RUNS]
    for name, shape, value, same in runs:
        cells = ["failed", "-", "-"]
        if value:
            cells = [f"{value:.0f}", f"{value / whole[1]:.2f}", f"{value / same:.2f}" if same else "-"]
        rows.append([name, shape, *cells])
    print_rows(rows)
    _plot.save_table(
        "pipeline-throughput", f"MLP of {args.depth} x Linear({args.width})", rows[0], rows[1:], 2
    )


if __name__ == "__main__":
    main()
