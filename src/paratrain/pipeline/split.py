"""Cutting a model given as a sequence of blocks into pipeline stages.

`split_model` takes explicit split points, or measures each block's forward plus backward time on a
sample input (the median of a few runs, after a warm-up) and picks the contiguous cut that minimises
the slowest stage: a stage's time bounds the pipeline's throughput, whatever its parameter count.
It prints the chosen split and each stage's estimated time. Blocks pass one tensor to the next.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.pipeline.api import check_split_points

logger = logging.getLogger(__name__)

Blocks = nn.Sequential | Sequence[nn.Module]


@dataclass(frozen=True)
class Split:
    """Which blocks each stage holds, and what it was estimated to cost."""

    stages: list[list[int]]
    """Per stage, the indices of its blocks (consecutive)."""
    block_times_s: list[float] | None
    """Measured forward+backward time of each block (None when split by explicit points unmeasured)."""

    @property
    def split_points(self) -> tuple[int, ...]:
        return tuple(blocks[0] for blocks in self.stages[1:])

    @property
    def stage_times_s(self) -> list[float] | None:
        if self.block_times_s is None:
            return None
        return [sum(self.block_times_s[i] for i in blocks) for blocks in self.stages]

    def describe(self) -> str:
        times = self.stage_times_s
        lines = []
        for s, blocks in enumerate(self.stages):
            where = f"blocks {blocks[0]}-{blocks[-1]}" if len(blocks) > 1 else f"block {blocks[0]}"
            cost = f", est. {times[s] * 1e3:.3f} ms fwd+bwd" if times is not None else ""
            lines.append(f"  stage {s}: {where}{cost}")
        return f"pipeline split at {list(self.split_points)}:\n" + "\n".join(lines)


def as_blocks(model: Blocks) -> list[nn.Module]:
    """The blocks of an nn.Sequential or a list of modules."""
    if isinstance(model, nn.Sequential):
        return list(model)
    if isinstance(model, Sequence) and all(isinstance(b, nn.Module) for b in model):
        return list(model)
    raise TypeError(f"a pipelined model must be an nn.Sequential or a list of nn.Module, not {type(model)}")


def stage_module(blocks: Sequence[nn.Module], indices: Sequence[int]) -> nn.Module:
    """The blocks of one stage as one module (the blocks themselves, not copies)."""
    return nn.Sequential(*(blocks[i] for i in indices))


def split_model(
    model: Blocks,
    stages: int,
    *,
    sample_input: torch.Tensor | None = None,
    split_points: Sequence[int] | None = None,
    repeats: int = 3,
    verbose: bool = True,
) -> Split:
    """Cut `model` into `stages` stages: at `split_points` (first block of every stage but the first),
    or by balancing each block's measured forward+backward time on `sample_input` (a micro-batch).
    Prints the split and the per-stage estimate when `verbose`."""
    blocks = as_blocks(model)
    if not 1 <= stages <= len(blocks):
        raise ValueError(f"stages={stages} must be between 1 and the number of blocks ({len(blocks)})")
    times = profile_blocks(blocks, sample_input, repeats) if sample_input is not None else None
    if split_points is not None:
        points = check_split_points(split_points, stages, len(blocks))
    elif times is not None:
        points = balance(times, stages)
    else:
        raise ValueError("split_model needs sample_input to balance the stages, or explicit split_points")
    bounds = (0, *points, len(blocks))
    split = Split([list(range(a, b)) for a, b in zip(bounds, bounds[1:])], times)
    if verbose:
        print(split.describe(), flush=True)
    logger.info("%s", split.describe())
    return split


def profile_blocks(blocks: Sequence[nn.Module], sample_input: torch.Tensor, repeats: int = 3) -> list[float]:
    """Median forward+backward seconds of each block, fed what the blocks before it output."""
    times = []
    x = sample_input
    for block in blocks:
        runs = [_time_block(block, x) for _ in range(repeats + 1)][1:]  # the first run warms up
        times.append(statistics.median(runs))
        with torch.no_grad():
            x = block(x)
    for block in blocks:
        block.zero_grad(set_to_none=True)  # profiling must leave no gradient behind
    return times


def _time_block(block: nn.Module, x: torch.Tensor) -> float:
    x = x.detach().requires_grad_(x.is_floating_point())
    _sync(x)
    start = time.perf_counter()
    out = block(x)
    if out.requires_grad:
        out.backward(torch.ones_like(out))
    _sync(out)
    return time.perf_counter() - start


def _sync(tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)


def balance(times: Sequence[float], stages: int) -> tuple[int, ...]:
    """Split points cutting `times` into `stages` non-empty contiguous parts with the smallest
    largest part (dynamic programming over prefixes; ties go to the earliest cut)."""
    n = len(times)
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)

    def cost(a: int, b: int) -> float:
        return prefix[b] - prefix[a]

    # best[k][j]: the smallest max-part for the first j blocks in k parts; cut[k][j]: where part k starts
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], cost(i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    points, j = [], n
    for k in range(stages, 1, -1):
        j = cut[k][j]
        points.append(j)
    return tuple(reversed(points))
