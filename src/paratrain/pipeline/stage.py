"""What every multi-process pipeline engine shares: where its stage sits, and the step around it.

`DistributedStage.step` checks the batch, runs the engine's `_run` (the pipelined forward and backward
of every micro-batch), turns any exception into a PipelineError naming the stage, its rank and the
action it was at, syncs the gradients over the stage's replicas and records the step's StepStats
(bubble fraction = 1 - compute time / pipeline wall time), which it logs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from paratrain.pipeline import p2p
from paratrain.pipeline.api import PipelineConfig, PipelineError, StagePipeline, StepStats

logger = logging.getLogger(__name__)

T = TypeVar("T")
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StagePlacement:
    """Where one process sits in the stages x replicas mesh."""

    stage: int
    num_stages: int
    replica: int
    replicas: int
    ranks: tuple[int, ...]
    """The worker ranks of this replica's pipeline, by stage."""

    @property
    def rank(self) -> int:
        return self.ranks[self.stage]

    @property
    def prev_rank(self) -> int | None:
        return self.ranks[self.stage - 1] if self.stage > 0 else None

    @property
    def next_rank(self) -> int | None:
        return self.ranks[self.stage + 1] if self.stage < self.num_stages - 1 else None

    @property
    def sender(self) -> int:
        """The rank of the stage before this one, which a stage but the first receives from."""
        assert self.prev_rank is not None, "the first stage receives no activations"
        return self.prev_rank

    @property
    def receiver(self) -> int:
        """The rank of the stage after this one, which a stage but the last sends to."""
        assert self.next_rank is not None, "the last stage sends no activations"
        return self.next_rank


def split_micro_batches(
    batch: torch.Tensor | None, micro_batches: int, what: str
) -> tuple[torch.Tensor, ...]:
    """`batch` cut along dim 0 into `micro_batches` pieces whose sizes differ by at most one row
    (TypeError naming `what` when it is not a tensor: a first stage not given its inputs)."""
    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"{what} must be a tensor, not {type(batch).__name__}")
    if batch.dim() == 0 or batch.shape[0] < micro_batches:
        raise ValueError(
            f"{what} of shape {tuple(batch.shape)} has fewer rows than micro_batches={micro_batches}"
        )
    return torch.tensor_split(batch, micro_batches)


@contextmanager
def eval_mode(module: nn.Module):  # noqa: ANN201
    """`module` in eval mode for the block, its own training flags restored after."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


class Clock:
    """Adds up the time spent inside `busy()` blocks: compute, as opposed to waiting for peers."""

    def __init__(self, device: torch.device) -> None:
        self.busy_s = 0.0
        self._cuda = device.type == "cuda"

    @contextmanager
    def busy(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._cuda:
                torch.cuda.synchronize()
            self.busy_s += time.perf_counter() - start


class DistributedStage(StagePipeline):
    """One stage of a pipeline spread over processes; engines implement `_run`."""

    def __init__(
        self,
        module: nn.Module,
        config: PipelineConfig,
        placement: StagePlacement,
        loss_fn: LossFn,
        sync: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(module, placement.stage, placement.num_stages, placement.replica, placement.replicas)
        self.config, self.placement, self.loss_fn = config, placement, loss_fn
        self.device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self._sync = sync
        self.steps = 0
        self._at = "start"
        """The action being run, for error messages."""

    def step(
        self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        m = self.config.micro_batches
        xs = split_micro_batches(inputs, m, "inputs") if self.is_first_stage else None
        ys = split_micro_batches(targets, m, "targets") if self.is_last_stage else None
        self._check_batch(xs or ys)
        start = time.perf_counter()
        loss, busy_s, peak = self._guarded(lambda: self._run(xs, ys))
        wall_s = time.perf_counter() - start
        sync_start = time.perf_counter()
        self._guarded(self.sync_gradients)
        self.last_stats = StepStats(wall_s, busy_s, peak, time.perf_counter() - sync_start)
        logger.info(
            "step %d stage %d: bubble %.3f (busy %.4f s of %.4f s), %d in flight at most, sync %.4f s",
            self.steps,
            self.stage,
            self.last_stats.bubble_fraction,
            busy_s,
            wall_s,
            peak,
            self.last_stats.sync_s,
        )
        self.steps += 1
        return loss

    def forward(self, inputs: torch.Tensor | None = None) -> torch.Tensor | None:
        """See StagePipeline.forward: micro-batch i goes stage to stage as training's forward does
        (the same point-to-point messages), with nothing kept for a backward."""
        xs = split_micro_batches(inputs, self.config.micro_batches, "inputs") if self.is_first_stage else None
        with eval_mode(self.module), torch.no_grad():
            return self._guarded(lambda: self._forward_only(xs))

    def _forward_only(self, xs: tuple[torch.Tensor, ...] | None) -> torch.Tensor | None:
        pending: p2p.Pending = []
        outputs = []
        for i in range(self.config.micro_batches):
            self._at = f"forward-only F{i}"
            if xs is not None:  # the first stage
                x = xs[i].to(self.device)
            else:
                x = p2p.recv_activation(self.placement.sender, self.device)
            out = self.module(x)
            if self.is_last_stage:
                outputs.append(out)
            else:
                p2p.send_activation(out, self.placement.receiver, pending)
        self._at = "the end of the forward-only pass (waiting for sends)"
        p2p.wait_all(pending)
        return torch.cat(outputs) if self.is_last_stage else None

    def _guarded(self, fn: Callable[[], T]) -> T:
        """fn(), with any exception but a PipelineError turned into one naming this stage."""
        try:
            return fn()
        except PipelineError:
            raise
        except Exception as exc:
            p = self.placement
            raise PipelineError(
                f"pipeline stage {p.stage} (rank {p.rank}, replica {p.replica}) failed at {self._at} "
                f"of step {self.steps}: {type(exc).__name__}: {exc}"
            ) from exc

    def sync_gradients(self) -> None:
        if self._sync is not None:
            self._at = "gradient sync"
            self._sync()

    def _check_batch(self, micro_batches: tuple[torch.Tensor, ...] | None) -> None:
        """Raises ValueError if the engine cannot run these micro-batches (any can, by default)."""

    def _run(
        self, xs: tuple[torch.Tensor, ...] | None, ys: tuple[torch.Tensor, ...] | None
    ) -> tuple[torch.Tensor | None, float, int]:
        """Run every micro-batch forward and backward; returns (loss or None, busy seconds, peak
        micro-batches in flight)."""
        raise NotImplementedError

    def _weighted_loss(self, output: torch.Tensor, target: torch.Tensor, rows: int) -> torch.Tensor:
        """The micro-batch's loss times its share of the batch: their sum is the batch's mean loss."""
        loss = self.loss_fn(output, target.to(output.device))
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(f"loss_fn must return a 0-d tensor (the micro-batch's mean loss), got {loss!r}")
        return loss * (target.shape[0] / rows)
