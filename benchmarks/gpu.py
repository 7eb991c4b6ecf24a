"""Every GPU check the project has, and what the GPUs give training, in one short run.

    python benchmarks/gpu.py                        # on a machine with CUDA: a few minutes
    python benchmarks/gpu.py --device cpu --quick   # the same path on the CPU (Gloo): a smoke test

1. The tests marked `cuda` (`pytest -m cuda` over the test files that have them): a model, its
   batches and its optimizer's steps on the GPU through paratrain.prepare (tests/test_loops.py).
2. Training throughput of examples/gpt.py's model (AdamW with its two parameter groups, random
   tokens) with one worker per GPU (2 workers on the CPU), in fp32 and bf16:
   - torch DDP on NCCL (Gloo on the CPU), autocast around the forward for bf16: the anchor;
   - paratrain collective (paratrain.Trainer, Strategy.precision), launched as a paratrain job
     (this file again, in --paratrain-role mode).
   Each figure is samples/s over all workers (the slowest worker's time for `--steps` steps after
   `--warmup` untimed ones, the GPU synchronised before the clock stops). The ratios: paratrain
   collective over DDP at each precision, and bf16 over fp32 for each.

With the default --device cuda and no CUDA device visible it prints why and exits 0 (nothing to
check). The table is also saved under runs/bench/ (benchmarks/_plot.py).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "examples"))

import _anchors  # noqa: E402
import _jobs  # noqa: E402
import _plot  # noqa: E402

RESULT = re.compile(r"GPUBENCH rank=(\d+) seconds=([0-9.eE+-]+) steps=(\d+)")
SIZES = {  # gpt.py's model: width, layers, heads, context, sequences per worker
    "full": {"width": 512, "layers": 8, "heads": 8, "context": 256, "batch": 32},
    "quick": {"width": 32, "layers": 2, "heads": 4, "context": 32, "batch": 8},
}
AUTOCAST = {"32": None, "bf16": torch.bfloat16}


def build(size: dict, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """examples/gpt.py's model and optimizer (AdamW, no weight decay on biases and norms)."""
    import gpt as example  # examples/gpt.py

    torch.manual_seed(0)
    model = example.gpt(256, size["width"], size["layers"], size["heads"], size["context"]).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return model, torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95))


def tokens(size: dict, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 256, (size["batch"], size["context"] + 1), generator=g)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def timed(step: Any, warmup: int, steps: int, device: torch.device, before: Any = None) -> float:
    """Seconds for `steps` steps after `warmup` untimed ones, the device's queue drained at both ends."""
    for _ in range(warmup):
        step()
    if before is not None:
        before()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


