"""All-reduce data parallelism on torch.distributed (Gloo on CPU, NCCL on GPU): DDP with compression
hooks, and local SGD. Used by train/; usable alone on any initialised process group."""

from __future__ import annotations

from paratrain.collective.ddp import (
    LocalSGD,
    all_reduce_mean,
    average_parameters,
    backend_for,
    broadcast_parameters,
    wrap_ddp,
)

__all__ = [
    "LocalSGD",
    "all_reduce_mean",
    "average_parameters",
    "backend_for",
    "broadcast_parameters",
    "wrap_ddp",
]
