"""paratrain's kvstore against Gloo, a torch RPC parameter server and plain TCP, in one run.

    python benchmarks/kvstore.py [--iters 10] [--warmup 3] [--servers 1,2] [--plot kvstore.png]

Measured: seconds per iteration of one synchronous round over a 64 MB model split into 50 float32
tensors of sizes spread geometrically from 4K to 2M elements (deterministic), with 2 workers and S
servers on loopback. One paratrain iteration is `kv.pushpull(keys, grads, out=outs)` of all 50 keys
on a "dist_sync" store (this file, run again by `run_local_job` in its --paratrain-role mode). The
anchors (see _anchors.py) move the same tensors: a Gloo all-reduce of all 50 at once (no servers: its
one figure is shown on every row), a torch RPC parameter server with one call per server per
iteration, and plain TCP sockets with each server summing the workers' buffers. Each figure is the
median over the timed iterations, of the slowest worker. "paratrain tcp" moves every byte over TCP;
"paratrain shm" uses the same-host path, which is what a job whose workers and servers share a machine
gets by default: each worker adds its push into the servers' shared round buffers and copies its
pull out of their shared values (kvstore/shared.py); the frames carry no payload.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import _anchors  # noqa: E402
import _jobs  # noqa: E402
import _plot  # noqa: E402

RESULT = re.compile(r"KVBENCH rank=(\d+) per_iter_s=([0-9.eE+-]+) sum_ok=(\d)")
NUM_WORKERS = 2


def model_sizes(total_bytes: int = 64 << 20, count: int = 50) -> list[int]:
    """Element counts of `count` float32 tensors summing to exactly `total_bytes`: a geometric
    spread from 4K to 2M elements before scaling, in a fixed interleaved order (small and big
    tensors alternate as biases and weights do in a model)."""
    total = total_bytes // 4
    smallest, largest = 4096, 2 << 20
    ratio = (largest / smallest) ** (1 / max(1, count - 1))
    raw = [smallest * ratio**i for i in range(count)]
    sizes = [max(1, round(x * total / sum(raw))) for x in raw]
    sizes[-1] += total - sum(sizes)
    step = next(k for k in range(count // 3, count + 1) if math.gcd(k, count) == 1)
    return [sizes[(i * step) % count] for i in range(count)]


# ------------------------------------------------------------------------------- paratrain
def paratrain_role(args: argparse.Namespace) -> None:
    """What every process of the paratrain job runs; servers and the scheduler never return
    from init(). Each worker prints one KVBENCH line."""
    import paratrain
    import paratrain.kvstore
    from paratrain.transport.config import TransportConfig

    torch.set_num_threads(1)
    ring_bytes = TransportConfig().shm_ring_bytes if args.same_host else 0
    paratrain.init(paratrain.JobConfig(transport=TransportConfig(shm_ring_bytes=ring_bytes)))
    kv = paratrain.kvstore.create("dist_sync")
    sizes = model_sizes(args.mb << 20, args.tensors)
    keys = list(range(len(sizes)))
    kv.init(keys, [torch.zeros(n) for n in sizes])
    grads = [torch.full((n,), kv.rank + 1.0) for n in sizes]
    outs = [torch.empty(n) for n in sizes]
    per_iter = _anchors.time_steps(
        lambda: kv.pushpull(keys, grads, out=outs), args.warmup, args.iters, kv.barrier
    )
    expected = kv.num_workers * (kv.num_workers + 1) / 2  # worker r pushes r + 1
    sum_ok = all(bool((out == expected).all()) for out in outs)
    print(f"KVBENCH rank={kv.rank} per_iter_s={per_iter:.6f} sum_ok={int(sum_ok)}", flush=True)


def kvstore_missing() -> bool:
    try:
        return not hasattr(importlib.import_module("paratrain.kvstore"), "create")
    except ImportError:
        return True


def paratrain_job(args: argparse.Namespace, num_servers: int, same_host: bool) -> float | str:
    """Seconds per iteration of the paratrain job, or why there is no figure. `same_host`: payloads
    through shared-memory rings (workers and servers share this machine); else over TCP."""
    if kvstore_missing():
        return "n/a (kvstore missing)"
    role_args = ["--paratrain-role", "--mb", str(args.mb), "--tensors", str(args.tensors)]
    role_args += ["--warmup", str(args.warmup), "--iters", str(args.iters)]
    role_args += ["--same-host"] if same_host else []
    script = os.path.abspath(__file__)
    found = _jobs.run_role_job(script, role_args, NUM_WORKERS, num_servers, args.timeout, RESULT)
    if found is None:
        return "failed"
    if not all(ok == "1" for _, _, ok in found):
        print(f"note: paratrain with {num_servers} server(s) pulled wrong sums", file=sys.stderr)
    return max(float(seconds) for _, seconds, _ in found)


# ------------------------------------------------------------------------------- driver
def cell(value: float | str) -> str:
    return f"{value:.3f} s" if isinstance(value, float) else value


def ratio(ours: float | str, theirs: float | str) -> str:
    ok = isinstance(ours, float) and isinstance(theirs, float)
    return f"{ours / theirs:.2f}" if ok else "-"


def print_table(args: argparse.Namespace, gloo: float | str, rows: dict[int, dict]) -> None:
    head = ["servers", "gloo all-reduce", "rpc PS", "plain TCP", "paratrain tcp", "paratrain shm"]
    head += ["tcp/gloo", "tcp/rpc", "shm/gloo", "shm/rpc"]
    table = [head]
    for servers, row in rows.items():
        ours, shm = row["paratrain"], row["paratrain shm"]
        table.append(
            [str(servers), cell(gloo), cell(row["rpc"]), cell(row["tcp"]), cell(ours), cell(shm)]
            + [ratio(mine, theirs) for mine in (ours, shm) for theirs in (gloo, row["rpc"])]
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    setup = (
        f"{args.mb} MB in {args.tensors} float32 tensors, {NUM_WORKERS} workers, loopback, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, median of {args.iters} iterations"
    )
    print(setup)
    for line in table:
        print(" | ".join(text.rjust(width) for text, width in zip(line, widths, strict=True)))
    _plot.save_table("kvstore", setup, head, table[1:])


def plot(path: str, gloo: float | str, rows: dict[int, dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    series = {"gloo all-reduce": [gloo] * len(rows)}
    labels = (("rpc", "rpc PS"), ("tcp", "plain TCP"), ("paratrain", "paratrain tcp"))
    for key, label in labels + (("paratrain shm", "paratrain shm"),):
        series[label] = [row[key] for row in rows.values()]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(rows))]
        ax.bar(xs, [v if isinstance(v, float) else 0.0 for v in values], width, label=label)
    ax.set_xticks(range(len(rows)), [f"{s} server(s)" for s in rows])
    ax.set_ylabel("seconds per iteration (lower is better)")
    ax.set_title("push + pull of 64 MB in 50 tensors, 2 workers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations first")
    parser.add_argument("--servers", default="1,2", help="server counts, one table row each")
    parser.add_argument("--mb", type=int, default=64, help="model size in MiB")
    parser.add_argument("--tensors", type=int, default=50, help="number of tensors")
    parser.add_argument("--timeout", type=float, default=300.0, help="limit per measurement (s)")
    parser.add_argument("--plot", metavar="PATH", help="also save a bar chart (needs matplotlib)")
    parser.add_argument("--paratrain-role", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--same-host", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    if args.paratrain_role:
        paratrain_role(args)
        return
    torch.set_num_threads(1)
    sizes = model_sizes(args.mb << 20, args.tensors)
    steps = (args.warmup, args.iters, args.timeout)
    gloo = _anchors.attempt("gloo all-reduce", _anchors.gloo, sizes, *steps)
    rows = {}
    for servers in [int(s) for s in args.servers.split(",")]:
        rows[servers] = {
            "rpc": _anchors.attempt("rpc PS", _anchors.rpc_ps, sizes, servers, *steps),
            "tcp": _anchors.attempt("plain TCP", _anchors.tcp, sizes, servers, *steps),
            "paratrain": paratrain_job(args, servers, same_host=False),
            "paratrain shm": paratrain_job(args, servers, same_host=True),
        }
    print_table(args, gloo, rows)
    if args.plot:
        plot(args.plot, gloo, rows)


if __name__ == "__main__":
    main()
