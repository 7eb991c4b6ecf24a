"""The device mesh of a strategy: how the job's workers are laid on named dimensions.

Under Strategy(architecture="fsdp", tensor_parallel=t) the job's W workers are laid on a
DeviceMesh of dimensions ("dp", "tp") = (W / t, t), tensor innermost as torchtitan lays them:
ranks r and r+1 share a tensor-parallel group (the same host, where the traffic is heaviest) and
the W / t groups are data parallel replicas, each reading its own batches (train/tensor_parallel.py
runs it). Plain data: the launcher checks a job against it before any process starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paratrain.train.strategy import Strategy


def mesh_dims(strategy: Strategy, num_workers: int) -> dict[str, int]:
    """The mesh's dimensions {"dp": data replicas, "tp": tensor-parallel size} of a job of
    `num_workers` workers; ValueError naming the fields where they do not fit."""
    tp = strategy.tensor_parallel
    if num_workers % tp:
        fits = ", ".join(str(tp * k) for k in range(1, 4))
        raise ValueError(
            f"Strategy.tensor_parallel={tp} does not divide the job's {num_workers} worker(s): the "
            f"workers are data replicas x tensor_parallel, so launch with -w {fits}, ..."
        )
    return {"dp": num_workers // tp, "tp": tp}
