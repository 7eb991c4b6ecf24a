"""Resume job: a Trainer run that checkpoints every step, for tests that resume it and compare.

argv: strategy ckpt [stop=N] [wait=N]
  stop=N: exit after step N (its checkpoint written); wait=N: after step N, say "waiting at step N"
  and sleep until interrupted (a test sends SIGINT to the launcher).

The model is two networks trained side by side on one loss: "drop" has a Dropout layer (its masks
come from torch's global RNG, which a checkpoint saves and a resume restores), "plain" has none.
3 epochs of 5 steps (40 samples, a global batch of 8). At the end each worker prints the steps it
trained and a digest of each network's parameters: a resumed run must print the uninterrupted
run's digests (bit for bit) after the same number of steps.
"""

import hashlib
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.train import Trainer, unwrap

EPOCHS, SAMPLES, GLOBAL_BATCH = 3, 40, 8

ctx = paratrain.init()
strategy, ckpt = sys.argv[1], sys.argv[2]
opts = {name: int(value) for name, value in (a.split("=") for a in sys.argv[3:])}


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
        self.plain = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.drop(x), self.plain(x)


def digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(module.state_dict().items()):
        h.update(name.encode() + value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 2, generator=g))
torch.manual_seed(0)
model = Pair()
torch.manual_seed(100 + ctx.rank)  # every worker its own dropout masks
trainer = Trainer(
    model,
    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    DataLoader(data, batch_size=GLOBAL_BATCH // ctx.num_workers, shuffle=True),
    strategy=None if strategy == "alone" else strategy,
    checkpoint_dir=ckpt,
    checkpoint_every=1,
    keep=100,
    progress=False,
)
start = trainer.steps
for _ in trainer.epochs(EPOCHS):
    for x, y in trainer.loader:
        a, b = trainer.model(x)
        trainer.step(nn.functional.mse_loss(a, y) + nn.functional.mse_loss(b, y))
        if trainer.steps == opts.get("wait"):
            print(f"waiting at step {trainer.steps} (pid {os.getpid()})", flush=True)
            time.sleep(600)
        if trainer.steps == opts.get("stop"):
            break
    if trainer.steps == opts.get("stop"):
        break
trainer.close()
mine = unwrap(trainer.model)
print(f"trained steps {start}..{trainer.steps}")
print(f"digests drop {digest(mine.drop)} plain {digest(mine.plain)}")
