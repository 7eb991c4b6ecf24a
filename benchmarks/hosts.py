"""paratrain's parameter server across simulated hosts with 1 Gbit/s links, against Gloo and the bound.

    sudo python benchmarks/hosts.py [--iters 5] [--warmup 2] [--workers 2,4] [--plot hosts.png]
                                    [--timeline 1.0] [--compression 2bit]

Setup: W workers and W servers, each process on a host of its own (2W network namespaces on one
bridge, paratrain.testing_hosts), every link shaped to --rate in each direction by tbf on both ends
of its veth (burst 128 KiB, queue limit 4 MiB: see LinkShape). The scheduler shares worker 0's host.
One iteration is `kv.pushpull(keys, grads, out=outs)` of the 64 MB model of benchmarks/kvstore.py
(50 float32 tensors) on a "dist_sync" store with every setting at its default; the anchor is a Gloo
all-reduce of the same tensors among the W worker hosts (all 50 at once, then wait). Figures are the
median over the timed iterations, of the slowest worker. "push" and "pull" time the two halves
apart (push all 50 and wait, then pull all 50), in the same job after the pushpull figure.

`--timeline S` also samples every link's byte counters (at the bridge's ports, as fast as `ip`
answers: every 10-60 ms) while the paratrain job runs and prints each host's rate in each direction
over its last S seconds of traffic: where a link idles, and which one finishes last.

`--compression KIND` adds rows for gradient compression (kv.set_gradient_compression; 2bit with
threshold 1, so every element is sent and the pulled value is checked exactly): the same pushpull
with the servers only summing (update_on="worker": pushes and the pulled sums go compressed, the
servers decode, sum, and encode the sum) and with SGD on the servers (update_on="server": pushes
shrink, the pulled weights go in full), each against the uncompressed job of the same kind run
beside it.

The bounds are what the link rate allows: every worker sends and receives the whole model through
its own link, and so does every server (W workers x model / W servers), so a push+pull takes at
least model / rate; a ring all-reduce sends 2 (W - 1) / W x model from each host.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import _anchors  # noqa: E402
import _jobs  # noqa: E402
import _plot  # noqa: E402
import kvstore as kv_bench  # noqa: E402

RESULT = re.compile(
    r"HOSTBENCH rank=(\d+) per_iter_s=([0-9.eE+-]+) push_s=([0-9.eE+-]+) pull_s=([0-9.eE+-]+)"
    r" pushpull_end=([0-9.eE+-]+)"
)
GLOO_RESULT = re.compile(r"GLOOBENCH rank=(\d+) per_iter_s=([0-9.eE+-]+)")
GLOO_PORT = 29500


# ------------------------------------------------------------------------------- roles
def paratrain_role(args: argparse.Namespace) -> None:
    """Every process of the parameter-server job; servers and the scheduler never return from
    init(). Each worker prints one HOSTBENCH line."""
    import paratrain
    import paratrain.kvstore

    paratrain.init()
    kv = paratrain.kvstore.create("dist_sync")
    sizes = kv_bench.model_sizes(args.mb << 20, args.tensors)
    keys = list(range(len(sizes)))
    if args.compression:  # every element is >= the threshold: each worker sends +1 everywhere
        kv.set_gradient_compression({"type": args.compression, "threshold": 1.0})  # before init, as
        # the Trainer does: keys are sliced by their compressed size
    kv.init(keys, [torch.zeros(n) for n in sizes])
    if args.update_on == "server":
        kv.set_optimizer(torch.optim.SGD, lr=1e-6)
    grads = [torch.full((n,), kv.rank + 1.0) for n in sizes]
    outs = [torch.empty(n) for n in sizes]
    per_iter = _anchors.time_steps(
        lambda: kv.pushpull(keys, grads, out=outs), args.warmup, args.iters, kv.barrier
    )
    pushpull_end = time.monotonic()  # one clock for every namespace: --timeline's window ends here
    expected = kv.num_workers * (kv.num_workers + 1) / 2  # worker r pushes r + 1
    if args.compression and args.compression != "2bit":
        expected = None  # topk sends a part, fp16 / bf16 round; 2bit sends +1 and pulls the sum's +1
    elif args.compression:
        expected = 1.0
    if args.update_on == "server":
        expected = None  # weights
    if expected is not None and not all(bool((out == expected).all()) for out in outs):
        raise SystemExit("pushpull pulled wrong sums")
    push_s = _anchors.time_steps(lambda: kv.push(keys, grads).wait(), 0, args.iters, kv.barrier)
    pull_s = _anchors.time_steps(lambda: kv.pull(keys, out=outs), 0, args.iters, kv.barrier)
    print(
        f"HOSTBENCH rank={kv.rank} per_iter_s={per_iter:.6f} push_s={push_s:.6f} pull_s={pull_s:.6f} "
        f"pushpull_end={pushpull_end:.6f}",
        flush=True,
    )


def gloo_role(args: argparse.Namespace) -> None:
    """Every process of the Gloo job: workers only (the scheduler just gives them ranks); they
    meet at worker 0's host, and Gloo uses the interface GLOO_SOCKET_IFNAME names."""
    import torch.distributed as dist

    import paratrain

    ctx = paratrain.init()
    torch.set_num_threads(1)
    init = f"tcp://{args.gloo_master}:{GLOO_PORT}"
    dist.init_process_group("gloo", init_method=init, rank=ctx.rank, world_size=ctx.num_workers)
    tensors = [torch.zeros(n) for n in kv_bench.model_sizes(args.mb << 20, args.tensors)]

    def step() -> None:
        for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
            work.wait()

    per_iter = _anchors.time_steps(step, args.warmup, args.iters, dist.barrier)
    dist.destroy_process_group()
    print(f"GLOOBENCH rank={ctx.rank} per_iter_s={per_iter:.6f}", flush=True)


