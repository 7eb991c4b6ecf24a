"""Training throughput of paratrain's strategies beside torch DDP and a torch RPC parameter server.

    python benchmarks/train.py [--iters 150] [--warmup 10] [--rounds 3] [--plot train.png]
                               [--precision bf16]

The model: conv 3->32, conv 32->64 (3x3, each followed by ReLU and 2x2 max-pooling), fc 4096->256->10,
on 3x32x32 inputs, batch 64 per worker, SGD with momentum. Every process uses one thread (2 workers
on 2 cores). Measured in one run, each a figure of samples/s over all workers (the slowest worker's
elapsed time for `iters` steps after `warmup` untimed ones), the median of `rounds` interleaved runs:

- 1 process: the plain torch loop.
- torch DDP: DistributedDataParallel on Gloo, 2 processes (the anchor).
- torch RPC PS: a synchronous parameter server on torch.distributed.rpc; each worker sends its
  gradients, the server averages both, steps, and replies to both with the new weights.
- paratrain collective, ps sync, ps async: 2 workers through paratrain.Trainer (and 1 server for ps),
  launched as a paratrain job (this file again, in --paratrain-role mode).
- paratrain ps sync + dashboard: the same ps sync job with the live dashboard on, its /api/state and
  /metrics read every second while it runs (an open tab and a Prometheus scrape): the dashboard's
  cost is its ratio to "paratrain ps sync" (interleaved in the same rounds).

`--precision bf16` runs every forward under torch.autocast in bfloat16 (the paratrain jobs through
Strategy.precision, the torch runs with autocast around their forward), weights and optimizer in
fp32: the ratios against DDP with mixed precision on.

`--runs` picks some of them (comma-separated names) for more rounds of a narrower comparison. The
table and a plot of it are saved under runs/bench/ (benchmarks/_plot.py).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import threading
import time
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed import rpc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import _anchors  # noqa: E402
import _jobs  # noqa: E402
import _plot  # noqa: E402

BATCH = 64
WORKERS = 2
RESULT = re.compile(r"TRAINBENCH rank=(\d+) seconds=([0-9.eE+-]+) steps=(\d+)")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(4096, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def timed(step: Any, warmup: int, iters: int, before_timing: Any = None) -> float:
    """Seconds for `iters` steps after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    if before_timing is not None:
        before_timing()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    return time.perf_counter() - start


PRECISION = os.environ.get("TRAINBENCH_PRECISION", "32")
"""32 or bf16: --precision, which main() also puts in the environment that spawned runs read."""


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's output, under bf16 autocast with --precision bf16 (as the Trainer runs it)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=PRECISION == "bf16"):
        return model(x).float()


def plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer.zero_grad()
    nn.functional.cross_entropy(forward(model, x), y).backward()
    optimizer.step()


# ------------------------------------------------------------------------------- 1 process, DDP
def single(warmup: int, iters: int) -> float:
    model = make_model()
    optimizer, (x, y) = make_optimizer(model), batch(0)
    return timed(lambda: plain_step(model, optimizer, x, y), warmup, iters)


def ddp_process(rank: int, port: int, warmup: int, iters: int, results: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS)
    model = nn.parallel.DistributedDataParallel(make_model())
    optimizer, (x, y) = make_optimizer(model), batch(rank)
    results.put(timed(lambda: plain_step(model, optimizer, x, y), warmup, iters, dist.barrier))
    dist.destroy_process_group()


def ddp(warmup: int, iters: int, timeout_s: float) -> float:
    port = _anchors.free_port()
    with _anchors.Children(timeout_s) as kids:
        for rank in range(WORKERS):
            kids.start(f"ddp rank {rank}", ddp_process, rank, port, warmup, iters)
        return max(kids.collect(WORKERS))


# ------------------------------------------------------------------------------- torch RPC PS
class _Server:
    """The parameter server's state: the model, its optimizer, and the round being gathered."""

    def __init__(self) -> None:
        self.model = make_model()
        self.optimizer = make_optimizer(self.model)
        self.lock = threading.Lock()
        self.grads: list[torch.Tensor] | None = None
        self.arrived = 0
        self.future: torch.futures.Future = torch.futures.Future()


