"""The digits job (examples/digits.py's model and loop) as an elastic job (JobConfig.elastic,
min_workers 2). `--kill RANK:EPOCH` (repeatable): that worker SIGKILLs itself in the middle of that
epoch, as a lost host dies; a replacement (`paratrain launch --max-restarts`) joins the running job
and does not. `--join-by EPOCH`: the workers wait before that epoch until a replacement registered,
so that it surely joins while there is training left. Every worker prints its test accuracy."""

import argparse
import os
import signal

import torch
from digits_cnn import make_model  # beside this script
from torch import nn
from torch.utils.data import DataLoader

import paratrain
from paratrain.data import digits

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--kill", action="append", default=[], help="RANK:EPOCH")
parser.add_argument("--join-by", type=int, default=None)
parser.add_argument("--lr", type=float, default=5e-3)
args = parser.parse_args()
kills = {tuple(int(x) for x in kill.split(":")) for kill in args.kill}

config = paratrain.JobConfig(heartbeat_timeout_s=5.0, elastic=paratrain.ElasticConfig(min_workers=2))
ctx = paratrain.init(config)
model = make_model()
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
loader = DataLoader(digits(train=True), batch_size=32, shuffle=True)
trainer = paratrain.Trainer(model, optimizer, loader, strategy="dist_sync", progress=False)
trained = []
for epoch in trainer.epochs(args.epochs):
    trained.append(epoch)
    for step, (images, labels) in enumerate(trainer.loader):
        if step == 4 and (ctx.rank, epoch) in kills and not ctx.joined:
            os.kill(os.getpid(), signal.SIGKILL)
        trainer.step(nn.functional.cross_entropy(trainer.model(images), labels))
    if epoch + 1 == args.join_by and not ctx.joined:
        seen = ctx.link.membership
        while not seen.joiners:
            seen = ctx.link.wait_members(seen.generation, timeout_s=120.0)
trainer.close()

test = digits(train=False)
trainer.model.eval()
with torch.no_grad():
    accuracy = (trainer.model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
print(f"worker {ctx.rank}: test accuracy {accuracy:.4f} epochs {trained} joined {ctx.joined}")
