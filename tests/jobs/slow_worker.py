"""A job with one worker slowed on purpose (tests/test_stragglers.py).

argv: RANK FROM TO STEPS [STRATEGY]   Every worker's forward takes 5 ms (a sleep: a step
of a real model's length, which the machine's load does not stretch), worker RANK's 55 ms from
step FROM to step TO. STRATEGY (default dist_sync) with the Trainer, heartbeats every 0.2 s (the
scheduler compares steps at each one).
"""

import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.train import Trainer

slow_rank, first, last, steps = (int(arg) for arg in sys.argv[1:5])
strategy = sys.argv[5] if len(sys.argv) > 5 else "dist_sync"
ctx = paratrain.init(paratrain.JobConfig(heartbeat_interval_s=0.2))


class Slowed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.055 if ctx.rank == slow_rank and first <= self.step < last else 0.005)
        return self.net(x)


torch.manual_seed(0)
data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
module = Slowed()
trainer = Trainer(
    module,
    torch.optim.SGD(module.parameters(), lr=0.01),
    DataLoader(data, batch_size=8),
    strategy=strategy,
    progress=False,
)
while trainer.steps < steps:
    for x, y in trainer.loader:
        module.step = trainer.steps
        trainer.step(nn.functional.mse_loss(trainer.model(x), y))
        if trainer.steps >= steps:
            break
print("done", trainer.steps, flush=True)
