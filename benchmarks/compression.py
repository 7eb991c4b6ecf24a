"""What gradient compression costs in accuracy: the digits job (examples/digits.py) under dist_sync.

    python benchmarks/compression.py [--epochs 12] [--plot compression.png] [--runs NAME,...]

Setup: 2 workers and 1 server on this machine (paratrain launch), Adam on the server, batch 32 per
worker, the same seed everywhere; every run is deterministic apart from float summation order. Rows:
uncompressed (the anchor), 2bit (threshold 0.02 on the mean gradient) and topk (1%), each with and
without error feedback (no-ef). The figure is the test accuracy (450 held-out digits) that both workers
report (sync: they hold the same weights), and the difference from the anchor in points.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RUNS = {
    "uncompressed": "dist_sync",
    "2bit": "dist_sync:compression=2bit,compression_threshold=0.02",
    "2bit no-ef": "dist_sync:compression=2bit,compression_threshold=0.02,error_feedback=false",
    "topk": "dist_sync:compression=topk,compression_ratio=0.01",
    "topk no-ef": "dist_sync:compression=topk,compression_ratio=0.01,error_feedback=false",
}
ACCURACY = re.compile(r"worker (\d+): test accuracy ([0-9.]+)")


def run(strategy: str, epochs: int, timeout_s: float) -> tuple[float | str, float]:
    """(accuracy, seconds) of one digits job."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    launch = "import sys; from paratrain.launch.cli import main; sys.argv[0] = 'paratrain'; main()"
    command = [sys.executable, "-c", launch, "launch", "-w", "2", "-s", "1"]
    command += ["--", os.path.join(ROOT, "examples", "digits.py"), "--strategy", strategy]
    command += ["--epochs", str(epochs)]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    took = time.monotonic() - start
    found = {int(m.group(1)): float(m.group(2)) for m in ACCURACY.finditer(done.stdout)}
    if done.returncode != 0 or len(found) != 2:
        print(f"{strategy} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
        return "failed", took
    return found[0], took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--runs", default=",".join(RUNS), help="which rows, by name")
    parser.add_argument("--timeout", type=float, default=900.0, help="limit per job (s)")
    parser.add_argument("--plot", metavar="PATH", help="also save a bar chart (needs matplotlib)")
    args = parser.parse_args()
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"--runs {unknown[0]!r} is not one of {', '.join(RUNS)}")
    if "uncompressed" not in names:
        names.insert(0, "uncompressed")  # the anchor
    rows = {name: run(RUNS[name], args.epochs, args.timeout) for name in names}
    anchor = rows["uncompressed"][0]
    print(
        f"digits, 2 workers + 1 server (dist_sync, Adam on the server), {args.epochs} epochs, "
        f"batch 32 per worker, {os.cpu_count()} cores"
    )
    table = [["run", "strategy", "test accuracy", "points vs uncompressed", "wall s"]]
    for name, (accuracy, took) in rows.items():
        diff = (
            f"{100 * (accuracy - anchor):+.1f}"
            if isinstance(anchor, float) and isinstance(accuracy, float)
            else "-"
        )
        shown = f"{accuracy:.3f}" if isinstance(accuracy, float) else accuracy
        table.append([name, RUNS[name], shown, diff, f"{took:.0f}"])
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    for line in table:
        print(" | ".join(text.ljust(width) for text, width in zip(line, widths, strict=True)))
    if args.plot:
        plot(args.plot, rows, args.epochs)


def plot(path: str, rows: dict, epochs: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    names = [n for n, (a, _) in rows.items() if isinstance(a, float)]
    if not names:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.barh(names, [rows[n][0] for n in names])
    ax.set_xlim(min(rows[n][0] for n in names) - 0.05, 1.0)
    ax.set_xlabel("test accuracy (higher is better)")
    ax.set_title(f"digits, dist_sync, 2 workers, {epochs} epochs")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
