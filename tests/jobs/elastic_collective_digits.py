"""The digits job (examples/digits.py) under `collective` with elasticity on; one worker may SIGKILL
itself mid-epoch: `--kill RANK --at EPOCH BATCH`. A marker file beside `--marker` makes the kill happen
once, so a replacement of that worker (`paratrain launch --max-restarts`) trains on."""

import argparse
import os
import signal
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import paratrain
from paratrain.cluster.config import ElasticConfig, JobConfig
from paratrain.data import digits

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--lr", type=float, default=4e-3)
parser.add_argument("--kill", type=int, default=None, help="this worker rank SIGKILLs itself")
parser.add_argument("--at", type=int, nargs=2, default=(1, 5), metavar=("EPOCH", "BATCH"))
parser.add_argument("--marker", default=None, help="a file: the kill happens only where it is absent")
args = parser.parse_args()

ctx = paratrain.init(JobConfig(heartbeat_timeout_s=3.0, elastic=ElasticConfig(min_workers=2)))
torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1),
    nn.ReLU(),
    nn.Conv2d(16, 32, 3, padding=1),
    nn.ReLU(),
    nn.MaxPool2d(2),
    nn.Flatten(),
    nn.Linear(32 * 4 * 4, 64),
    nn.ReLU(),
    nn.Linear(64, 10),
)
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
loader = DataLoader(digits(train=True), batch_size=32, shuffle=True)
trainer = paratrain.Trainer(model, optimizer, loader, strategy="collective", progress=False)


def kill_here(epoch: int, batch: int) -> bool:
    if ctx.rank != args.kill or (epoch, batch) != tuple(args.at):
        return False
    if args.marker is not None:
        if Path(args.marker).exists():
            return False
        Path(args.marker).touch()
    return True


for epoch in trainer.epochs(args.epochs):
    for batch, (images, labels) in enumerate(trainer.loader):
        if kill_here(epoch, batch):
            print(f"worker {ctx.rank}: killing myself at epoch {epoch}, batch {batch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        trainer.step(nn.functional.cross_entropy(trainer.model(images), labels))
trainer.close()

test = digits(train=False)
with torch.no_grad():
    predicted = trainer.eval_step(test.tensors[0]).argmax(1)
accuracy = (predicted == test.tensors[1]).float().mean().item()
members = ctx.link.membership.workers if ctx.link is not None and ctx.link.membership else ()
print(f"worker {ctx.rank}: test accuracy {accuracy:.4f} after {trainer.steps} steps, members {list(members)}")
