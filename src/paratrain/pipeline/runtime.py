"""paratrain's pipeline engine: runs a schedule's action list (schedule.py) on point-to-point sends.

For each action of its stage, in order:
    F i: take micro-batch i (first stage) or receive its activation from the previous stage, run the
         stage forward, then send the output on (or, on the last stage, compute the loss weighted by
         the micro-batch's share of the batch); keep input and output for the backward.
    B i: receive the output's gradient from the next stage (the last stage starts from its loss), run
         the backward, which adds into the parameters' .grad, and send the input's gradient back.
Sends are asynchronous and waited for at the end of the step, so a stage never blocks on a peer
except for what it needs next. Only the compute counts as busy time; the rest is the bubble.

Why not torch.distributed.pipelining here: its single-stage schedules (ScheduleGPipe, Schedule1F1B)
are imperative loops, not data we can check and run; Schedule1F1B refuses fewer micro-batches than
stages; and its steps expose no per-action timing to measure the bubble with. Its PipelineStage and
schedules do run on Gloo, and torch_engine.py offers them as engine="torch", checked for parity
against this engine and single-process training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from paratrain.pipeline import p2p
from paratrain.pipeline.api import PipelineConfig
from paratrain.pipeline.schedule import FORWARD, Action, build_schedule, peak_in_flight
from paratrain.pipeline.stage import Clock, DistributedStage, LossFn, StagePlacement

logger = logging.getLogger(__name__)


class Pipeline(DistributedStage):
    """One stage of a pipeline over processes, running paratrain's schedules (see module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        config: PipelineConfig,
        placement: StagePlacement,
        loss_fn: LossFn,
        sync: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(module, config, placement, loss_fn, sync)
        self.actions: list[Action] = build_schedule(
            config.schedule, placement.num_stages, config.micro_batches
        )[placement.stage]

    def _run(self, xs: tuple[torch.Tensor, ...] | None, ys: tuple[torch.Tensor, ...] | None) -> tuple:
        clock = Clock(self.device)
        pending: p2p.Pending = []
        saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        rows = sum(y.shape[0] for y in ys) if ys is not None else 0
        losses: list[torch.Tensor] = []
        for action in self.actions:
            self._at = str(action)
            if action.kind == FORWARD:
                x, out = self._forward(action.micro_batch, xs, ys, rows, clock, pending)
                saved[action.micro_batch] = (x, out)
                if self.is_last_stage:
                    losses.append(out.detach())
            else:
                x, out = saved.pop(action.micro_batch)
                self._backward(x, out, clock, pending)
        self._at = "the end of the step (waiting for sends)"
        p2p.wait_all(pending)
        loss = torch.stack(losses).sum() if self.is_last_stage else None  # in the loss's dtype
        return loss, clock.busy_s, peak_in_flight(self.actions)

    def _forward(
        self,
        i: int,
        xs: tuple[torch.Tensor, ...] | None,
        ys: tuple[torch.Tensor, ...] | None,
        rows: int,
        clock: Clock,
        pending: p2p.Pending,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward of micro-batch i; returns (input, output), the output being the weighted loss on
        the last stage."""
        if xs is not None:  # the first stage
            x = xs[i].to(self.device)
        else:
            x = p2p.recv_activation(self.placement.sender, self.device)
            x.requires_grad_(x.is_floating_point())
        with clock.busy():
            out = self.module(x)
            if not isinstance(out, torch.Tensor):
                raise TypeError(
                    f"stage {self.stage} returned {type(out).__name__}; a stage must return one tensor"
                )
            if ys is not None:  # the last stage
                out = self._weighted_loss(out, ys[i], rows)
        if not self.is_last_stage:
            p2p.send_activation(out, self.placement.receiver, pending)
        return x, out

    def _backward(self, x: torch.Tensor, out: torch.Tensor, clock: Clock, pending: p2p.Pending) -> None:
        grad = None
        if not self.is_last_stage:
            if not out.is_floating_point():
                return  # the next stage sends no gradient for an integer activation
            grad = p2p.recv_gradient(out, self.placement.receiver)
        with clock.busy():
            if out.requires_grad:
                torch.autograd.backward(out, grad)
        if not self.is_first_stage and x.requires_grad:
            dx = x.grad if x.grad is not None else torch.zeros_like(x)
            p2p.send_gradient(dx, self.placement.sender, pending)
