"""What failures cost: a job's pause when a process is SIGKILLed, and what replication costs.

    python benchmarks/failures_servers.py [--rows server-death,replication] [--paths tcp,default,hosts]
                                          [--mb 64] [--iters 8] [--pairs 2] [--rate 1gbit] [--timeline S]

Rows (each a function returning table rows; main() only joins them):

- server-death: 2 workers, 2 servers, JobConfig.replication=2, sync rounds of pushpull over an
  8 MB model (sliced over both servers) under a server-side SGD. Server 1 SIGKILLs itself after the
  workers' round 20 (it notes the time first); the figure is the time from that SIGKILL to the
  first round that worker 0 completes after it, as a ratio to the heartbeat timeout (the anchor:
  how long a dead node takes to be named; target <= 2x), and to the median round before it.
- replication: 2 workers, 2 servers, one sync pushpull of a 64 MB model (50 float32 tensors,
  benchmarks/kvstore.py's sizes), median seconds per iteration of the slowest worker, with
  replication=2 against replication=1 (the anchor; target <= 1.3x). Jobs alternate
  (1, 2, 1, 2, ...) on this machine and the medians of each are compared; "tcp" turns the
  same-host path off for both, "default" is what a job on one machine gets (a primary keeps its
  slices in shared memory, as without replication, and lends each round's value to its same-host
  backup: kvstore/server/mirror.py). "hosts" is what a job across hosts gets: the same jobs with
  each process on a simulated host of its own (network namespaces on one bridge, links shaped to
  --rate each way, as benchmarks/hosts.py; needs root), so a backup's copies cross its links.
  There replication=2 puts 1.5x the bytes through each server's link in each direction (64 MB of
  pushes in and pulls out, and 32 MB of replicas out and in), which the anchor's links already
  carry at their rate: the links alone allow about 1.5x. `--timeline S` prints that row's link
  rates over each job's last S seconds. `--paths` picks rows.

Every job is this file run again in its --paratrain-role mode by the local launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import _anchors  # noqa: E402
import _jobs  # noqa: E402
import _plot  # noqa: E402
from hosts import LinkSampler  # noqa: E402
from kvstore import model_sizes  # noqa: E402

PUSHPULL = re.compile(r"FAILBENCH rank=(\d+) per_iter_s=([0-9.eE+-]+) ok=(\d)")
DEATH = re.compile(r"FAILBENCH rank=(\d+) rounds=(\S+)")
KILL_AFTER_ROUND = 20
HEARTBEAT_TIMEOUT_S = 5.0  # JobConfig's default
PATHS = {"tcp": False, "default": True, "hosts": True}  # replication rows: the same-host path on?
TIMELINE_BIN_S = 0.05  # --timeline: link samples (every 5-60 ms) merged into steps of this length


# ------------------------------------------------------------------------------- job roles
def role_pushpull(args: argparse.Namespace) -> None:
    """One replication row's job: each worker prints its median seconds per pushpull."""
    import paratrain
    from paratrain.kvstore import create
    from paratrain.transport.config import TransportConfig

    torch.set_num_threads(1)
    ring = TransportConfig().shm_ring_bytes if args.same_host else 0
    paratrain.init(
        paratrain.JobConfig(replication=args.replication, transport=TransportConfig(shm_ring_bytes=ring))
    )
    kv = create("dist_sync")
    sizes = model_sizes(args.mb << 20, 50)
    keys = list(range(len(sizes)))
    kv.init(keys, [torch.zeros(n) for n in sizes])
    grads = [torch.full((n,), kv.rank + 1.0) for n in sizes]
    outs = [torch.empty(n) for n in sizes]
    per_iter = _anchors.time_steps(lambda: kv.pushpull(keys, grads, out=outs), 2, args.iters, kv.barrier)
    ok = all(bool((out == 3.0).all()) for out in outs)  # worker r pushes r + 1
    print(f"FAILBENCH rank={kv.rank} per_iter_s={per_iter:.6f} ok={int(ok)}", flush=True)


