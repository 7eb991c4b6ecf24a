"""The main job: a small network learns a synthetic 3-class problem on a parameter server.

    paratrain launch -w 2 -s 1 examples/ps_train.py [--kind dist_sync] [--steps 300]

Every worker builds the same data set in code (no download), trains on its own half, pushes each
step's gradients and pulls the weights, which the server updates with Adam (the optimizer runs on the
servers). Every worker reports the accuracy on held-out data at the end; worker 0 also the loss as it
goes. The same script runs alone (`python examples/ps_train.py`) on one process.
"""

import argparse

import torch
from torch import nn

import paratrain
import paratrain.kvstore


def spirals(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three interleaved spiral arms in 2-D: not separable by a line, easy for a small MLP."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (n,), generator=g)
    radius = torch.rand(n, generator=g)
    angle = labels * (2 * torch.pi / 3) + radius * 4 + 0.2 * torch.randn(n, generator=g)
    points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
    return points, labels


parser = argparse.ArgumentParser()
parser.add_argument("--kind", default="dist_sync", help="kvstore kind: dist_sync, dist_async, ...")
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch", type=int, default=64)
args = parser.parse_args()

ctx = paratrain.init()  # the scheduler and the servers serve inside this call, then exit
torch.manual_seed(0)  # every worker starts from the same model
model = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
params = list(model.parameters())
kv = paratrain.kvstore.create(args.kind)
keys = [name for name, _ in model.named_parameters()]
kv.init(keys, [p.detach() for p in params])
kv.set_optimizer(torch.optim.Adam, lr=0.01)

x, y = spirals(6000, seed=1)
x, y = x[ctx.rank :: ctx.num_workers], y[ctx.rank :: ctx.num_workers]  # this worker's shard
g = torch.Generator().manual_seed(ctx.rank)
for step in range(args.steps):
    idx = torch.randint(0, len(x), (args.batch,), generator=g)
    loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
    model.zero_grad()
    loss.backward()
    with torch.no_grad():
        kv.pushpull(keys, [p.grad / ctx.num_workers for p in params], out=[p.data for p in params])
    if ctx.rank == 0 and step % 50 == 0:
        print(f"step {step:4d}  loss {loss.item():.3f}")

test_x, test_y = spirals(2000, seed=2)
with torch.no_grad():
    accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
print(f"worker {ctx.rank}: held-out accuracy {accuracy:.3f} after {args.steps} steps ({args.kind})")
