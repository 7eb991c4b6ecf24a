"""`paratrain serve` under load: requests/s and latency with dynamic batching on and off, beside a
plain loop calling the model one request at a time.

    python benchmarks/serve.py [--requests 10000] [--seconds 2] [--rounds 7] [--concurrency 1,8,32]
                               [--http auto|httptools|h11] [--plot serve.png]

The model: a small CNN (conv 1->32, conv 32->64, 3x3, each with ReLU and 2x2 max-pooling, fc
3136->1024->10) on one 1x28x28 image per request, served from a checkpoint by `paratrain serve` in a
process of its own with its default threads (one for batches of fewer than 8 rows, torch's
default, the machine's cores, for larger ones), on 127.0.0.1. Requests carry the raw float32 bytes
(X-Dtype/X-Shape headers) and ask for raw bytes back. Clients: `c` keep-alive HTTP/1.1
connections driven by one event loop in this process (uvloop, answers parsed by httptools; the
request's bytes made once), sending requests back to back until `requests` answers or `seconds`
passed (after a warm-up), for c in `concurrency`: about 20 us of CPU per request, where a thread
per client with http.client took several times that from the 2 cores the server runs on. Batching
off: --max-batch 1 (every request runs alone); on: the defaults (--max-batch 32 --batch-wait-ms 5);
otherwise the same server and code path. Both servers run all along, and each figure of one is
measured right after the same figure of the other (the order flips every round), in short runs
(`seconds`) over many rounds, so a busy spell of the machine (5 people share its 2 cores) hits both
sides of a round's ratio. The anchor: this process calling the model on one image at a time in a
loop (one thread, no HTTP). Figures: answers per second (the median over the rounds) and the median
and 99th percentile of each request's latency (send to full answer) over all rounds' requests; "x
off" is the median of the rounds' on/off ratios, each of which is printed.
The clients and the server share the machine's cores (the clients' own cost is in every figure).
Also printed: the model's CPU time per image at batch 1 and 32 (thread time, one thread), which
bounds what batching can gain on this machine, and the server process's CPU time per answer (from
/proc), which a busy machine distorts far less than requests/s, and the clients' (this process's).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import httptools
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

MODES = {"off": ["--max-batch", "1"], "on": []}  # on: the defaults, what a user gets


def small_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 7 * 7, 1024), nn.ReLU(), nn.Linear(1024, 10),
    )  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(latencies: list[float], elapsed_s: float) -> dict[str, float]:
    return {
        "rps": len(latencies) / elapsed_s,
        "p50_ms": 1e3 * statistics.median(latencies),
        "p99_ms": 1e3 * percentile(latencies, 0.99),
        "n": len(latencies),
    }


def median_run(runs: list[dict]) -> dict[str, float]:
    """Each figure's median over the rounds; latencies' percentiles over all the rounds' requests."""
    figures = {name: statistics.median(run[name] for run in runs) for name in runs[0] if name != "latencies"}
    if "latencies" in runs[0]:
        every = [latency for run in runs for latency in run["latencies"]]
        figures |= {"p50_ms": 1e3 * statistics.median(every), "p99_ms": 1e3 * percentile(every, 0.99)}
    return figures


def plain_loop(requests: int, seconds: float) -> dict[str, float]:
    """The anchor: one image at a time through the model in this process, one thread."""
    torch.set_num_threads(1)
    model = small_cnn().eval()
    x = torch.randn(1, 1, 28, 28)
    latencies = []
    with torch.inference_mode():
        for _ in range(20):
            model(x)
        start = time.perf_counter()
        while len(latencies) < requests and time.perf_counter() - start < seconds:
            t = time.perf_counter()
            model(x)
            latencies.append(time.perf_counter() - t)
    return summary(latencies, time.perf_counter() - start)


def model_cpu_ms_per_image(batch: int, runs: int = 30, channels_last: bool = False) -> float:
    """Median thread CPU time per image of one forward of `batch` images (one thread), with the
    weights as built or channels-last (as `paratrain serve` runs them)."""
    torch.set_num_threads(1)
    model, x = small_cnn().eval(), torch.randn(batch, 1, 28, 28)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    times = []
    with torch.inference_mode():
        for i in range(runs + 5):
            start = time.thread_time()
            model(x)
            if i >= 5:
                times.append(time.thread_time() - start)
    return 1e3 * statistics.median(times) / batch