# ------------------------------------------------------------------------------- driver
class LinkSampler:
    """--timeline: byte counters of every bridge port, sampled on a thread while a job runs. Port
    h<i> receives what host i sends (its uplink) and sends what host i receives (its downlink)."""

    def __init__(self, bridge: str, count: int) -> None:
        self.bridge, self.count = bridge, count
        self.samples: list[tuple[float, dict[str, dict]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-sampler", daemon=True)

    def __enter__(self) -> LinkSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)

    def _run(self) -> None:
        cmd = ["ip", "-n", self.bridge, "-s", "-j", "link", "show"]
        while not self._stop.is_set():
            before = time.monotonic()
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10.0).stdout
            ports = {p["ifname"]: p["stats64"] for p in json.loads(out or "[]") if "stats64" in p}
            self.samples.append(((before + time.monotonic()) / 2, ports))

    def report(self, seconds: float, until: float, step_s: float = 0.0) -> str:
        """Gbit/s per host and direction, sample by sample (or over steps of at least `step_s`),
        over the `seconds` before `until`."""
        cols = [(f"h{i}", key) for i in range(self.count) for key in ("rx", "tx")]

        def moved(a: int, b: int) -> int:
            return sum(self.samples[b][1][p][k]["bytes"] - self.samples[a][1][p][k]["bytes"] for p, k in cols)

        rows = self.samples
        busy = [i for i in range(1, len(rows)) if moved(i - 1, i) > 1 << 20 and rows[i][0] <= until]
        if not busy:
            return "timeline: no traffic sampled"
        end = busy[-1]
        start = next(i for i in range(end + 1) if rows[i][0] >= rows[end][0] - seconds)
        names = [f"{i}{'up' if k == 'rx' else 'dn'}" for i in range(self.count) for k in ("rx", "tx")]
        lines = ["timeline, Gbit/s per host i (up: what it sends, dn: what it receives); t in s"]
        lines.append("     t " + " ".join(n.rjust(4) for n in names))
        last = max(start, 1) - 1
        for i in range(max(start, 1), end + 1):
            dt = rows[i][0] - rows[last][0]
            if dt < step_s and i < end:
                continue
            rates = [(rows[i][1][p][k]["bytes"] - rows[last][1][p][k]["bytes"]) * 8e-9 / dt for p, k in cols]
            lines.append(f"{rows[i][0] - rows[start][0]:6.3f} " + " ".join(f"{r:4.2f}" for r in rates))
            last = i
        return "\n".join(lines)