def role_death(args: argparse.Namespace) -> None:
    """The server-death row's job: server 1 kills itself once worker 0 reached round
    KILL_AFTER_ROUND; worker 0 prints when each round ended (time.time())."""
    import signal
    import threading

    import paratrain
    from paratrain.kvstore import create

    folder = Path(args.dir)
    if os.environ.get("PARATRAIN_ROLE") == "server" and os.environ.get("PARATRAIN_RANK") == "1":

        def die() -> None:
            while not (folder / "go").exists():
                time.sleep(0.001)
            (folder / "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=die, daemon=True).start()
    torch.set_num_threads(1)
    paratrain.init(paratrain.JobConfig(replication=2, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S))
    kv = create("dist_sync")
    sizes = model_sizes(8 << 20, 50)
    keys = list(range(len(sizes)))
    kv.init(keys, [torch.zeros(n) for n in sizes])
    kv.set_optimizer("torch.optim.SGD", lr=0.1)
    grads = [torch.full((n,), 1.0) for n in sizes]
    outs = [torch.empty(n) for n in sizes]
    ends = []
    for r in range(KILL_AFTER_ROUND + 20):
        if kv.rank == 0 and r == KILL_AFTER_ROUND:
            (folder / "go").touch()
        kv.pushpull(keys, grads, out=outs)
        ends.append(time.time())
    print(f"FAILBENCH rank={kv.rank} rounds={','.join(f'{t:.6f}' for t in ends)}", flush=True)


# ------------------------------------------------------------------------------- rows
def pushpull_job(
    replication: int, same_host: bool, args: argparse.Namespace, places: dict | None = None
) -> float | None:
    role = ["--paratrain-role", "pushpull", "--replication", str(replication), "--mb", str(args.mb)]
    role += ["--iters", str(args.iters)] + (["--same-host"] if same_host else [])
    found = _jobs.run_role_job(__file__, role, 2, 2, args.timeout, PUSHPULL, places)
    if found is None or not all(ok == "1" for _, _, ok in found):
        return None
    return max(float(s) for _, s, _ in found)


def pushpull_turns(
    same_host: bool, args: argparse.Namespace, places: dict | None = None, bridge: str | None = None
) -> dict[int, list[float]]:
    """Seconds per pushpull of each job, replication=1 and =2 in turns. `bridge`: the simulated
    hosts' bridge, whose ports --timeline samples (hosts.py's LinkSampler)."""
    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.pairs):
        for replication in (1, 2):
            sampler = LinkSampler(bridge, 4) if bridge and args.timeline else None
            with sampler or contextlib.nullcontext():
                took = pushpull_job(replication, same_host, args, places)
            if took is not None:
                times[replication].append(took)
            if sampler is not None:
                print(f"replication={replication}, workers on hosts 0-1, servers on 2-3, ", end="")
                print(f"the job's last traffic in {TIMELINE_BIN_S * 1e3:.0f} ms steps: ", end="")
                print(sampler.report(args.timeline, float("inf"), TIMELINE_BIN_S))
    return times


def hosts_turns(args: argparse.Namespace) -> dict[int, list[float]]:
    """pushpull_turns with every process on a simulated host of its own (the scheduler beside
    worker 0), links shaped to --rate each way."""
    from paratrain.launch.engines.local.job import ProcessHost
    from paratrain.testing_hosts import LinkShape, SimulatedHosts

    shape = LinkShape(args.rate)
    print(
        f"replication hosts: 2 workers (hosts 0-1), 2 servers (hosts 2-3), network namespaces on one "
        f"bridge, links {args.rate} each way (tbf burst {shape.burst_bytes >> 10} KiB, limit "
        f"{shape.limit_bytes >> 20} MiB), every setting at its default; bound: each server's link "
        f"carries 1.5x the bytes with replication=2 (its pushes and pulls, and 1/2 of the model as "
        f"replicas out and in)",
        flush=True,
    )
    with SimulatedHosts(4, shape=shape) as hosts:

        def placed(indices: list[int]) -> list[ProcessHost]:
            return [hosts.placement(i) for i in indices]

        places = {"scheduler": placed([0]), "worker": placed([0, 1]), "server": placed([2, 3])}
        return pushpull_turns(True, args, places, hosts.bridge)


