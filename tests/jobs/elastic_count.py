"""An exact counting job for an engine's restarts (tests/test_ray.py, tests/test_slurm.py): an
elastic dist_sync job (JobConfig.elastic, min_workers 1) whose one weight gains exactly 1 per round.

Every worker's loss is -w, so every push is -1; a round's mean is -1 however many workers pushed it,
and the servers' SGD at lr 1 adds 1. After the job w must equal the rounds run, which the worker
that never died counts as its own steps; a round lost or applied twice shows. The data (24 items,
batches of 2) is divided over the members at each epoch's start: 6 steps each for 2 members.

`--kill RANK:EPOCH` (repeatable): the worker of that rank then (the first process, or the replacement
that reached that epoch) SIGKILLs itself at its second step; `RANK:EPOCH:parent` SIGKILLs its parent
instead, and dies with it: under Ray the parent is the process's actor, and losing it is what losing
the node looks like to the driver. The engine starts a replacement (`--max-restarts`). The others
wait at the end of that epoch until the replacement registered (the membership's generation went
up twice: the drop, the registration), so it joins at the next epoch. Every worker prints one line:
`worker R: weight W steps S epochs [..] joined J`.
"""

import argparse
import os
import signal

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--kill", action="append", default=[], help="RANK:EPOCH[:parent]")
args = parser.parse_args()
kills = {(int(rank), int(epoch)): how for rank, epoch, *how in (kill.split(":") for kill in args.kill)}
killed_in = {epoch for _, epoch in kills}

# A SIGKILLed worker is dropped as its connection closes; the long heartbeat timeout only keeps a
# loaded test machine's slow heartbeats from dropping a live one.
config = paratrain.JobConfig(heartbeat_timeout_s=30.0, elastic=paratrain.ElasticConfig(min_workers=1))
ctx = paratrain.init(config)
model = nn.Linear(1, 1, bias=False)
nn.init.zeros_(model.weight)
optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
loader = DataLoader(TensorDataset(torch.arange(24.0)), batch_size=2)
trainer = paratrain.Trainer(model, optimizer, loader, strategy="dist_sync", progress=False)
steps, trained = 0, []
for epoch in trainer.epochs(args.epochs):
    trained.append(epoch)
    generation = ctx.link.membership.generation
    for step, _batch in enumerate(trainer.loader):
        if (ctx.rank, epoch) in kills and step == 1:
            os.kill(os.getppid() if kills[ctx.rank, epoch] == ["parent"] else os.getpid(), signal.SIGKILL)
            signal.pause()  # dies with its parent
        trainer.step(-trainer.model.weight.sum())
        steps += 1
    if epoch in killed_in:  # the dead worker's replacement registered: it meets us at the next epoch
        seen = ctx.link.membership
        while seen.generation < generation + 2:
            seen = ctx.link.wait_members(seen.generation, timeout_s=120.0)
trainer.close()
weight = trainer.model.weight.item()
print(f"worker {ctx.rank}: weight {weight:g} steps {steps} epochs {trained} joined {ctx.joined}", flush=True)
