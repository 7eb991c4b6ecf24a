"""Model parallelism inside one process: each stage on a device, activations moved between them.

`place_on_devices` moves each stage module to its device and returns one module whose forward
carries the activation from device to device (autograd carries the gradient back). On a machine
without accelerators every device is the CPU and it runs all the same. `LocalPipeline` gives it the
StagePipeline surface: a step runs the micro-batches one after the other (one process issues the
work; on GPUs the devices' queues overlap what they can), and the gradient is the full batch's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from torch import nn

from paratrain.pipeline.api import PipelineConfig, StagePipeline, StepStats
from paratrain.pipeline.stage import LossFn, eval_mode, split_micro_batches

logger = logging.getLogger(__name__)


def local_devices(count: int) -> list[torch.device]:
    """`count` devices for `count` stages: the CUDA devices in turn, or the CPU for each."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [torch.device("cuda", i % torch.cuda.device_count()) for i in range(count)]
    return [torch.device("cpu")] * count


class DevicePlacedSequential(nn.Module):
    """Stages run in order, each on its own device; the input moves to each stage's device."""

    def __init__(self, stages: Sequence[nn.Module], devices: Sequence[torch.device | str]) -> None:
        super().__init__()
        if len(stages) != len(devices):
            raise ValueError(f"place_on_devices: {len(stages)} stages but {len(devices)} devices")
        self.devices = [torch.device(d) for d in devices]
        self.stages = nn.ModuleList(stage.to(device) for stage, device in zip(stages, self.devices))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, device in zip(self.stages, self.devices):
            x = stage(x.to(device))
        return x

    @property
    def output_device(self) -> torch.device:
        return self.devices[-1]


def place_on_devices(
    stages: Sequence[nn.Module], devices: Sequence[torch.device | str]
) -> DevicePlacedSequential:
    """One module running `stages[i]` on `devices[i]` (moved there), activations following."""
    return DevicePlacedSequential(stages, devices)


class LocalPipeline(StagePipeline):
    """All stages in this process (see module docstring); stage 0 of 1, holding the whole model."""

    def __init__(self, module: DevicePlacedSequential, config: PipelineConfig, loss_fn: LossFn) -> None:
        super().__init__(module, stage=0, num_stages=1)
        self.config, self.loss_fn = config, loss_fn
        self.placed = module

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        m = self.config.micro_batches
        xs = split_micro_batches(inputs, m, "inputs")
        ys = split_micro_batches(targets, m, "targets")
        rows = sum(y.shape[0] for y in ys)
        start = time.perf_counter()
        losses = []
        for x, y in zip(xs, ys):
            out = self.module(x)
            loss = self.loss_fn(out, y.to(out.device)) * (y.shape[0] / rows)
            loss.backward()
            losses.append(loss.detach())
        wall_s = time.perf_counter() - start
        # One process runs one stage at a time: each device is busy 1/stages of the step.
        stages = len(self.placed.devices)
        self.last_stats = StepStats(wall_s, wall_s / stages, min(1, m))
        return torch.stack(losses).sum()  # in the loss's dtype

    def forward(self, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """See StagePipeline.forward: the micro-batches one after the other through every stage."""
        xs = split_micro_batches(inputs, self.config.micro_batches, "inputs")
        with eval_mode(self.module), torch.no_grad():
            return torch.cat([self.module(x) for x in xs])
