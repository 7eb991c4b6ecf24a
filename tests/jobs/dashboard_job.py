"""A job to watch: workers train a small model with the Trainer until the test says stop.

argv: FOLDER   The test creates FOLDER/stop to end training; every 5 steps the workers agree (a
barrier) whether either saw it, so they stop after the same step. Then worker 0 writes
FOLDER/stats.json ({"kv": kv.stats(), "steps": {rank: steps}}); each worker flushes its timeline,
prints "ready" and waits for FOLDER/end (the test kills worker 1 meanwhile; worker 0 is stopped
when the scheduler aborts the job).
"""

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.metrics.trace import tracer
from paratrain.train import Trainer

ctx = paratrain.init()
folder = Path(sys.argv[1])
torch.manual_seed(0)
x = torch.randn(512, 16)
y = x @ torch.randn(16, 1) + 0.1 * torch.randn(512, 1)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
trainer = Trainer(model, optimizer, loader, progress=False)

deadline = time.monotonic() + 90
stop = False
while not stop:
    for inputs, targets in trainer.loader:
        trainer.step(nn.functional.mse_loss(trainer.model(inputs), targets))
        time.sleep(0.03)  # steps the test can watch
        if trainer.steps % 5 == 0:
            seen = ctx.barrier(name=f"stop-{trainer.steps}", data=(folder / "stop").exists())
            if any(seen.values()) or time.monotonic() > deadline:
                stop = True
                break

steps = ctx.barrier(name="steps", data=trainer.steps)
if ctx.rank == 0:
    stats = {str(key): value for key, value in trainer.engine.kv.stats().items()}
    (folder / "stats.tmp").write_text(json.dumps({"kv": stats, "steps": steps}))
    (folder / "stats.tmp").replace(folder / "stats.json")
tracer().flush()
print("ready", flush=True)
while not (folder / "end").exists() and time.monotonic() < deadline + 60:
    time.sleep(0.1)
