"""Peak memory per worker and bytes sent per step under collective (DDP), fsdp and dist_sync.

    python benchmarks/memory.py [--mb 200] [--workers 4] [--steps 3] [--runs collective,fsdp,dist_sync]

The model: `layers` square Linear layers holding about `mb` MB of fp32 parameters, AdamW, a batch of
8 rows per worker. Each run is a paratrain job (this file again, in --paratrain-role mode; dist_sync
with one server). Per worker, after `steps` optimizer steps:

- peak RSS (ru_maxrss), and the same less the RSS before the model was built (torch's own pages);
- bytes sent per step over TCP (the kernel's per-socket count, TCP_INFO, summed over the process's
  sockets; a transport over shared memory is not counted), beside the ideal for P bytes of
  parameters on N workers:
  DDP's ring all-reduce 2(N-1)/N P; fsdp's all-gather in forward and again in backward plus the
  gradients' reduce-scatter 3(N-1)/N P (Gloo's reduce-scatter is an all-reduce underneath, so
  about 4(N-1)/N P is expected); a parameter server's push and pull 2P.

Peak RSS is taken with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_, see main), so that
freed large blocks leave RSS. Memory and traffic are figures of a quiet machine: take them with
nothing else running.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import socket
import struct
import sys

from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import _jobs  # noqa: E402
import _plot  # noqa: E402

RESULT = re.compile(r"MEMBENCH rank=(\d+) peak_mb=([0-9.]+) model_peak_mb=([0-9.]+) sent_per_step=(\d+)")
SERVERS = {"collective": 0, "fsdp": 0, "dist_sync": 1}


def layer_width(mb: float, layers: int) -> int:
    """The width d of `layers` Linear(d, d) layers holding about `mb` MB of fp32 parameters."""
    return max(8, int((mb * 1e6 / 4 / layers) ** 0.5))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


_TCP_BYTES_ACKED = 120  # offset of tcpi_bytes_acked in Linux's struct tcp_info (since 4.1)


def sent_bytes() -> int:
    """Bytes this process has sent (and had acknowledged) over all its TCP sockets, from the
    kernel's TCP_INFO: Gloo's and paratrain's transports alike, whatever syscall wrote them."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            with socket.fromfd(int(fd), socket.AF_INET, socket.SOCK_STREAM) as sock:
                if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:
            continue  # closed meanwhile, or not a TCP socket
        if len(info) >= _TCP_BYTES_ACKED + 8:
            total += struct.unpack_from("Q", info, _TCP_BYTES_ACKED)[0]
    return total


def paratrain_role(args: argparse.Namespace) -> None:
    import torch.distributed.checkpoint.state_dict  # noqa: F401 (their code's pages count as torch's)
    import torch.distributed.fsdp  # noqa: F401

    import paratrain

    ctx = paratrain.init()
    before = peak_rss_mb()
    torch.manual_seed(0)
    width = layer_width(args.mb, args.layers)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(args.layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    trainer = paratrain.Trainer(model, optimizer, strategy=args.strategy, progress=False)
    x = torch.randn(8, width)

    def step() -> None:
        trainer.step(trainer.model(x).square().mean())

    step()  # optimizer state exists from here on
    ctx.barrier(name="measure")
    start = sent_bytes()
    for _ in range(args.steps):
        step()
    sent = (sent_bytes() - start) // args.steps
    peak = peak_rss_mb()
    print(
        f"MEMBENCH rank={ctx.rank} peak_mb={peak:.1f} model_peak_mb={peak - before:.1f} sent_per_step={sent}",
        flush=True,
    )
    trainer.close()


def ideal_bytes(strategy: str, params_bytes: int, workers: int) -> int:
    share = (workers - 1) / workers * params_bytes
    return int({"collective": 2 * share, "fsdp": 3 * share, "dist_sync": 2 * params_bytes}[strategy])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="MB of fp32 parameters")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="measured optimizer steps")
    parser.add_argument("--timeout", type=float, default=600.0, help="limit per job (s)")
    parser.add_argument("--runs", default="collective,fsdp,dist_sync", help="comma-separated strategies")
    parser.add_argument("--paratrain-role", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.paratrain_role:
        paratrain_role(args)
        return
    # glibc raises its mmap threshold after freeing a large block, and later large blocks come from
    # the heap, which it seldom returns: RSS then keeps every freed gather and gradient buffer and
    # measures the allocator, not the strategy. A fixed threshold (read at process start, so set
    # here for the jobs' processes) returns every large block to the OS when it is freed.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    runs = [name.strip() for name in args.runs.split(",")]
    unknown = [name for name in runs if name not in SERVERS]
    if unknown:
        parser.error(f"--runs: unknown {unknown}; the runs are {list(SERVERS)}")
    width = layer_width(args.mb, args.layers)
    params_bytes = args.layers * (width * width + width) * 4
    title = (
        f"{args.workers} workers, {args.layers} x Linear({width}, {width}) = {params_bytes / 1e6:.1f} MB "
        "fp32, AdamW; per worker, the largest"
    )
    print(title)
    head = ["strategy", "peak MB", "model MB", "sent MB/step", "ideal MB/step"]
    rows, peaks = [], {}
    for name in runs:
        role = ["--paratrain-role", "--strategy", name, "--mb", str(args.mb), "--layers", str(args.layers)]
        role += ["--steps", str(args.steps)]
        found = _jobs.run_role_job(
            os.path.abspath(__file__), role, args.workers, SERVERS[name], args.timeout, RESULT
        )
        if found is None:
            rows.append([name, "failed", "failed", "failed", "-"])
            continue
        peak = max(float(f[1]) for f in found)
        model_peak = max(float(f[2]) for f in found)
        sent = max(int(f[3]) for f in found)
        peaks[name] = model_peak
        ideal = ideal_bytes(name, params_bytes, args.workers)
        rows.append([name, f"{peak:.1f}", f"{model_peak:.1f}", f"{sent / 1e6:.1f}", f"{ideal / 1e6:.1f}"])
    print("\n".join(_plot.format_table(head, rows)))
    _plot.save_table("memory", title, head, rows)
    if "dist_sync" in runs:
        print(
            "dist_sync: on one host the kvstore's tensors go through shared-memory rings (transport/shm.py),"
        )
        print("which the TCP count misses; its sent figure is only the sockets' share")
    if "collective" in peaks and "fsdp" in peaks:
        print(f"fsdp / collective model memory: {peaks['fsdp'] / peaks['collective']:.2f}")


if __name__ == "__main__":
    main()
