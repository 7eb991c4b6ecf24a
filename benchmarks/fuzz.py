"""The transport fuzzer (tests/transport_fuzz.py) for a long run, outside CI; and, with --http,
the HTTP floods of tests/test_http_floods.py at the size an attacker would use.

    python benchmarks/fuzz.py [--frames 100000] [--seeds 7,8]
    python benchmarks/fuzz.py --http [--connections 1100] [--nofile 1024]

For each seed, a server with the ping handler runs in a child process and the fuzzer sends it at
least `--frames` random and mutated frames (bad handshakes, bad MACs, wrong and mutated headers,
valid frames), checking that each bad one closes its connection unanswered and each good one is
answered in order. Afterwards a legitimate client must still get its ping echoed, and the server
must have raised nothing uncaught. CI runs the same fuzzer for 10,000 frames (tests/test_transport.py).

With --http, each server (the dashboard beside an RPC port; `paratrain serve`) runs under a common
`ulimit -n` and takes each flood of the tests at `--connections` (more than its descriptors): a
normal request must be answered during and after, and the table gives its descriptors, memory and
log lines before and after.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import _plot  # noqa: E402
from transport_fuzz import PingHandler, fuzz_server  # noqa: E402

from paratrain.transport.client import RpcClient  # noqa: E402
from paratrain.transport.rpc import RpcServer  # noqa: E402

SECRET = bytes(range(32))


def serve(ready: mp.Queue, stop: mp.Event) -> None:
    errors: list[str] = []
    threading.excepthook = lambda args: errors.append(repr(args.exc_value))
    server = RpcServer(SECRET, PingHandler()).start()
    ready.put(server.port)
    stop.wait()
    server.close()
    ready.put(errors)


def run(seed: int, frames: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=serve, args=(ready, stop), daemon=True)
    proc.start()
    try:
        port = ready.get(timeout=60)
        start = time.monotonic()
        stats = fuzz_server("127.0.0.1", port, SECRET, frames=frames, seed=seed)
        elapsed = time.monotonic() - start
        client = RpcClient("127.0.0.1", port, SECRET)
        value = torch.arange(10.0)
        reply = client.call("ping", {"after": "fuzz"}, [value], timeout_s=30)
        assert reply.meta == {"after": "fuzz"} and torch.equal(reply.tensors[0], value), reply
        client.close()
        stop.set()
        errors = ready.get(timeout=60)
        assert errors == [], f"the server raised in a thread: {errors}"
    finally:
        stop.set()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    return {**stats, "seconds": round(elapsed, 1), "frames_per_s": round(stats["frames"] / elapsed)}


def http_floods(connections: int, nofile: int) -> None:
    import tempfile
    from pathlib import Path

    import test_http_floods as floods

    floods.NOFILE, floods.FLOOD = nofile, connections
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for kind in ("dashboard", "serve"):
            with floods.flood_server(kind, Path(folder) / f"{kind}.log") as server:
                server.normal_request()
                for name in [flood for k, flood in floods.CASES if k == kind]:
                    before, lines = server.usage(), server.log_lines()
                    floods.test_a_flood_leaves_the_server_answering_and_its_descriptors_memory_and_log_bounded(
                        lambda _kind: server, kind, name
                    )
                    after = server.usage()
                    row = [f"{kind}: {name}", str(before[0]), str(after[0]), str(before[1] // 1024)]
                    rows.append([*row, str(after[1] // 1024), str(server.log_lines() - lines)])
                    print(" ".join(rows[-1]), flush=True)
    head = ["flood", "fds before", "fds after", "RSS MiB before", "RSS MiB after", "log lines"]
    title = f"{connections} connections per flood, ulimit -n {nofile}; answered during and after each"
    _plot.save_table("http_floods", title, head, rows)
    print("every flood left the server answering")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--seeds", default="7")
    parser.add_argument("--http", action="store_true", help="flood the HTTP servers instead")
    parser.add_argument("--connections", type=int, default=1100)
    parser.add_argument("--nofile", type=int, default=1024)
    args = parser.parse_args()
    if args.http:
        http_floods(args.connections, args.nofile)
        return
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        stats = run(seed, args.frames)
        print(f"seed {seed}: " + " ".join(f"{k}={v}" for k, v in sorted(stats.items())), flush=True)
        rows.append((f"seed {seed}", dict(sorted(stats.items()))))
    head = ["run", *rows[0][1]]
    _plot.save_table(
        "fuzz", f"{args.frames} fuzzed frames per seed", head, [[n, *map(str, s.values())] for n, s in rows]
    )
    print("every bad frame was refused and every good one answered; the server still serves")


if __name__ == "__main__":
    main()