def start_server(mode: str, checkpoint_dir: str, port: int, http: str) -> tuple[int, subprocess.Popen]:
    argv = [sys.executable, "-c", "from paratrain.launch.cli import main; main()", "serve"]
    argv += ["--model", f"{os.path.abspath(__file__)}:small_cnn", "--port", str(port), "--http", http]
    argv += ["--input", "inputs:float32:1x28x28", "--reload-interval", "0", *MODES[mode], checkpoint_dir]
    proc = subprocess.Popen(argv, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).close()
            return port, proc
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"paratrain serve ({mode}) did not start (exit code {proc.poll()})")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` has used (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


BODY = torch.randn(1, 1, 28, 28).numpy().tobytes()
REQUEST = (
    b"POST /predict HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/octet-stream\r\n"
    b"x-dtype: float32\r\nx-shape: 1,1,28,28\r\naccept: application/octet-stream\r\n"
    b"content-length: %d\r\n\r\n" % len(BODY)
) + BODY
WARMUP = 5  # requests per client before the clock starts (connections open, server warm)


def load(port: int, concurrency: int, requests: int, seconds: float, server_pid: int) -> dict[str, float]:
    """`concurrency` clients back to back until `requests` answers or `seconds`; raises on any non-200."""
    try:
        import uvloop  # what `uvicorn[standard]` brings: the cheapest loop for the clients too

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    load_run = run(_load(port, LoadRun(concurrency, requests, seconds, server_pid)))
    if load_run.errors:
        raise RuntimeError(f"{len(load_run.errors)} requests failed: {load_run.errors[:5]}")
    figures: dict = summary(load_run.latencies, load_run.elapsed)
    figures["latencies"] = load_run.latencies
    figures["server_cpu_ms"] = 1e3 * load_run.server_cpu_s / len(load_run.latencies)
    figures["client_cpu_ms"] = 1e3 * load_run.client_cpu_s / len(load_run.latencies)
    return figures


async def _load(port: int, load_run: LoadRun) -> LoadRun:
    loop = asyncio.get_running_loop()
    load_run.warmed, load_run.done = loop.create_future(), loop.create_future()
    for _ in range(load_run.concurrency):
        await loop.create_connection(lambda: Client(load_run), "127.0.0.1", port)
    await asyncio.wait_for(load_run.warmed, 120)
    await asyncio.sleep(0.2)
    load_run.begin()
    await asyncio.wait_for(load_run.done, load_run.seconds + 120)
    for client in load_run.clients:
        client.transport.close()
    return load_run


class LoadRun:
    """What the clients share: the clock, the latencies and when to stop."""

    def __init__(self, concurrency: int, requests: int, seconds: float, server_pid: int) -> None:
        self.concurrency, self.requests, self.seconds = concurrency, requests, seconds
        self.server_pid, self.server_cpu_s, self.client_cpu_s = server_pid, 0.0, 0.0
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.clients: list[Client] = []
        self.start = self.elapsed = 0.0
        self.timing = False
        self.warm = self.idle = 0
        self.warmed: asyncio.Future
        self.done: asyncio.Future

    def begin(self) -> None:
        self.timing, self.idle = True, 0
        self.server_cpu_s, self.client_cpu_s = -cpu_s(self.server_pid), -time.process_time()
        self.start = time.perf_counter()
        for client in self.clients:
            client.send()

    def answered(self, client: Client, latency: float, status: int) -> None:
        if not self.timing:
            client.warmup -= 1
            if client.warmup > 0:
                client.send()
                return
            self.warm += 1
            if self.warm == self.concurrency:
                self.warmed.set_result(None)
            return
        self.latencies.append(latency)
        if status != 200:
            self.errors.append(str(status))
        now = time.perf_counter()
        if len(self.latencies) < self.requests and now - self.start <= self.seconds:
            client.send()
            return
        self.idle += 1
        if self.idle == self.concurrency:
            self.elapsed = now - self.start
            self.server_cpu_s += cpu_s(self.server_pid)
            self.client_cpu_s += time.process_time()
            self.done.set_result(None)


class Client(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection sending the same request back to back: the request is
    bytes made once and the answer is parsed by httptools (uvicorn's parser), so that the clients,
    which share the machine with the server, take little of its CPU."""

    def __init__(self, load_run: LoadRun) -> None:
        self.load_run, self.warmup = load_run, WARMUP
        self.parser = httptools.HttpResponseParser(self)
        self.sent = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.load_run.clients.append(self)
        self.send()

    def send(self) -> None:
        self.sent = time.perf_counter()
        self.transport.write(REQUEST)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.load_run.answered(self, time.perf_counter() - self.sent, self.parser.get_status_code())

    def connection_lost(self, exc: Exception | None) -> None:
        for future in (self.load_run.warmed, self.load_run.done):
            if not future.done():
                future.set_exception(ConnectionError(f"the server closed a connection ({exc})"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10000, help="answers per figure and round (at most)")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per figure and round (at most)")
    parser.add_argument("--concurrency", default="1,8,32", help="client counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of every figure (the median counts)")
    parser.add_argument(
        "--http",
        choices=("auto", "httptools", "h11"),
        default="auto",
        help="the server's HTTP parser (paratrain serve --http; the clients parse with httptools)",
    )
    parser.add_argument("--plot", metavar="PATH", help="also save a chart (needs matplotlib)")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    from paratrain import checkpoint
    from paratrain.testing import free_port

    folder = tempfile.mkdtemp(prefix="serve-bench-")
    try:
        staging = checkpoint.staging_dir(folder, 1)
        checkpoint.save_file(staging / "model.pt", {"model": small_cnn().state_dict()})
        checkpoint.commit(folder, 1, {})
        anchor: dict = {
            "cpu_ms": {
                (b, cl): model_cpu_ms_per_image(b, channels_last=cl) for b in (1, 32) for cl in (False, True)
            }
        }
        servers: dict[str, tuple[int, subprocess.Popen]] = {}
        runs: dict[tuple[str, int], list[dict[str, float]]] = {}
        loops = []
        try:
            for mode in MODES:  # both serve all along; the one not under load waits in epoll
                servers[mode] = start_server(mode, folder, free_port(), args.http)
            for i in range(args.rounds):
                loops.append(plain_loop(args.requests, args.seconds))
                for c in levels:  # the modes back to back, first one then the other: a busy spell of
                    for mode in list(MODES)[:: 1 if i % 2 == 0 else -1]:  # the machine hits both
                        port, proc = servers[mode]
                        figures = load(port, c, args.requests, args.seconds, proc.pid)
                        runs.setdefault((mode, c), []).append(figures)
        finally:
            for _, proc in servers.values():
                proc.terminate()
                proc.wait(60)
        anchor |= median_run(loops)
        results = {key: median_run(values) for key, values in runs.items()}
        for c in levels:  # on / off of the same round: the two ran back to back
            ratios = [on["rps"] / off["rps"] for on, off in zip(runs["on", c], runs["off", c])]
            results["on", c]["x_off"], results["on", c]["x_off_rounds"] = statistics.median(ratios), ratios
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report(args, anchor, results, levels)
    if args.plot:
        plot(args.plot, anchor, results, levels)


def report(args, anchor: dict, results: dict, levels: list[int]) -> None:  # noqa: ANN001
    load_avg = os.getloadavg()[0]
    print(
        f"small CNN, 1 image/request, server parser {args.http}, 1 torch thread, {os.cpu_count()} cores "
        f"shared with the clients (load average {load_avg:.1f} at the end); up to {args.requests} answers or "
        f"{args.seconds:g} s per run, {args.rounds} rounds (req/s and x off: the median of the rounds; "
        f"latencies: of all rounds' requests)"
    )
    cpu = anchor["cpu_ms"]
    for cl, layout in ((False, "as built (NCHW)"), (True, "channels-last, as served")):
        print(
            f"model CPU time per image, one thread, {layout}: {cpu[1, cl]:.3f} ms at batch 1, "
            f"{cpu[32, cl]:.3f} ms at batch 32"
        )
    head = f"{'setup':<28}{'clients':>8}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'x off':>8}{'x loop':>8}"
    print(f"{head}{'srv CPU ms/req':>16}{'cli CPU ms/req':>16}")
    loop = anchor
    print(
        f"{'plain loop (no HTTP)':<28}{1:>8}{loop['rps']:>10.0f}{loop['p50_ms']:>9.2f}{loop['p99_ms']:>9.2f}"
    )
    for mode in MODES:
        for c in levels:
            r = results[mode, c]
            vs_off = r.get("x_off", 1.0)
            print(
                f"{'serve, batching ' + mode:<28}{c:>8}{r['rps']:>10.0f}"
                f"{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}"
                f"{vs_off:>7.2f}x{r['rps'] / anchor['rps']:>7.2f}x{r['server_cpu_ms']:>16.2f}"
                f"{r['client_cpu_ms']:>16.3f}"
            )
    top = max(levels)
    on, off = results["on", top], results["off", top]
    verdict = "met" if on["x_off"] >= 4 and on["p99_ms"] <= off["p99_ms"] else "NOT met"
    rounds = ", ".join(f"{x:.2f}x" for x in on["x_off_rounds"])
    print(
        f"target at {top} clients (batching on >= 4x the req/s of off, p99 no worse): {verdict} "
        f"({on['x_off']:.2f}x, the median of the rounds' {rounds}; p99 {on['p99_ms']:.1f} vs "
        f"{off['p99_ms']:.1f} ms)"
    )


def plot(path: str, anchor: dict, results: dict, levels: list[int]) -> None:  # noqa: ANN001
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in MODES:
        left.plot(levels, [results[mode, c]["rps"] for c in levels], marker="o", label=f"batching {mode}")
        right.plot(levels, [results[mode, c]["p99_ms"] for c in levels], marker="o", label=f"batching {mode}")
    left.axhline(anchor["rps"], color="gray", linestyle="--", label="plain loop")
    left.set(xlabel="concurrent clients", ylabel="requests/s", xscale="log", title="throughput")
    right.set(xlabel="concurrent clients", ylabel="p99 latency (ms)", xscale="log", title="p99 latency")
    left.legend()
    right.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
