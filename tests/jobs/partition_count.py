"""The partition job of tests/test_partition.py: a counting job (every applied push adds exactly one)
on simulated hosts, where a worker's and a server's links go down and come back.

    partition_count.py ROUNDS DIR [--worker RANK:ROUND] [--server RANK:ROUND] [--timeout SECONDS]
                       [--mode sync|async]

Workers push -1 to three keys (one sliced over the servers) under a server-side SGD at lr 1, in
sync rounds (or async), with elasticity (min_workers 2) and, with --server, JobConfig.replication=2.
`--worker R:K`: worker R takes its own host's link down just before its push of round K (so it has
exactly K acknowledged pushes, and none in flight). `--server S:K`: server S does the same once
worker 0 reached round K. Each process cut off writes its pid in DIR and lives on; the test brings
its link back (once the scheduler has dropped it).

The survivors go on; at the end they wait until every process cut off has exited (the job's fence
must make it exit after its link came back), then check that every key holds exactly the job's
acknowledged pushes, and print `count ok <total>`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import threading
import time
from pathlib import Path

import torch

import paratrain
from paratrain.kvstore import KVStoreConfig, create

parser = argparse.ArgumentParser()
parser.add_argument("rounds", type=int)
parser.add_argument("folder", type=Path)
parser.add_argument("--worker", default=None, help="RANK:ROUND")
parser.add_argument("--server", default=None, help="RANK:ROUND")
parser.add_argument("--mode", default="sync", choices=("sync", "async"))
parser.add_argument("--timeout", type=float, default=3.0, help="JobConfig.heartbeat_timeout_s")
args = parser.parse_args()
worker_cut = tuple(int(x) for x in args.worker.split(":")) if args.worker else None
server_cut = tuple(int(x) for x in args.server.split(":")) if args.server else None
role, rank = os.environ["PARATRAIN_ROLE"], int(os.environ.get("PARATRAIN_RANK", "0"))


def cut_link() -> None:
    """This host's only link goes down now; this process lives on."""
    (args.folder / f"{role}-{rank}.pid").write_text(str(os.getpid()))
    subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
    print(f"{role} {rank}: link down", flush=True)


if role == "server" and server_cut is not None and rank == server_cut[0]:
    signal_file = args.folder / "server-cut"

    def cut_when_told() -> None:
        while not signal_file.exists():
            time.sleep(0.005)
        cut_link()

    threading.Thread(target=cut_when_told, daemon=True).start()

config = paratrain.JobConfig(
    heartbeat_interval_s=0.25,
    heartbeat_timeout_s=args.timeout,
    elastic=paratrain.ElasticConfig(min_workers=2),
    replication=2 if server_cut else 1,
)
ctx = paratrain.init(config)
kv = create(KVStoreConfig(consistency=args.mode, slice_elements=64), ctx)
sizes = {"a": 8, "b": 3, "big": 200}  # "big" is sliced over the servers
kv.init(list(sizes), [torch.zeros(n) for n in sizes.values()])
kv.set_optimizer("torch.optim.SGD", lr=1.0)
outs = {k: torch.empty(n) for k, n in sizes.items()}
acknowledged = 0
for r in range(args.rounds):
    if worker_cut == (ctx.rank, r):
        cut_link()
    if server_cut is not None and ctx.rank == 0 and r == server_cut[1]:
        (args.folder / "server-cut").touch()
        while not (args.folder / f"server-{server_cut[0]}.pid").exists():  # it is cutting its link
            time.sleep(0.005)
    kv.pushpull(list(sizes), [torch.full((n,), -1.0) for n in sizes.values()], out=list(outs.values()))
    acknowledged += 1  # one push per key, acknowledged once pushpull returned


def exited(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie has exited; its launcher reaps it


deadline = time.monotonic() + 60.0
for pid_file in sorted(args.folder.glob("*.pid")):
    while not exited(int(pid_file.read_text())):
        assert time.monotonic() < deadline, f"{pid_file.stem} did not exit after its link came back"
        time.sleep(0.05)

total = sum(ctx.barrier(name="counted", data=acknowledged).values())
total += worker_cut[1] if worker_cut is not None else 0  # the dropped worker's acknowledged pushes
kv.pull(list(sizes), out=list(outs.values()))
for key, out in outs.items():
    assert out.eq(total).all(), f"key {key!r} holds {out.unique().tolist()}, acknowledged {total}"
print(f"worker {ctx.rank}: count ok {total}", flush=True)
