"""What happens to the aggregated gradient between the engine's sync and the optimizer's step.

Every engine calls the Trainer's local step once the gradient in `.grad` is the job's aggregated
one (DDP's all-reduce during backward; the pulled mean with update_on='worker'; a pipeline stage's
replicas averaged). `GradientGate` runs there, in the order torch's recipe has
(`scaler.unscale_`, `clip_grad_norm_`, `scaler.step`, `scaler.update`):

1. fp16: unscale the gradient and look for inf/NaN (precision.LossScaler);
2. clipping: the global L2 norm of the gradient, as torch.nn.utils.clip_grad_norm_ computes it
   (its own two halves, get_total_norm and clip_grads_with_norm_), so one process on the global
   batch and any number of workers clip alike;
3. the step, unless an overflow was found; the loss scale follows.

Where no process holds the whole gradient (a pipeline: each stage its own parameters; fsdp: each
worker a shard of every one), `agree` sums [overflow, squared norm] over the processes that
together hold it: one all-reduce of two numbers. A sharded gradient (a DTensor) is then checked on
its local shard, so that each element counts once. Under tensor parallelism, where a DTensor may
be whole on several workers, there is no `agree`: the norm is torch's per device mesh, made whole,
then combined (`total_norm`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from paratrain.train.precision import LossScaler

logger = logging.getLogger(__name__)

Agree = Callable[[torch.Tensor], torch.Tensor]
"""Sums a small CPU tensor over the processes whose gradients together make the model's."""


class GradientGate:
    """See the module docstring. `scaler`: fp16's loss scaler, or None; `clip`: the max norm, or None."""

    def __init__(self, scaler: LossScaler | None, clip: float | None) -> None:
        self.scaler, self.clip = scaler, clip
        self.agree: Agree | None = None
        self.skipped = 0
        """Steps skipped because the gradient overflowed."""
        self.last_norm: float | None = None
        """The gradient's global norm before the last clipping."""

    @property
    def active(self) -> bool:
        return self.scaler is not None or self.clip is not None

    def step(self, optimizer: torch.optim.Optimizer, local_step: Callable[[], Any]) -> Any:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        if self.agree is not None:  # this process's part of the gradient
            grads = [_local(grad) for grad in grads]
        found = self.scaler.unscale_(grads) if self.scaler is not None else torch.zeros(1)
        norm = total_norm(grads) if self.clip is not None else None
        if self.agree is not None:
            local_sq = norm.detach().float().cpu() ** 2 if norm is not None else torch.zeros(())
            summed = self.agree(torch.stack([found.reshape(()), local_sq.reshape(())]))
            found = (summed[0] > 0).float().reshape(1)
            if norm is not None:
                norm = summed[1].sqrt().to(norm.device, norm.dtype)
        if self.scaler is not None:
            self.scaler.update(found)
            if found.item() > 0:
                self.skipped += 1
                logger.info(
                    "step skipped: the gradient holds inf or NaN (loss scale now %g)", self.scaler.scale
                )
                return None
        if norm is not None and self.clip is not None:
            for same_mesh in _by_mesh(params, lambda p: p.grad).values():
                torch.nn.utils.clip_grads_with_norm_(same_mesh, self.clip, norm)
            self.last_norm = float(norm)
        return local_step()

    def scalars(self) -> dict[str, float]:
        """For the Trainer's metrics: the loss scale and the gradient's norm, where they exist."""
        out = {"loss_scale": self.scaler.scale} if self.scaler is not None else {}
        return out | ({"grad_norm": self.last_norm} if self.last_norm is not None else {})


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A sharded gradient's (DTensor's) shard on this process; a plain one as it is."""
    from torch.distributed.tensor import DTensor

    return grad.to_local() if isinstance(grad, DTensor) else grad


def _by_mesh(items: list[Any], tensor: Callable[[Any], Any] = lambda t: t) -> dict[Any, list[Any]]:
    """`items` grouped by the device mesh of their tensor (None: a plain tensor). torch's foreach
    norms and products take tensors of one mesh at a time."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[Any]] = {}
    for item in items:
        value = tensor(item)
        groups.setdefault(value.device_mesh if isinstance(value, DTensor) else None, []).append(item)
    return groups


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all of `grads`, as a plain tensor: torch's get_total_norm of each mesh's
    gradients (fsdp's shards, tensor parallelism's splits), made whole, then combined. Plain tensors
    (parameters a tensor-parallel group holds whole, alike on each of its workers) count once."""
    from torch.distributed.tensor import DTensor

    groups = _by_mesh(grads)
    if list(groups) == [None]:
        return torch.nn.utils.get_total_norm(grads)
    parts = []
    for same_mesh in groups.values():
        norm = torch.nn.utils.get_total_norm(same_mesh)
        parts.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.linalg.vector_norm(torch.stack([part.float() for part in parts]))
