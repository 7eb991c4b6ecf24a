"""A job with one worker slowed, or stuck, on purpose (tests/test_stragglers.py, test_stacks.py).

argv: MODE RANK FROM TO STEPS   MODE "compute": worker RANK sleeps 50 ms in its model's forward
from step FROM to step TO; "stuck": worker RANK sleeps an hour at step FROM (the test stops the job).
dist_sync with the Trainer, heartbeats every 0.2 s (the scheduler compares steps at each one).
"""

import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.train import Trainer

mode, slow_rank, first, last, steps = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    int(sys.argv[4]),
    int(sys.argv[5]),
)
ctx = paratrain.init(paratrain.JobConfig(heartbeat_interval_s=0.2))


class Slowed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ctx.rank == slow_rank and first <= self.step < last:
            time.sleep(0.05)
        return self.net(x)


def stuck() -> None:
    time.sleep(3600)  # the line test_stacks looks for


torch.manual_seed(0)
data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
module = Slowed()
trainer = Trainer(
    module,
    torch.optim.SGD(module.parameters(), lr=0.01),
    DataLoader(data, batch_size=8),
    strategy="dist_sync",
    progress=False,
)
while trainer.steps < steps:
    for x, y in trainer.loader:
        module.step = trainer.steps
        if mode == "stuck" and ctx.rank == slow_rank and trainer.steps == first:
            stuck()
        trainer.step(nn.functional.mse_loss(trainer.model(x), y))
        if trainer.steps >= steps:
            break
print("done", trainer.steps, flush=True)
