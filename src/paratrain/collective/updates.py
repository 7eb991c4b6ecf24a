"""Top-k under the collective strategy: the optimizer's update travels, not the gradient.

    updates = CompressedUpdates(module, CompressionConfig("topk", ratio=0.01))   # no DDP around it
    updates.before_step(); optimizer.step(); updates.after_step()

Why the update (CompressionConfig.sends_updates): top-k with error feedback delays small elements
for many steps, and an adaptive optimizer (Adam) fed their accumulated gradient in one step moves
them by about one step's size instead of one per step. So every rank steps its own optimizer on its
own gradients; then each parameter's update (before - after) is averaged: a compressible one
all-gathers every rank's top-k payload (with this rank's error feedback per parameter) and every
rank decodes and sums them in rank order; the rest are all-reduced in one flat buffer. Every rank
then sets before - mean, so parameters stay equal (they start as rank 0's). Optimizer state is per
rank. The residuals are saved per parameter, as the gradient hooks' are (compression.save).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.collective.compression import ATTRIBUTE
from paratrain.collective.ddp import all_reduce_mean, broadcast_parameters
from paratrain.compression import CompressionConfig, compressible, make_codec


class CompressedUpdates:
    """One rank's exchange of compressed optimizer updates (see the module docstring)."""

    saves_residuals = True  # compression.save() and restore() take it

    def __init__(self, module: nn.Module, config: CompressionConfig) -> None:
        self.config = config
        self.codec = make_codec(config)
        self.params = list(module.parameters())
        self.residuals: dict[int, torch.Tensor] = {}  # per parameter index, flat
        self.before: list[torch.Tensor] = []
        broadcast_parameters(module)
        setattr(module, ATTRIBUTE, self)  # compression.save / restore find it here

    @torch.no_grad()
    def before_step(self) -> None:
        if not self.before:
            self.before = [torch.empty_like(p) for p in self.params]
        for p, before in zip(self.params, self.before, strict=True):
            before.copy_(p)

    @torch.no_grad()
    def after_step(self) -> None:
        """Average the updates over the ranks (compressed where the config says) and apply them."""
        plain = []
        for i, (p, before) in enumerate(zip(self.params, self.before, strict=True)):
            update = (before - p).reshape(-1)
            if not p.requires_grad or not compressible(update.dtype, update.numel(), self.config):
                plain.append((p, before, update))
                continue
            mean = self._gathered_mean(i, update)
            p.copy_(before - mean.view_as(p))
        all_reduce_mean([update for _, _, update in plain])
        for p, before, update in plain:
            p.copy_(before - update.view_as(p))

    def _gathered_mean(self, i: int, update: torch.Tensor) -> torch.Tensor:
        residual = None
        if self.config.error_feedback:
            residual = self.residuals.get(i)
            if residual is None:
                residual = self.residuals[i] = torch.zeros_like(update)
        payload = self.codec.encode(update, residual)
        world = dist.get_world_size()
        gathered = [[torch.empty_like(t) for _ in range(world)] for t in payload]
        for out, t in zip(gathered, payload, strict=True):
            dist.all_gather(out, t)
        mean = torch.zeros_like(update)
        for rank in range(world):
            self.codec.decode([parts[rank] for parts in gathered], mean, add=True)
        return mean.div_(world)

    def state_dict(self) -> dict[str, Any]:
        return {
            "type": self.config.type,
            "params": list(self.residuals),
            "residuals": [t.clone() for t in self.residuals.values()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {
            i: t.reshape(-1).clone() for i, t in zip(state["params"], state["residuals"], strict=True)
        }
