"""What one replicated round's copy to a same-host backup costs: over TCP, or through the backup's
buffers (kvstore/server/mirror.py), in turns in one run.

    python benchmarks/failures_copy.py [--mb 32] [--slices 16] [--rounds 10] [--turns 6]

A backup server (a real KVServer behind an RpcServer, in a child process) holds `--slices` slices
of `--mb` MB in all: half of benchmarks/failures_servers.py's 64 MB model, what each of its two
servers copies to the other per round. This process is their primary: per round it changes every
slice's version and forwards it (replica.Replicator.forward, under the slice's lock, as a round's
update does), then waits until the backup confirmed all (`durable`). The figure is the median
seconds per round; "tcp" (the same-host path off: what every copy was before) is the anchor, and
"buffers" runs in turns with it, so both see the same load. The end-to-end rows are
failures_servers.py's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import _plot  # noqa: E402

SECRET = b"failures-copy-secret"
BACKUP = f"""
import sys, threading
sys.path.insert(0, {os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")!r})
from paratrain.kvstore.server.server import KVServer
from paratrain.transport.rpc import RpcServer
kv = KVServer(1)
server = RpcServer({SECRET!r}, kv).start()
print(server.port, flush=True)
sys.stdin.read()  # until the primary is done
"""


def slices(mb: int, count: int) -> list[int]:
    numel = (mb << 20) // 4
    return [numel // count + (1 if i < numel % count else 0) for i in range(count)]


def primary(port: int, name: str, sizes: list[int], same_host: bool):
    """A primary KVServer whose slices `name`-0.. are backed up on the server at `port`."""
    from paratrain.kvstore.server.replica import Replicator
    from paratrain.kvstore.server.server import KVServer
    from paratrain.transport.client import RpcClient
    from paratrain.transport.config import TransportConfig

    servers = [["127.0.0.1", 1], ["127.0.0.1", port]]
    config = {"mode": "sync", "members": [0], "replication": 2, "servers": servers}
    ring = TransportConfig().shm_ring_bytes if same_host else 0
    kv = KVServer(0, replicator=Replicator(0, SECRET, TransportConfig(shm_ring_bytes=ring)))
    kv.configure(config)
    worker = RpcClient("127.0.0.1", port, SECRET)  # inits the backup's slices, as a worker does
    worker.call("configure", config)
    keys = [f"{name}-{i}" for i in range(len(sizes))]
    meta = {"keys": keys, "starts": [0] * len(sizes), "stops": sizes, "shapes": [[n] for n in sizes]}
    meta |= {"dtypes": ["float32"] * len(sizes), "numels": sizes, "chain": [0, 1]}
    worker.call("init", meta, [torch.zeros(n) for n in sizes])
    worker.close()
    shards = []
    for key, n in zip(keys, sizes, strict=True):
        where = {"key": key, "start": 0, "stop": n, "numel": n, "shape": [n], "dtype": "float32"}
        shards.append(kv.adopt(where | {"chain": [0, 1]}))
    return kv, shards


def one_round(shards: list) -> float:
    start = time.perf_counter()
    for shard in shards:
        with shard.cond:
            shard.value.add_(1.0)
            shard.version += 1
            shard.on_applied(shard)
    for shard in shards:
        while shard.durable < shard.version:
            time.sleep(0.0002)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=32, help="MB copied per round")
    parser.add_argument("--slices", type=int, default=16, help="slices they are cut into")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per turn")
    parser.add_argument("--turns", type=int, default=6, help="turns of each way")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = slices(args.mb, args.slices)
    child = subprocess.Popen([sys.executable, "-c", BACKUP], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        ways = {"tcp": primary(port, "tcp", sizes, False), "buffers": primary(port, "buffers", sizes, True)}
        times: dict[str, list[float]] = {way: [] for way in ways}
        for turn in range(args.turns):
            for way in ways if turn % 2 == 0 else reversed(list(ways)):
                _, shards = ways[way]
                one_round(shards)  # warm-up (the first one maps the buffers)
                times[way] += [one_round(shards) for _ in range(args.rounds)]
        for kv, _ in ways.values():
            kv.replicator.close()
    finally:
        child.kill()
        child.wait()
    anchor = statistics.median(times["tcp"])
    rows = [
        [
            way,
            f"{statistics.median(t) * 1e3:.1f} ms",
            f"{min(t) * 1e3:.1f} ms",
            f"{statistics.median(t) / anchor:.2f}x",
        ]
        for way, t in times.items()
    ]
    title = (
        f"failures_copy: one round's copy of {args.mb} MB ({args.slices} slices) to a same-host backup, "
        f"{args.turns} turns of {args.rounds} rounds each way, in turns ({os.cpu_count()} cores)"
    )
    head = ["copy", "median", "min", "x tcp"]
    print(title)
    print("\n".join(_plot.format_table(head, rows)))
    _plot.save_table("failures_copy", title, head, rows)


if __name__ == "__main__":
    main()
