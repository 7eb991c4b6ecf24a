"""Anchors for the kvstore benchmark: one sync round of a model's gradients without paratrain.

Each anchor runs as spawned processes on loopback and reports seconds per iteration (see
`time_steps`; the slowest worker's figure):

- gloo: `all_reduce(async_op=True)` of every tensor at once on 2 processes, then wait for all.
- rpc: a synchronous parameter server on torch.distributed.rpc, as in PyTorch's batch-updating
  parameter-server tutorial: per iteration each worker makes one call per server carrying that
  server's tensors; the server sums both workers' tensors and every call returns the sum.
- tcp: the same bytes over plain sockets (sendall / recv_into into preallocated buffers); each
  server sums the workers' buffers into a preallocated accumulator and sends it back to each.

Nothing here imports paratrain: an anchor must not move when paratrain changes.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
import socket
import statistics
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed import rpc

_POLL_S = 0.5
_JOIN_S = 30.0


def attempt(name: str, measure: Any, *measure_args: Any) -> Any:
    """measure(*measure_args), or "failed" (with the reason on stderr): one broken anchor must not
    hide the others."""
    try:
        return measure(*measure_args)
    except Exception as exc:
        print(f"{name} failed: {exc!r}", file=sys.stderr)
        return "failed"


def free_port() -> int:
    """A port that was free a moment ago (torch's rendezvous wants a number, not a socket)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.numpy()).cast("B")


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("peer closed the connection mid-message")
        got += n


class Children:
    """Spawned processes that report through one queue; all of them are gone when the block ends."""

    def __init__(self, timeout_s: float) -> None:
        self.ctx = mp.get_context("spawn")
        self.results = self.ctx.Queue()
        self.procs: list[Any] = []
        self.deadline = time.monotonic() + timeout_s

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        end = time.monotonic() + (_JOIN_S if exc[0] is None else 0.0)
        for proc in self.procs:
            proc.join(max(0.0, end - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        self.results.close()

    def start(self, name: str, target: Any, *args: Any) -> None:
        proc = self.ctx.Process(target=target, args=(*args, self.results), name=name, daemon=True)
        proc.start()
        self.procs.append(proc)

    def collect(self, count: int) -> list[Any]:
        """The next `count` reports; raises if a child fails or the time is up first."""
        got = []
        while len(got) < count:
            try:
                got.append(self.results.get(timeout=_POLL_S))
                continue
            except queue.Empty:
                pass
            for proc in self.procs:
                if proc.exitcode not in (None, 0):
                    raise RuntimeError(f"{proc.name} exited with code {proc.exitcode}")
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"{len(got)} of {count} reports came within the time limit")
        return got


def split_by_bytes(sizes: list[int], parts: int) -> list[range]:
    """Contiguous groups of tensor indices, one per server, with about equal bytes each."""
    total, bounds, acc = sum(sizes), [0], 0
    for i, size in enumerate(sizes):
        # close a group where the running total passes the group's share, on whichever side is nearer
        target = total * len(bounds) / parts
        if len(bounds) < parts and acc + size / 2 >= target and i > bounds[-1]:
            bounds.append(i)
        acc += size
    bounds += [len(sizes)] * (parts + 1 - len(bounds))
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def time_steps(step: Any, warmup: int, iters: int, before_timing: Any = None) -> float:
    """Seconds per step: the median of `iters` timed steps after `warmup` untimed ones (the
    median, so that a stall caused by another program on a shared machine does not count)."""
    for _ in range(warmup):
        step()
    if before_timing is not None:
        before_timing()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --------------------------------------------------------------------------------------- gloo
def gloo_process(rank: int, port: int, sizes: list[int], warmup: int, iters: int, results: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensors = [torch.zeros(n) for n in sizes]  # zeros: the in-place sums never grow

    def step() -> None:
        for work in [dist.all_reduce(t, async_op=True) for t in tensors]:
            work.wait()

    results.put(time_steps(step, warmup, iters, dist.barrier))
    dist.destroy_process_group()


def gloo(sizes: list[int], warmup: int, iters: int, timeout_s: float) -> float:
    port = free_port()
    with Children(timeout_s) as kids:
        for rank in range(2):
            kids.start(f"gloo rank {rank}", gloo_process, rank, port, sizes, warmup, iters)
        return max(kids.collect(2))


# ---------------------------------------------------------------------------------------- rpc
class _PSState:
    """One server's round: the first worker's tensors become the accumulator (RPC gave us fresh
    tensors), later ones are added, and the last arrival completes everyone's future."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.lock = threading.Lock()
        self._new_round()

    def _new_round(self) -> None:
        self.arrived = 0
        self.acc: list[torch.Tensor] | None = None
        self.future: torch.futures.Future = torch.futures.Future()


_ps: _PSState | None = None


@rpc.functions.async_execution
def _ps_reduce(grads: list[torch.Tensor]) -> torch.futures.Future:
    state, done = _ps, None
    assert state is not None
    with state.lock:
        if state.acc is None:
            state.acc = grads
        else:
            for acc, grad in zip(state.acc, grads, strict=True):
                acc.add_(grad)
        state.arrived += 1
        future = state.future
        if state.arrived == state.num_workers:
            done, total = future, state.acc
            state._new_round()
    if done is not None:
        done.set_result(total)
    return future


def rpc_process(
    rank: int,
    num_servers: int,
    port: int,
    sizes: list[int],
    warmup: int,
    iters: int,
    results: Any,
) -> None:
    global _ps
    torch.set_num_threads(1)
    # init_rpc's own use of a gloo group warns about a deprecated API that is not ours
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    num_workers, world = 2, 2 + num_servers
    name = f"worker{rank}" if rank < num_workers else f"server{rank - num_workers}"
    if rank >= num_workers:
        _ps = _PSState(num_workers)  # before init_rpc: a call may arrive as soon as it returns
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=300, num_worker_threads=8
    )
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    if rank < num_workers:
        groups = split_by_bytes(sizes, num_servers)
        grads = [[torch.full((sizes[i],), rank + 1.0) for i in group] for group in groups]

        def step() -> None:
            futures = [rpc.rpc_async(f"server{s}", _ps_reduce, args=(grads[s],)) for s in range(num_servers)]
            torch.futures.wait_all(futures)

        results.put(time_steps(step, warmup, iters))
    rpc.shutdown()


def rpc_ps(sizes: list[int], num_servers: int, warmup: int, iters: int, timeout_s: float) -> float:
    port = free_port()
    with Children(timeout_s) as kids:
        for rank in range(2 + num_servers):
            args = (rank, num_servers, port, sizes, warmup, iters)
            kids.start(f"rpc rank {rank}", rpc_process, *args)
        return max(kids.collect(2))


# ---------------------------------------------------------------------------------------- tcp
def tcp_server(rank: int, elems: int, num_workers: int, rounds: int, results: Any) -> None:
    torch.set_num_threads(1)
    listener = socket.create_server(("127.0.0.1", 0))
    results.put(("port", rank, listener.getsockname()[1]))
    bufs = [torch.empty(elems) for _ in range(num_workers)]
    acc = torch.empty(elems)

    def reduce() -> None:
        torch.add(bufs[0], bufs[1], out=acc)
        for buf in bufs[2:]:
            acc.add_(buf)

    summed = threading.Barrier(num_workers, action=reduce)

    def serve(conn: socket.socket, buf: torch.Tensor) -> None:
        with conn:
            for _ in range(rounds):
                recv_exact(conn, byte_view(buf))
                summed.wait()
                conn.sendall(byte_view(acc))

    conns = [listener.accept()[0] for _ in range(num_workers)]
    listener.close()
    threads = [threading.Thread(target=serve, args=(c, b)) for c, b in zip(conns, bufs, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def tcp_worker(rank: int, ports: list[int], shares: list[int], warmup: int, iters: int, results: Any) -> None:
    torch.set_num_threads(1)
    socks = [socket.create_connection(("127.0.0.1", port)) for port in ports]
    grads = [byte_view(torch.full((n,), rank + 1.0)) for n in shares]
    backs = [byte_view(torch.empty(n)) for n in shares]

    def exchange(s: int) -> None:
        socks[s].sendall(grads[s])
        recv_exact(socks[s], backs[s])

    with ThreadPoolExecutor(len(ports)) as pool:  # one thread per server: all links busy at once

        def step() -> None:
            list(pool.map(exchange, range(len(ports))))

        results.put(("time", rank, time_steps(step, warmup, iters)))
    for sock in socks:
        sock.close()


def tcp(sizes: list[int], num_servers: int, warmup: int, iters: int, timeout_s: float) -> float:
    shares = [sum(sizes[i] for i in group) for group in split_by_bytes(sizes, num_servers)]
    with Children(timeout_s) as kids:
        for s, elems in enumerate(shares):
            kids.start(f"tcp server {s}", tcp_server, s, elems, 2, warmup + iters)
        ports = [port for _, _, port in sorted(kids.collect(num_servers))]
        for rank in range(2):
            kids.start(f"tcp worker {rank}", tcp_worker, rank, ports, shares, warmup, iters)
        return max(seconds for _, _, seconds in kids.collect(2))
