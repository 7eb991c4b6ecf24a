"""The digits job (examples/digits.py's model and loop) in an elastic job (JobConfig.elastic,
min_workers 2) whose worker KILL_RANK SIGKILLs itself in the middle of epoch 1 (argument
`--kill RANK`), as a lost host would die; a replacement started by `--max-restarts` joins the job
and does not. Every worker prints its test accuracy and the epochs it trained."""

import argparse
import os
import signal

import torch
from torch import nn
from torch.utils.data import DataLoader

import paratrain
from paratrain.data import digits

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--kill", type=int, default=None, help="the rank that dies mid-epoch 1")
args = parser.parse_args()

config = paratrain.JobConfig(
    heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0, elastic=paratrain.ElasticConfig(min_workers=2)
)
ctx = paratrain.init(config)
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
optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
loader = DataLoader(digits(train=True), batch_size=32, shuffle=True)
trainer = paratrain.Trainer(model, optimizer, loader, strategy="dist_sync", progress=False)
trained = []
for epoch in trainer.epochs(args.epochs):
    trained.append(epoch)
    for step, (images, labels) in enumerate(trainer.loader):
        if epoch == 1 and step == 4 and ctx.rank == args.kill and not ctx.joined:
            os.kill(os.getpid(), signal.SIGKILL)
        trainer.step(nn.functional.cross_entropy(trainer.model(images), labels))
trainer.close()

test = digits(train=False)
trainer.model.eval()
with torch.no_grad():
    accuracy = (trainer.model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
print(
    f"worker {ctx.rank}: test accuracy {accuracy:.4f} epochs {trained} joined {ctx.joined} steps {trainer.steps}"
)