_server: _Server | None = None


@rpc.functions.async_execution
def _rpc_step(grads: list[torch.Tensor]) -> torch.futures.Future:
    state, done = _server, None
    assert state is not None
    with state.lock:
        if state.grads is None:
            state.grads = grads
        else:
            for acc, g in zip(state.grads, grads, strict=True):
                acc.add_(g)
        state.arrived += 1
        future = state.future
        if state.arrived == WORKERS:
            for p, g in zip(state.model.parameters(), state.grads, strict=True):
                p.grad = g.div_(WORKERS)
            state.optimizer.step()
            done = future
            weights = [p.detach().clone() for p in state.model.parameters()]
            state.grads, state.arrived, state.future = None, 0, torch.futures.Future()
    if done is not None:
        done.set_result(weights)
    return future


def rpc_process(rank: int, port: int, warmup: int, iters: int, results: Any) -> None:
    global _server
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    if rank == WORKERS:
        _server = _Server()
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=300)
    name = "server" if rank == WORKERS else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=WORKERS + 1, rpc_backend_options=options)
    if rank < WORKERS:
        model = make_model()
        x, y = batch(rank)
        params = list(model.parameters())

        def step() -> None:
            model.zero_grad()
            nn.functional.cross_entropy(forward(model, x), y).backward()
            weights = rpc.rpc_sync("server", _rpc_step, args=([p.grad for p in params],))
            with torch.no_grad():
                for p, w in zip(params, weights, strict=True):
                    p.copy_(w)

        results.put(timed(step, warmup, iters))
    rpc.shutdown()


def rpc_ps(warmup: int, iters: int, timeout_s: float) -> float:
    port = _anchors.free_port()
    with _anchors.Children(timeout_s) as kids:
        for rank in range(WORKERS + 1):
            kids.start(f"rpc rank {rank}", rpc_process, rank, port, warmup, iters)
        return max(kids.collect(WORKERS))


# ------------------------------------------------------------------------------- paratrain
def paratrain_role(args: argparse.Namespace) -> None:
    import paratrain

    torch.set_num_threads(1)
    ctx = paratrain.init()  # servers and the scheduler serve here and exit
    model = make_model()
    strategy = paratrain.Strategy.parse(args.strategy).replace(precision=PRECISION)
    trainer = paratrain.Trainer(model, make_optimizer(model), strategy=strategy, progress=False)
    x, y = batch(ctx.rank)

    def step() -> None:
        trainer.step(nn.functional.cross_entropy(trainer.model(x), y))

    seconds = timed(step, args.warmup, args.iters, lambda: ctx.barrier(name="timing"))
    print(f"TRAINBENCH rank={ctx.rank} seconds={seconds:.6f} steps={trainer.steps}", flush=True)
    trainer.close()


def paratrain_job(
    args: argparse.Namespace, strategy: str, servers: int, dashboard: bool = False
) -> float | str:
    role_args = ["--paratrain-role", "--strategy", strategy, "--warmup", str(args.warmup)]
    role_args += ["--iters", str(args.iters), "--precision", args.precision]
    found = _jobs.run_role_job(
        os.path.abspath(__file__), role_args, WORKERS, servers, args.timeout, RESULT, dashboard=dashboard
    )
    return "failed" if found is None else max(float(seconds) for _, seconds, _ in found)