def replication_rows(args: argparse.Namespace) -> list[list[str]]:
    """Cost of replication=2 on pushpull time, against replication=1 measured alternately."""
    from paratrain.testing_hosts import hosts_unavailable

    rows = []
    for path, same_host in PATHS.items():
        if path not in args.paths.split(","):
            continue
        if path == "hosts" and (why := hosts_unavailable()):
            rows.append([f"replication {path}", "skipped", "-", "-", why])
            continue
        times = hosts_turns(args) if path == "hosts" else pushpull_turns(same_host, args)
        if not times[1] or not times[2]:
            rows.append([f"replication {path}", "failed", "-", "-", "<= 1.3x"])
            continue
        one, two = statistics.median(times[1]), statistics.median(times[2])
        rows.append(
            [
                f"replication {path}",
                f"{two * 1e3:.0f} ms",
                f"{one * 1e3:.0f} ms",
                f"{two / one:.2f}x",
                "<= 1.3x",
            ]
        )
    return rows


def server_death_rows(args: argparse.Namespace) -> list[list[str]]:
    """Time from a server's SIGKILL to the job's next round, with replication=2."""
    with tempfile.TemporaryDirectory(prefix="failures-") as folder:
        found = _jobs.run_role_job(
            __file__,
            ["--paratrain-role", "death", "--dir", folder],
            2,
            2,
            args.timeout,
            DEATH,
            server_losses=1,
        )
        killed_file = Path(folder) / "killed"
        killed = float(killed_file.read_text()) if killed_file.exists() else None
    if found is None or killed is None:
        return [["server death", "failed", "-", "-", "<= 2x"]]
    ends = [float(t) for t in dict(found)["0"].split(",")]
    after = min(t for t in ends if t > killed)
    before = [b - a for a, b in zip(ends[:KILL_AFTER_ROUND], ends[1:KILL_AFTER_ROUND], strict=False)]
    gap = after - killed
    round_s = statistics.median(before)
    return [
        [
            "server death",
            f"{gap * 1e3:.0f} ms",
            f"{HEARTBEAT_TIMEOUT_S * 1e3:.0f} ms",
            f"{gap / HEARTBEAT_TIMEOUT_S:.2f}x",
            "<= 2x",
        ],
        ["  (per round)", f"{gap * 1e3:.0f} ms", f"{round_s * 1e3:.0f} ms", f"{gap / round_s:.1f}x", "-"],
    ]


ROWS = {"server-death": server_death_rows, "replication": replication_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"which rows: {', '.join(ROWS)}")
    parser.add_argument("--mb", type=int, default=64, help="the replication rows' model size")
    parser.add_argument("--iters", type=int, default=8, help="timed pushpulls per replication job")
    parser.add_argument("--pairs", type=int, default=2, help="jobs of each replication per row")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"the replication rows: {', '.join(PATHS)}")
    parser.add_argument("--rate", default="1gbit", help="the hosts row's links, each way (tc syntax)")
    parser.add_argument(
        "--timeline", type=float, metavar="S", help="the hosts row: each link's rate over a job's last S s"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="limit per job (s)")
    parser.add_argument("--paratrain-role", choices=["pushpull", "death"], help=argparse.SUPPRESS)
    parser.add_argument("--replication", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--same-host", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.paratrain_role:
        {"pushpull": role_pushpull, "death": role_death}[args.paratrain_role](args)
        return
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    if unknown := [n for n in names if n not in ROWS]:
        parser.error(f"--rows {unknown[0]!r} is not one of {', '.join(ROWS)}")
    rows = [row for name in names for row in ROWS[name](args)]
    title = (
        f"failures: 2 workers, 2 servers on one machine ({os.cpu_count()} cores); replication rows: "
        f"{args.mb} MB sync pushpull, {args.pairs} jobs each, alternating"
    )
    head = ["row", "measured", "anchor", "ratio", "target"]
    print(title)
    print("\n".join(_plot.format_table(head, rows)))
    _plot.save_table("failures_servers", title, head, rows)


if __name__ == "__main__":
    main()
