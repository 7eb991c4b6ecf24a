"""The digits job (examples/digits.py's loop, a small MLP) under dist_sync with one backup worker, one
worker slowed on purpose (tests/test_backup_workers.py).

argv: RANK SLEEP_S EPOCHS   worker RANK's forward sleeps SLEEP_S more each step. Every worker
prints its test accuracy and the pushes the servers dropped as late so far (all workers', of
the key with most).
"""

import sys
import time

import torch
from digits_cnn import make_mlp  # beside this script
from torch import nn
from torch.utils.data import DataLoader

import paratrain
from paratrain.data import digits

slow_rank, sleep_s, epochs = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
ctx = paratrain.init()


class Slowed(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ctx.rank == slow_rank and self.training:
            time.sleep(sleep_s)
        return self.net(x)


model = Slowed(make_mlp())
optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
loader = DataLoader(digits(train=True), batch_size=32, shuffle=True)
trainer = paratrain.Trainer(model, optimizer, loader, strategy="dist_sync:backup_workers=1", progress=False)
for _epoch in trainer.epochs(epochs):
    for images, labels in trainer.loader:
        trainer.step(nn.functional.cross_entropy(trainer.model(images), labels))
late = max(key.get("late", 0) for key in trainer.engine.kv.stats().values())
trainer.close()

test = digits(train=False)
trainer.model.eval()
with torch.no_grad():
    accuracy = (trainer.model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
print(f"worker {ctx.rank}: test accuracy {accuracy:.4f} late pushes {late}", flush=True)
