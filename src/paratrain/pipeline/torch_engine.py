"""The pipeline engine on torch.distributed.pipelining: PipelineStage with ScheduleGPipe or
Schedule1F1B (engine="torch"), behind the same StagePipeline surface as runtime.py.

torch splits each batch with tensor_split, as we do, and divides gradients by the number of
micro-batches; the loss it backpropagates is ours times that number, so the gradient is again the
full batch's mean-loss gradient even when micro-batches differ in size. torch gives no hook around
a micro-batch's compute, so this engine wraps the stage's forward_one_chunk / backward_one_chunk
(instance attributes) to time them for the bubble fraction.

Where torch did not serve (torch 2.13, Gloo on CPU), besides what runtime.py's docstring lists:
PipelineStage infers the activation shapes once, from the first micro-batch of the first step, and
receives every later micro-batch into buffers of that shape. Micro-batches of unequal size (a batch
whose rows `micro_batches` does not divide) or a batch size that changes between steps then fail
deep inside the schedule with a shape mismatch; this engine refuses them up front with a ValueError,
and paratrain's engine (which sends each activation's shape) runs them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from paratrain.pipeline.api import PipelineConfig
from paratrain.pipeline.schedule import build_schedule, peak_in_flight
from paratrain.pipeline.stage import Clock, DistributedStage, LossFn, StagePlacement

logger = logging.getLogger(__name__)

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class TorchPipeline(DistributedStage):
    """One stage of a pipeline run by torch.distributed.pipelining (see module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        config: PipelineConfig,
        placement: StagePlacement,
        loss_fn: LossFn,
        sync: Callable[[], None] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(module, config, placement, loss_fn, sync)
        self._rows = 0
        self._batch_rows: int | None = None
        self._clock = Clock(self.device)
        self.torch_stage = PipelineStage(
            module, placement.stage, placement.num_stages, self.device, group=group
        )
        for name in ("forward_one_chunk", "backward_one_chunk"):
            setattr(self.torch_stage, name, self._timed(getattr(self.torch_stage, name)))
        schedule_class = TORCH_SCHEDULES[config.schedule]
        self.schedule = schedule_class(self.torch_stage, config.micro_batches, loss_fn=self._torch_loss)
        ours = build_schedule(config.schedule, placement.num_stages, config.micro_batches)[placement.stage]
        self._peak = peak_in_flight(ours)  # torch's loops run the same orders

    def _check_batch(self, micro_batches: tuple[torch.Tensor, ...] | None) -> None:
        if micro_batches is None:
            return  # a middle stage sees no batch
        rows = sum(mb.shape[0] for mb in micro_batches)
        if len({mb.shape[0] for mb in micro_batches}) > 1:
            raise ValueError(
                f"engine='torch' needs equal micro-batches: {rows} rows do not split into "
                f"micro_batches={len(micro_batches)} equal parts (engine='paratrain' runs them)"
            )
        if self._batch_rows is not None and rows != self._batch_rows:
            raise ValueError(
                f"engine='torch' fixes the batch size at the first step ({self._batch_rows} rows); "
                f"this batch has {rows} (engine='paratrain' runs them)"
            )
        self._batch_rows = rows

    def _timed(self, method: Callable) -> Callable:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self._clock.busy():
                return method(*args, **kwargs)

        return timed

    def _torch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._weighted_loss(output, target, self._rows) * self.config.micro_batches

    def _run(self, xs: tuple[torch.Tensor, ...] | None, ys: tuple[torch.Tensor, ...] | None) -> tuple:
        self._clock = Clock(self.device)
        self._at = f"torch {self.config.schedule} schedule step"
        args = (torch.cat(xs).to(self.device),) if xs is not None else ()  # the first stage's inputs
        losses: list[torch.Tensor] = []
        if ys is not None:  # the last stage
            self._rows = sum(y.shape[0] for y in ys)
            self.schedule.step(*args, target=torch.cat(ys).to(self.device), losses=losses)
        else:
            self.schedule.step(*args)
        loss = None
        if self.is_last_stage:
            loss = torch.stack([loss.detach() for loss in losses]).sum() / self.config.micro_batches
        return loss, self._clock.busy_s, self._peak
