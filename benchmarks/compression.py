"""What gradient compression costs in accuracy: the digits job (examples/digits.py) under dist_sync.

    python benchmarks/compression.py [--epochs 12] [--seeds 5] [--plot compression.png] [--runs NAME,...]

Setup: 2 workers and 1 server on this machine (paratrain launch), Adam (update_on="server": on the
servers, except for topk, whose workers step it and push its updates), batch 32 per worker. Every
row runs once per seed (`--seed` of the example: initial weights and data order); a run is
deterministic apart from float summation order. Rows: uncompressed (the anchor), 2bit (threshold
0.02 on the mean gradient) and topk (1%), each with and without error feedback (no-ef); `--arch
collective` runs them under the collective strategy instead (2 workers, DDP hooks). The figure is
the test accuracy (450 held-out digits) that both workers report (sync: they hold the same
weights): the mean over the seeds, its spread (min-max) and the mean difference from the anchor in
points, seed by seed.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RUNS = {
    "uncompressed": "",
    "2bit": "compression=2bit,compression_threshold=0.02",
    "2bit no-ef": "compression=2bit,compression_threshold=0.02,error_feedback=false",
    "topk": "compression=topk,compression_ratio=0.01",
    "topk no-ef": "compression=topk,compression_ratio=0.01,error_feedback=false",
}
ARCHS = {"ps": ("dist_sync", 1), "collective": ("collective", 0)}  # strategy, servers
ACCURACY = re.compile(r"worker (\d+): test accuracy ([0-9.]+)")


def run(strategy: str, servers: int, seed: int, epochs: int, timeout_s: float) -> tuple[float | None, float]:
    """(accuracy or None where the job failed, seconds) of one digits job."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    launch = "import sys; from paratrain.launch.cli import main; sys.argv[0] = 'paratrain'; main()"
    command = [sys.executable, "-c", launch, "launch", "-w", "2", "-s", str(servers)]
    command += ["--", os.path.join(ROOT, "examples", "digits.py"), "--strategy", strategy]
    command += ["--epochs", str(epochs), "--seed", str(seed)]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    took = time.monotonic() - start
    found = {int(m.group(1)): float(m.group(2)) for m in ACCURACY.finditer(done.stdout)}
    if done.returncode != 0 or len(found) != 2:
        print(f"{strategy} (seed {seed}) failed:\n{done.stderr[-3000:]}", file=sys.stderr)
        return None, took
    return found[0], took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=5, help="runs per row, seeds 0, 1, ...")
    parser.add_argument("--arch", choices=list(ARCHS), default="ps")
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
    base, servers = ARCHS[args.arch]
    strategies = {name: f"{base}:{RUNS[name]}" if RUNS[name] else base for name in names}
    rows: dict[str, list[tuple[float | None, float]]] = {name: [] for name in names}
    for seed in range(args.seeds):  # seed by seed, so that every row sees the same machine load
        for name in names:
            rows[name].append(run(strategies[name], servers, seed, args.epochs, args.timeout))
    print(
        f"digits, 2 workers{f' + {servers} server' if servers else ''} ({base}), {args.epochs} epochs, "
        f"batch 32 per worker, seeds 0-{args.seeds - 1}, {os.cpu_count()} cores"
    )
    print(table(rows, strategies))
    if args.plot:
        plot(args.plot, rows, f"digits, {base}, 2 workers, {args.epochs} epochs, {args.seeds} seeds")


def table(rows: dict[str, list[tuple[float | None, float]]], strategies: dict[str, str]) -> str:
    anchor = [a for a, _ in rows["uncompressed"]]
    lines = [
        [
            "run",
            "strategy",
            "accuracy mean",
            "min-max",
            "points vs uncompressed (spread)",
            "per seed",
            "s/job",
        ]
    ]
    for name, results in rows.items():
        accs = [a for a, _ in results]
        ok = [a for a in accs if a is not None]
        diffs = [100 * (a - b) for a, b in zip(accs, anchor, strict=True) if a is not None and b is not None]
        lines.append(
            [
                name,
                strategies[name],
                f"{statistics.mean(ok):.3f}" if ok else "failed",
                f"{min(ok):.3f}-{max(ok):.3f}" if ok else "-",
                f"{statistics.mean(diffs):+.1f} ({min(diffs):+.1f} to {max(diffs):+.1f})" if diffs else "-",
                " ".join("failed" if a is None else f"{a:.3f}" for a in accs),
                f"{statistics.mean(t for _, t in results):.0f}",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(" | ".join(t.ljust(w) for t, w in zip(line, widths, strict=True)) for line in lines)


def plot(path: str, rows: dict[str, list[tuple[float | None, float]]], title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    accs = {n: [a for a, _ in r if a is not None] for n, r in rows.items()}
    names = [n for n, a in accs.items() if a]
    if not names:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    means = [statistics.mean(accs[n]) for n in names]
    spread = [
        [m - min(accs[n]) for n, m in zip(names, means)],
        [max(accs[n]) - m for n, m in zip(names, means)],
    ]
    ax.barh(names, means, xerr=spread, capsize=4)
    ax.set_xlim(min(min(a) for a in accs.values() if a) - 0.05, 1.0)
    ax.set_xlabel("test accuracy, mean and min-max over seeds (higher is better)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


if __name__ == "__main__":
    main()
