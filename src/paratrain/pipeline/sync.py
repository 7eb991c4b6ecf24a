"""How the replicas of one stage agree on its gradients after a pipelined step.

`AllReduceSync` (collective): this stage's gradients averaged within the group of that stage's
replicas (collective.all_reduce_mean: one flat all-reduce per dtype).

`ServerSync` (parameter server): each gradient is pushed to the job's servers under the key
"pipe<n>/stage<s>/<parameter name>" (n counts the pipelines this process built, the same on every
rank, so a second pipeline never meets the first one's rounds) and the round's sum pulled back
(pushpull, no server optimizer: the update stays on the workers), then divided by the number of
replicas. The servers take their member
set per server, not per key, so the replicas of one stage get servers of their own: stage s uses
servers s, s + p, s + 2p, ... (p = stages), which needs at least as many servers as stages.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from paratrain.collective import all_reduce_mean

if TYPE_CHECKING:
    from paratrain.cluster.context import Context

logger = logging.getLogger(__name__)

_server_syncs = itertools.count()


def _grads(params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    """Every parameter's gradient, zeros where backward left none, so every replica sends the same
    shapes in the same order."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


class AllReduceSync:
    """Average gradients over `group` (the replicas of one stage) by all-reduce."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.group = group

    def __call__(self) -> None:
        all_reduce_mean(_grads(self.params), self.group)


def stage_servers(servers: Sequence[tuple[str, int]], stage: int, stages: int) -> list[tuple[str, int]]:
    """The servers stage `stage` syncs through: every `stages`-th one, starting at `stage`."""
    if len(servers) < stages:
        raise ValueError(
            f"replica_sync='ps' needs at least one server per stage: {stages} stages, {len(servers)} servers"
        )
    return list(servers[stage::stages])


class ServerSync:
    """Average gradients over the replicas of one stage through the parameter servers."""

    def __init__(
        self,
        ctx: Context,
        module: nn.Module,
        stage: int,
        stages: int,
        replica: int,
        replicas: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        from paratrain.kvstore.api import KVStoreConfig
        from paratrain.kvstore.worker.client import DistKVStore

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        pipe = next(_server_syncs)
        self.keys = [f"pipe{pipe}/stage{stage}/{name}" for name, _ in named]
        self.replicas = replicas
        # The replicas of this stage act as a job of `replicas` workers on this stage's servers.
        servers = stage_servers(ctx.servers, stage, stages)
        view = dataclasses.replace(
            ctx, rank=replica, num_workers=replicas, servers=servers, num_servers=len(servers)
        )
        self.store = DistKVStore(
            view,
            KVStoreConfig(),
            members=list(range(replicas)),
            barrier=lambda _name: dist.barrier(group=group),
        )
        if self.keys:
            self.store.init(self.keys, [torch.zeros_like(p, device="cpu") for p in self.params])

    def __call__(self) -> None:
        grads = _grads(self.params)
        if not grads:
            return
        sums = [torch.empty_like(g, device="cpu") for g in grads]
        self.store.pushpull(self.keys, [g.detach().cpu() for g in grads], out=sums)  # the round's sum
        for g, total in zip(grads, sums):
            g.copy_(total.to(g.device) / self.replicas)
