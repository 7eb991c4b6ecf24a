"""Pipeline x data parallel meshes, and `pipeline_for`, which builds this process's part of one.

Rank layout: with p stages and r replicas (world = p * r), worker rank `q` runs stage `q % p` of
replica `q // p`; replica k's pipeline is ranks k*p .. k*p + p-1 (consecutive ranks are neighbour
stages), and the replicas of stage s are ranks s, s + p, s + 2p, ... For a 2 x 2 mesh:

    rank 0: stage 0, replica 0    rank 1: stage 1, replica 0
    rank 2: stage 0, replica 1    rank 3: stage 1, replica 1

Every rank builds the same groups in the same order (a torch.distributed rule): one per replica
(its pipeline, for the torch engine) and one per stage (its replicas, for the gradient sync).
In one process (a world of one) the stages go on local devices instead (local.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from paratrain.cluster.context import Context, current
from paratrain.collective import broadcast_parameters
from paratrain.pipeline.api import PipelineConfig, StagePipeline
from paratrain.pipeline.local import LocalPipeline, local_devices, place_on_devices
from paratrain.pipeline.split import Blocks, Split, as_blocks, split_model, stage_module
from paratrain.pipeline.stage import LossFn, StagePlacement
from paratrain.pipeline.sync import AllReduceSync, ServerSync

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeshLayout:
    """Which rank holds which (stage, replica); see the module docstring."""

    stages: int
    replicas: int

    @classmethod
    def for_world(cls, stages: int, world_size: int) -> MeshLayout:
        if world_size % stages:
            raise ValueError(
                f"PipelineConfig.stages={stages} does not divide the {world_size} workers into replicas"
            )
        return cls(stages, world_size // stages)

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of worker `rank`."""
        return rank % self.stages, rank // self.stages

    def rank_of(self, stage: int, replica: int) -> int:
        return replica * self.stages + stage

    def pipeline_ranks(self, replica: int) -> tuple[int, ...]:
        return tuple(self.rank_of(s, replica) for s in range(self.stages))

    def replica_ranks(self, stage: int) -> tuple[int, ...]:
        return tuple(self.rank_of(stage, k) for k in range(self.replicas))

    def placement(self, rank: int) -> StagePlacement:
        stage, replica = self.coords(rank)
        return StagePlacement(stage, self.stages, replica, self.replicas, self.pipeline_ranks(replica))


def build_groups(layout: MeshLayout, rank: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(this rank's pipeline group, this rank's replica group); None where the whole world (or
    nobody else) is the group. Every rank must call it, in the same order."""
    stage, replica = layout.coords(rank)
    pipeline_group = replica_group = None
    if layout.replicas > 1:
        for k in range(layout.replicas):
            group = dist.new_group(list(layout.pipeline_ranks(k)))
            pipeline_group = group if k == replica else pipeline_group
        for s in range(layout.stages):
            group = dist.new_group(list(layout.replica_ranks(s)))
            replica_group = group if s == stage else replica_group
    return pipeline_group, replica_group


def pipeline_for(
    model: Blocks,
    config: PipelineConfig,
    *,
    loss_fn: LossFn,
    sample_input: torch.Tensor | None = None,
    ctx: Context | None = None,
    device: torch.device | str = "cpu",
) -> StagePipeline:
    """This process's part of `model` pipelined as `config` says (see the package docstring).

    `model`: an nn.Sequential or list of blocks, built identically on every rank. `sample_input`: a
    micro-batch, to balance the split when config.split_points is None. `ctx`: what paratrain.init()
    returned (default: that). `device`: where this process's stage runs (multi-process jobs).
    """
    ctx = current(ctx)
    blocks = as_blocks(model)
    if ctx.num_workers == 1:
        return _local_pipeline(blocks, config, loss_fn, sample_input)
    from paratrain.cluster.rendezvous import init_torch_distributed

    device = torch.device(device)
    init_torch_distributed(ctx, "nccl" if device.type == "cuda" else "gloo")
    layout = MeshLayout.for_world(config.stages, ctx.num_workers)
    placement = layout.placement(ctx.rank)
    pipeline_group, replica_group = build_groups(layout, ctx.rank)
    split = _agreed_split(blocks, config, sample_input, ctx.rank, device)
    module = stage_module(blocks, split.stages[placement.stage]).to(device)
    sync = None
    if layout.replicas > 1:
        broadcast_parameters(module, layout.rank_of(placement.stage, 0), replica_group)
        sync = _replica_sync(ctx, config, module, placement, replica_group)
    logger.info(
        "pipeline: rank %d is stage %d of %d, replica %d of %d; blocks %s; %s schedule, %d micro-batches, "
        "engine %s, replica sync %s",
        ctx.rank,
        placement.stage,
        placement.num_stages,
        placement.replica,
        placement.replicas,
        split.stages[placement.stage],
        config.schedule,
        config.micro_batches,
        config.engine,
        config.replica_sync if sync else "none",
    )
    if config.engine == "torch":
        from paratrain.pipeline.torch_engine import TorchPipeline

        return TorchPipeline(module, config, placement, loss_fn, sync, group=pipeline_group)
    from paratrain.pipeline.runtime import Pipeline

    return Pipeline(module, config, placement, loss_fn, sync)


def _local_pipeline(
    blocks: list[nn.Module], config: PipelineConfig, loss_fn: LossFn, sample_input: torch.Tensor | None
) -> LocalPipeline:
    if config.stages == 1:
        split = Split([list(range(len(blocks)))], None)
    else:
        split = split_model(
            blocks,
            config.stages,
            sample_input=sample_input if config.split_points is None else None,
            split_points=config.split_points,
            repeats=config.profile_repeats,
        )
    devices = local_devices(config.stages)
    module = place_on_devices([stage_module(blocks, indices) for indices in split.stages], devices)
    return LocalPipeline(module, config, loss_fn)


def _agreed_split(
    blocks: list[nn.Module],
    config: PipelineConfig,
    sample_input: torch.Tensor | None,
    rank: int,
    device: torch.device,
) -> Split:
    """The same split on every rank: explicit points, or rank 0's measurement broadcast to all
    (timings differ between processes, and the stages must agree on where they cut)."""
    if config.stages == 1:
        return Split([list(range(len(blocks)))], None)
    if config.split_points is not None:
        return split_model(blocks, config.stages, split_points=config.split_points, verbose=rank == 0)
    points = torch.zeros(config.stages - 1, dtype=torch.int64)
    if rank == 0:
        if sample_input is None:
            raise ValueError("pipeline_for needs sample_input to balance the stages (or config.split_points)")
        measured = split_model(
            blocks, config.stages, sample_input=sample_input, repeats=config.profile_repeats
        )
        points = torch.tensor(measured.split_points, dtype=torch.int64)
    comm = points.to(device) if dist.get_backend() == "nccl" else points
    dist.broadcast(comm, 0)
    if rank == 0:
        return measured
    return split_model(blocks, config.stages, split_points=comm.cpu().tolist(), verbose=False)


def _replica_sync(
    ctx: Context,
    config: PipelineConfig,
    module: nn.Module,
    placement: StagePlacement,
    group: dist.ProcessGroup | None,
) -> ServerSync | AllReduceSync:
    if config.replica_sync == "ps":
        return ServerSync(
            ctx, module, placement.stage, placement.num_stages, placement.replica, placement.replicas, group
        )
    return AllReduceSync(module, group)