# ------------------------------------------------------------------------------- torch DDP (anchor)
def ddp_process(
    rank: int, workers: int, port: int, args: argparse.Namespace, precision: str, results: Any
) -> None:
    import torch.distributed as dist

    cuda = args.device == "cuda"
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=workers)
    size = SIZES[args.size]
    model, optimizer = build(size, device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    x, y = tokens(size, rank, device)
    dtype = AUTOCAST[precision]

    def step() -> None:
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(x)
        loss_of(logits, y).backward()
        optimizer.step()

    results.put(timed(step, args.warmup, args.steps, device, dist.barrier))
    dist.destroy_process_group()


def ddp(args: argparse.Namespace, workers: int, precision: str) -> float:
    port = _anchors.free_port()
    with _anchors.Children(args.timeout) as kids:
        for rank in range(workers):
            kids.start(f"ddp rank {rank}", ddp_process, rank, workers, port, args, precision)
        return max(kids.collect(workers))


# ------------------------------------------------------------------------------- paratrain
def paratrain_role(args: argparse.Namespace) -> None:
    import paratrain

    ctx = paratrain.init()
    if ctx.device.type == "cpu":
        torch.set_num_threads(1)
    size = SIZES[args.size]
    model, optimizer = build(size, ctx.device)
    trainer = paratrain.Trainer(
        model, optimizer, strategy=f"collective:precision={args.precision}", progress=False
    )
    x, y = tokens(size, ctx.rank, trainer.device)

    def step() -> None:
        trainer.step(loss_of(trainer.model(x), y))

    seconds = timed(step, args.warmup, args.steps, trainer.device, lambda: ctx.barrier(name="timing"))
    print(f"GPUBENCH rank={ctx.rank} seconds={seconds:.6f} steps={trainer.steps}", flush=True)
    trainer.close()


def paratrain_job(args: argparse.Namespace, workers: int, precision: str) -> float:
    role_args = ["--paratrain-role", "--precision", precision, "--size", args.size, "--device", args.device]
    role_args += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    found = _jobs.run_role_job(os.path.abspath(__file__), role_args, workers, 0, args.timeout, RESULT)
    if found is None:
        raise RuntimeError(f"the paratrain job ({precision}) failed")
    return max(float(seconds) for _, seconds, _ in found)


# ------------------------------------------------------------------------------- the checks
def cuda_tests(args: argparse.Namespace) -> str:
    """`pytest -m cuda` over the test files that mark tests so; its summary line."""
    files = sorted(
        str(path) for path in (ROOT / "tests").glob("test_*.py") if "mark.cuda" in path.read_text()
    )
    if not files:
        return "no test is marked cuda"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider", *files]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    for line in lines:
        if line.startswith(("FAILED", "ERROR", "SKIPPED")):
            print(f"  {line}")
    summary = lines[-1] if lines else run.stderr.strip()[-300:]
    return f"{summary} ({'ok' if run.returncode == 0 else f'exit code {run.returncode}'})"


def setup_line(args: argparse.Namespace, workers: int) -> str:
    size = SIZES[args.size]
    where = (
        f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
        if args.device == "cuda"
        else "CPU, 1 thread per worker"
    )
    model = (
        f"gpt.py's model (width {size['width']}, {size['layers']} layers, {size['heads']} heads, "
        f"context {size['context']}), AdamW, {size['batch']} sequences per worker"
    )
    return (
        f"{model}; {workers} worker(s) on {where}; {os.cpu_count()} cores; torch {torch.__version__}; "
        f"{args.steps} steps after {args.warmup}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="a tiny model and a few steps (the CPU path)")
    parser.add_argument("--steps", type=int, help="timed steps (default 30, 3 with --quick)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 5, 1 with --quick)")
    parser.add_argument("--timeout", type=float, default=240.0, help="limit per measurement (s)")
    parser.add_argument("--paratrain-role", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="32", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="full", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.paratrain_role:
        paratrain_role(args)
        return
    args.size = "quick" if args.quick else "full"
    args.steps = args.steps or (3 if args.quick else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"benchmarks/gpu.py: skipped: no CUDA device is visible here (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda}); `--device cpu --quick` runs the same path on the CPU"
        )
        return
    workers = torch.cuda.device_count() if args.device == "cuda" else 2
    print(f"tests marked cuda: {cuda_tests(args)}")
    rates: dict[str, float | str] = {}
    for precision in ("32", "bf16"):
        for name, run in (("torch DDP", ddp), ("paratrain collective", paratrain_job)):
            label = f"{name} {'fp32' if precision == '32' else precision}"
            seconds = _anchors.attempt(label, run, args, workers, precision)
            batch = SIZES[args.size]["batch"]
            rates[label] = workers * batch * args.steps / seconds if isinstance(seconds, float) else "failed"
    setup = setup_line(args, workers)
    print(setup)
    head, rows = ["run", "samples/s", "x DDP (same precision)", "bf16 / fp32"], []
    for label, rate in rates.items():
        name, precision = label.rsplit(" ", 1)
        anchor, fp32 = rates[f"torch DDP {precision}"], rates[f"{name} fp32"]
        rows.append([label, f"{rate:.1f}" if isinstance(rate, float) else rate, _ratio(rate, anchor)])
        rows[-1].append(_ratio(rate, fp32) if precision == "bf16" else "-")
    for line in _plot.format_table(head, rows):
        print(line)
    _plot.save_table("gpu", setup, head, rows)


def _ratio(value: float | str, anchor: float | str) -> str:
    return f"{value / anchor:.3f}" if isinstance(value, float) and isinstance(anchor, float) else "-"


if __name__ == "__main__":
    main()
