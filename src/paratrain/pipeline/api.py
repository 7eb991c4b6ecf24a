"""The pipeline layer's configuration, errors and the interface every pipeline engine implements.

A pipeline runs one global batch as `micro_batches` micro-batches through `stages` consecutive pieces
of a model. `Pipeline` engines (runtime.py: paratrain's own; torch_engine.py: on
torch.distributed.pipelining; local.py: stages on the devices of one process) all expose the same
surface, `StagePipeline`, so the trainer does not care which one runs.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.errors import ParatrainError

logger = logging.getLogger(__name__)

SCHEDULES = ("gpipe", "1f1b")
ENGINES = ("paratrain", "torch")
REPLICA_SYNCS = ("allreduce", "ps")


class PipelineError(ParatrainError):
    """A pipeline stage failed (its forward, backward or loss raised, or a peer broke off); the
    message names the stage, its rank, the step and the action."""


def _positive_int(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name}={value!r} must be an int >= 1")


@dataclass(frozen=True)
class PipelineConfig:
    """How a model is cut into stages and how a batch flows through them."""

    stages: int = 1
    """Number of pipeline stages (consecutive pieces of the model). With several processes the
    world must be stages x replicas; in one process the stages go on local devices."""
    micro_batches: int = 1
    """Micro-batches per global batch (any number >= 1; a batch must have at least this many rows)."""
    schedule: str = "1f1b"
    """gpipe: every forward, then every backward. 1f1b: after a warm-up, one forward then one
    backward, so at most `stages` micro-batches are in flight on a stage."""
    split_points: Sequence[int] | None = None
    """Index of the first block of every stage but the first (stages - 1 strictly increasing ints),
    e.g. (2,) cuts blocks 0-1 | 2-end. None: balance the measured forward+backward time of blocks."""
    engine: str = "paratrain"
    """paratrain: our runtime executing the schedule's action lists. torch: PipelineStage and
    ScheduleGPipe / Schedule1F1B of torch.distributed.pipelining (1f1b then needs
    micro_batches >= stages)."""
    replica_sync: str = "allreduce"
    """How replicas of one stage agree on gradients: allreduce (collective), or ps (pushpull through
    the job's servers, keys prefixed by stage)."""
    profile_repeats: int = 3
    """Timed repetitions per block when balancing the split (the median counts)."""

    def __post_init__(self) -> None:
        for name in ("stages", "micro_batches", "profile_repeats"):
            _positive_int("PipelineConfig", name, getattr(self, name))
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PipelineConfig.schedule={self.schedule!r} is not one of {SCHEDULES}")
        if self.engine not in ENGINES:
            raise ValueError(f"PipelineConfig.engine={self.engine!r} is not one of {ENGINES}")
        if self.replica_sync not in REPLICA_SYNCS:
            raise ValueError(
                f"PipelineConfig.replica_sync={self.replica_sync!r} is not one of {REPLICA_SYNCS}"
            )
        if self.engine == "torch" and self.schedule == "1f1b" and self.micro_batches < self.stages:
            raise ValueError(
                f"PipelineConfig.micro_batches={self.micro_batches!r}: torch's Schedule1F1B needs "
                f"micro_batches >= stages ({self.stages}); use engine='paratrain' for fewer"
            )
        if self.split_points is not None:
            object.__setattr__(self, "split_points", check_split_points(self.split_points, self.stages))


def check_split_points(points: Sequence[int], stages: int, num_blocks: int | None = None) -> tuple[int, ...]:
    """`points` as a tuple, after checking it cuts `num_blocks` blocks into `stages` non-empty stages."""
    if isinstance(points, (str, bytes)) or not isinstance(points, Sequence):
        raise ValueError(f"PipelineConfig.split_points={points!r} must be a sequence of ints")
    points = tuple(points)
    if len(points) != stages - 1 or not all(isinstance(p, int) and not isinstance(p, bool) for p in points):
        raise ValueError(
            f"PipelineConfig.split_points={points!r} must be {stages - 1} ints for {stages} stages"
        )
    bounds = (0, *points) + ((num_blocks,) if num_blocks is not None else ())
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        limit = f" and < {num_blocks} blocks" if num_blocks is not None else ""
        raise ValueError(f"PipelineConfig.split_points={points!r} must be strictly increasing, >= 1{limit}")
    return points


@dataclass(frozen=True)
class StepStats:
    """What one stage measured during one pipelined step."""

    wall_s: float
    """From the start of step() to the last send of this stage's last backward."""
    busy_s: float
    """Time spent computing forward, loss and backward (not waiting for peers)."""
    in_flight_peak: int
    """Most micro-batches whose forward ran and whose backward had not, at once."""
    sync_s: float = 0.0
    """Time spent syncing gradients with the other replicas of this stage (after the pipeline)."""

    @property
    def bubble_fraction(self) -> float:
        """The share of the pipeline's wall time this stage sat idle: 1 - busy / wall."""
        return max(0.0, 1.0 - self.busy_s / self.wall_s) if self.wall_s > 0 else 0.0


class StagePipeline(ABC):
    """One process's part of a pipeline: its stage of the model and how to run a step.

    `step(inputs, targets)` runs one global batch (split into micro-batches) forward and backward
    and leaves on `module`'s parameters the gradient of the mean loss over the whole batch, added
    to what .grad held (as `loss.backward()` does): micro-batch losses are weighted by their share
    of the batch, so it equals single-process full-batch training for a mean-reducing `loss_fn`.
    With replicas > 1 the gradients are then averaged over the replicas of this stage. It returns
    the batch's mean loss (a 0-d tensor) on the last stage and None elsewhere.
    """

    def __init__(self, module: nn.Module, stage: int, num_stages: int, replica: int = 0, replicas: int = 1):
        self.module = module
        """This stage's part of the model; the optimizer steps its parameters."""
        self.stage, self.num_stages = stage, num_stages
        self.replica, self.replicas = replica, replicas
        self.last_stats: StepStats | None = None
        """What the last step measured."""

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def bubble_fraction(self) -> float | None:
        """This stage's idle share of the last step (None before the first step)."""
        return None if self.last_stats is None else self.last_stats.bubble_fraction

    @abstractmethod
    def step(
        self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """See the class docstring. The first stage needs `inputs`, the last `targets`; others
        ignore them (every rank may pass the whole batch)."""

    def forward(self, inputs: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward only (evaluation, serving): `inputs` cut into `micro_batches` micro-batches run
        through every stage with no autograd and the stage modules in eval mode (restored after);
        returns the outputs of the whole batch on the last stage and None elsewhere. Every stage
        calls it at the same point of its loop (the first stage needs `inputs`)."""
        raise NotImplementedError(f"{type(self).__name__} has no forward-only pass")

    def sync_gradients(self) -> None:  # noqa: B027 (a no-op unless there are replicas)
        """Average this stage's gradients over its replicas (step() calls it; no-op alone)."""

    def parameters(self) -> Iterator[nn.Parameter]:
        """This stage's parameters (those the optimizer steps)."""
        return self.module.parameters()