# ------------------------------------------------------------------------------- driver
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=150, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each; the median is shown")
    parser.add_argument("--timeout", type=float, default=300.0, help="limit per measurement (s)")
    parser.add_argument("--plot", metavar="PATH", help="also save a bar chart (needs matplotlib)")
    parser.add_argument(
        "--runs", help="only these runs (comma-separated names), e.g. for the dashboard's cost"
    )
    parser.add_argument(
        "--precision", choices=("32", "bf16"), default="32", help="bf16: every forward under autocast"
    )
    parser.add_argument("--paratrain-role", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    global PRECISION
    PRECISION = os.environ["TRAINBENCH_PRECISION"] = args.precision  # spawned runs inherit it
    if args.paratrain_role:
        paratrain_role(args)
        return
    torch.set_num_threads(1)
    steps = (args.warmup, args.iters)
    runs: dict[str, tuple[int, Any]] = {
        "1 process": (1, lambda: single(*steps)),
        "torch DDP (gloo)": (WORKERS, lambda: ddp(*steps, args.timeout)),
        "torch RPC PS": (WORKERS, lambda: rpc_ps(*steps, args.timeout)),
        "paratrain collective": (WORKERS, lambda: paratrain_job(args, "collective", 0)),
        "paratrain ps sync": (WORKERS, lambda: paratrain_job(args, "dist_sync", 1)),
        "paratrain ps async": (WORKERS, lambda: paratrain_job(args, "dist_async", 1)),
        "paratrain ps sync + dashboard": (
            WORKERS,
            lambda: paratrain_job(args, "dist_sync", 1, dashboard=True),
        ),
    }
    if args.runs:
        wanted = [name.strip() for name in args.runs.split(",")]
        unknown = [name for name in wanted if name not in runs]
        if unknown:
            parser.error(f"--runs: unknown {unknown}; the runs are {list(runs)}")
        runs = {name: runs[name] for name in wanted}
    measured: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):  # rounds interleave the runs, so a busy spell hits all of them
        for name, (workers, run) in runs.items():
            try:
                seconds = run()
            except Exception as exc:  # one broken run must not hide the others
                print(f"{name} failed: {exc!r}", file=sys.stderr)
                continue
            if isinstance(seconds, float):
                measured[name].append(workers * BATCH * args.iters / seconds)
    rates: dict[str, float | str] = {
        name: statistics.median(values) if values else "failed" for name, values in measured.items()
    }
    anchor_name = "torch DDP (gloo)" if "torch DDP (gloo)" in rates else next(iter(rates))
    anchor = rates[anchor_name]
    setup = (
        f"small CNN (conv 3->32, conv 32->64, fc 4096->256->10), batch {BATCH} per worker, "
        f"{WORKERS} workers, 1 thread each, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.iters} steps after {args.warmup}, median of {args.rounds} rounds, precision {PRECISION}"
    )
    print(setup)
    anchor_short = "x DDP" if anchor_name == "torch DDP (gloo)" else f"x {anchor_name}"
    head, rows = ["run", "samples/s", anchor_short, "spread", "paired", "paired range"], []
    for name, rate in rates.items():
        ok = isinstance(rate, float) and isinstance(anchor, float)
        shown = f"{rate:9.0f}" if isinstance(rate, float) else f"{rate:>9}"
        values = measured[name]
        spread = f"{(max(values) - min(values)) / statistics.median(values):.1%}" if len(values) > 1 else "-"
        paired = _paired(values, measured[anchor_name])
        rows.append([name, shown, f"{rate / anchor:.3f}" if ok else "-", spread])
        rows[-1] += (
            [f"{statistics.median(paired):.3f}", f"{min(paired):.3f}..{max(paired):.3f}"]
            if paired
            else ["-"] * 2
        )
    for line in _plot.format_table(head, rows):
        print(line)
    print(
        "spread: (max - min) / median of the rounds' figures, how noisy this machine was; paired: the "
        f"median (and range) of each round's ratio to {anchor_name} measured just before it"
    )
    _plot.save_table("train", setup, head, rows)
    if args.plot:
        plot(args.plot, rates)


def _paired(values: list[float], anchor: list[float]) -> list[float]:
    """Per round, a run's figure over the anchor's of the same round (where both ran every round)."""
    return [v / a for v, a in zip(values, anchor)] if len(values) == len(anchor) > 0 else []


def plot(path: str, rates: dict[str, float | str]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(rates)
    ax.barh(names, [r if isinstance(r, float) else 0.0 for r in rates.values()])
    ax.set_xlabel("samples/s (higher is better)")
    ax.set_title("small CNN, batch 64 per worker")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
