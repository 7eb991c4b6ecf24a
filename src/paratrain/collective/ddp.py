"""Collective data parallel. Gradient averaging is torch's DistributedDataParallel: its reducer already
buckets gradients in reverse order of use and all-reduces each bucket while backward goes on, which is
the overlap the design asks for; paratrain adds compression hooks (compression.py), local SGD and the
choice of backend.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratrain.collective import compression as compression_hooks
from paratrain.compression import CompressionConfig


def backend_for(model: nn.Module) -> str:
    """nccl for a model on a GPU, gloo otherwise."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return "nccl" if device.type == "cuda" else "gloo"


def wrap_ddp(
    model: nn.Module,
    *,
    bucket_mb: float = 25.0,
    compression: str | dict | CompressionConfig | None = None,
    sync_buffers: bool = True,
) -> nn.Module:
    """`model` in DistributedDataParallel on the default process group; gradients are averaged
    over the world, compressed as `compression` says when given (collective/compression.py).
    `sync_buffers`: rank 0's buffers reach every rank at each forward (DDP's default)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    device_ids = [device] if device.type == "cuda" else None
    options: dict[str, Any] = {} if sync_buffers else {"forward_sync_buffers": False}
    ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_mb, **options)
    config = CompressionConfig.parse(compression)
    if config is not None:
        compression_hooks.register(ddp, config)
    return ddp


def _flat_groups(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by (device, dtype), so each group flattens into one buffer."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


@torch.no_grad()
def broadcast_parameters(module: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Every rank's parameters and buffers become worker rank `src`'s (its rank in the world, as
    torch.distributed takes `src` even with a `group`); one flat broadcast per dtype."""
    for same in _flat_groups([t.data for t in [*module.parameters(), *module.buffers()]]):
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.broadcast(flat, src, group=group)
        _copy_back(flat, same)


@torch.no_grad()
def all_reduce_mean(tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Every rank's `tensors` become their mean over the group (one flat all-reduce per dtype)."""
    world = dist.get_world_size(group)
    for same in _flat_groups(tensors):
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        _copy_back(flat, same)


def average_parameters(module: nn.Module) -> None:
    """Every rank's floating-point parameters become the mean over ranks."""
    all_reduce_mean([p.data for p in module.parameters() if p.is_floating_point()])


def _copy_back(flat: torch.Tensor, group: list[torch.Tensor]) -> None:
    offset = 0
    for t in group:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


class LocalSGD:
    """Local SGD: every rank steps on its own gradients, and every `period` optimizer steps the
    parameters are averaged over the ranks (Lin et al., "Don't use large mini-batches, use local SGD").
    Optimizer state stays per rank. Parameters start equal (rank 0's)."""

    def __init__(self, module: nn.Module, period: int) -> None:
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"local SGD period={period!r} must be an int >= 1")
        self.module = module
        self.period = period
        self.steps = 0
        broadcast_parameters(module)

    def after_step(self) -> bool:
        """Count one optimizer step; average the parameters when the period is full. Returns whether
        it averaged."""
        self.steps += 1
        if self.steps % self.period:
            return False
        average_parameters(self.module)
        return True