def modes(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(compression, update_on) of each paratrain job: the plain one, and with --compression the
    compressed one and both again with the optimizer on the servers."""
    if not args.compression:
        return [("none", "worker")]
    return [(c, u) for u in ("worker", "server") for c in ("none", args.compression)]


def measure(args: argparse.Namespace, workers: int) -> dict[str, float | str]:
    """One row: the paratrain jobs and the Gloo job on 2 x `workers` fresh hosts."""
    from paratrain.launch.engines.local.job import ProcessHost
    from paratrain.testing_hosts import LinkShape, SimulatedHosts

    def placed(hosts: SimulatedHosts, indices: range | list[int]) -> list[ProcessHost]:
        return [hosts.placement(i) for i in indices]

    script = os.path.abspath(__file__)
    common = ["--mb", str(args.mb), "--tensors", str(args.tensors)]
    common += ["--warmup", str(args.warmup), "--iters", str(args.iters)]
    row: dict[str, float | str] = {}
    with SimulatedHosts(2 * workers, shape=LinkShape(args.rate)) as hosts:
        places = {
            "scheduler": placed(hosts, [0]),
            "worker": placed(hosts, range(workers)),
            "server": placed(hosts, range(workers, 2 * workers)),
        }
        for compression, update_on in modes(args):
            sampler = LinkSampler(hosts.bridge, hosts.count)
            role = ["--paratrain-role", "--update-on", update_on, *common]
            role += ["--compression", compression] if compression != "none" else []
            with sampler if args.timeline else contextlib.nullcontext():
                found = _jobs.run_role_job(script, role, workers, workers, args.timeout, RESULT, places)
            if args.timeline and found is not None:
                until = max(float(f[4]) for f in found)
                print(
                    f"{workers} workers (hosts 0-{workers - 1}), {workers} servers (hosts {workers}-", end=""
                )
                print(f"{2 * workers - 1}), the timed pushpulls' end: {sampler.report(args.timeline, until)}")
            suffix = "" if (compression, update_on) == ("none", "worker") else f" {compression} {update_on}"
            for i, name in enumerate(("paratrain", "push", "pull")):
                row[name + suffix] = "failed" if found is None else max(float(f[i + 1]) for f in found)
        gloo_args = ["--gloo-role", "--gloo-master", hosts.address(0), *common]
        del places["server"]
        found = _jobs.run_role_job(script, gloo_args, workers, 0, args.timeout, GLOO_RESULT, places)
        row["gloo"] = "failed" if found is None else max(float(f[1]) for f in found)
    return row


def rate_bits(rate: str) -> float:
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate).groups()  # type: ignore[union-attr]
    return float(number) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[unit]


def bounds(args: argparse.Namespace, workers: int) -> tuple[float, float]:
    """Seconds per iteration the links allow: (parameter server, ring all-reduce)."""
    model_bits = (args.mb << 20) * 8
    per_s = rate_bits(args.rate)
    return model_bits / per_s, 2 * (workers - 1) / workers * model_bits / per_s


def print_table(args: argparse.Namespace, rows: dict[int, dict]) -> None:
    cell, ratio = kv_bench.cell, kv_bench.ratio
    head = ["workers", "servers", "hosts", "paratrain", "push", "pull", "PS bound", "gloo", "ring bound"]
    head += ["paratrain/bound", "paratrain/gloo", "gloo/ring bound"]
    table = [head]
    for workers, row in rows.items():
        ps_bound, ring_bound = bounds(args, workers)
        ours, gloo = row["paratrain"], row["gloo"]
        table.append(
            [str(workers), str(workers), str(2 * workers), cell(ours), cell(row["push"]), cell(row["pull"])]
            + [cell(ps_bound), cell(gloo), cell(ring_bound)]
            + [ratio(ours, ps_bound), ratio(ours, gloo), ratio(gloo, ring_bound)]
        )
    from paratrain.testing_hosts import LinkShape

    shape = LinkShape(args.rate)
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    setup = (
        f"{args.mb} MB in {args.tensors} float32 tensors, dist_sync pushpull, one process per simulated "
        f"host, links {args.rate} each way (tbf burst {shape.burst_bytes >> 10} KiB, limit "
        f"{shape.limit_bytes >> 20} MiB), {os.cpu_count()} cores, torch {torch.__version__}, median of "
        f"{args.iters} iterations"
    )
    print(setup)
    for line in table:
        print(" | ".join(text.rjust(width) for text, width in zip(line, widths, strict=True)))
    _plot.save_table("hosts", setup, head, table[1:])
    if args.compression:
        print_compression_table(args, rows)


def print_compression_table(args: argparse.Namespace, rows: dict[int, dict]) -> None:
    """Per worker count and update location: push+pull, push and pull, plain and compressed, and
    the compressed job's push+pull over the plain one's (the anchor, run on the same hosts)."""
    cell, ratio = kv_bench.cell, kv_bench.ratio
    head = ["workers", "update_on", "compression", "push+pull", "push", "pull", "push+pull / plain"]
    table = [head]
    for workers, row in rows.items():
        for compression, update_on in modes(args):
            suffix = "" if (compression, update_on) == ("none", "worker") else f" {compression} {update_on}"
            plain = row["paratrain" + ("" if update_on == "worker" else f" none {update_on}")]
            ours = row["paratrain" + suffix]
            table.append(
                [str(workers), update_on, compression, cell(ours), cell(row["push" + suffix])]
                + [cell(row["pull" + suffix]), ratio(ours, plain)]
            )
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    print(f"\ngradient compression ({args.compression}, threshold 1), the same model, hosts and links:")
    for line in table:
        print(" | ".join(text.rjust(width) for text, width in zip(line, widths, strict=True)))


def plot(path: str, args: argparse.Namespace, rows: dict[int, dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    xs = list(rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label, style in (
        ("paratrain", "paratrain PS (W servers)", "o-"),
        ("gloo", "Gloo all-reduce", "s-"),
    ):
        points = [(x, rows[x][key]) for x in xs if isinstance(rows[x][key], float)]
        ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
    ax.plot(xs, [bounds(args, x)[0] for x in xs], "k--", label="PS link bound")
    ax.plot(xs, [bounds(args, x)[1] for x in xs], "k:", label="ring link bound")
    ax.set_xticks(xs)
    ax.set_xlabel("workers (one host each; as many servers, one host each)")
    ax.set_ylabel("seconds per iteration (lower is better)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"push + pull of {args.mb} MB in {args.tensors} tensors, {args.rate} links")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    parser.add_argument("--workers", default="2,4", help="worker counts (as many servers), a row each")
    parser.add_argument("--rate", default="1gbit", help="every link's rate each way (tc syntax, in bit)")
    parser.add_argument("--mb", type=int, default=64, help="model size in MiB")
    parser.add_argument("--tensors", type=int, default=50, help="number of tensors")
    parser.add_argument("--timeout", type=float, default=180.0, help="limit per job (s)")
    parser.add_argument("--plot", metavar="PATH", help="also save a plot (needs matplotlib)")
    parser.add_argument(
        "--timeline", type=float, metavar="S", help="also print every link's rate over the last S s"
    )
    parser.add_argument(
        "--compression", choices=("2bit", "topk", "fp16", "bf16"), help="also rows with this compression"
    )
    parser.add_argument("--update-on", default="worker", help=argparse.SUPPRESS)
    parser.add_argument("--paratrain-role", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-role", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-master", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    if args.paratrain_role:
        paratrain_role(args)
        return
    if args.gloo_role:
        gloo_role(args)
        return
    from paratrain.testing_hosts import hosts_unavailable

    why = hosts_unavailable()
    if why is not None:
        parser.exit(1, f"cannot run: {why}\n")
    rows = {int(w): measure(args, int(w)) for w in args.workers.split(",")}
    print_table(args, rows)
    if args.plot:
        plot(args.plot, args, rows)


if __name__ == "__main__":
    main()
