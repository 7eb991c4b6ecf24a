"""The main job: a small CNN learns scikit-learn's bundled handwritten digits (no download).

    paratrain launch -w 2 -s 1 examples/digits.py                       # parameter server, dist_sync
    paratrain launch -w 2 -s 1 --strategy dist_async examples/digits.py
    paratrain launch -w 2 -s 0 examples/digits.py                       # collective (all-reduce)
    python examples/digits.py                                           # one process
    paratrain launch -w 4 -s 1 --max-restarts 2 examples/digits.py --elastic 2   # survives worker deaths

The script is an ordinary PyTorch loop; the Trainer adds the strategy (from `--strategy` here, or from
`paratrain launch --strategy`), this worker's shard of the data, checkpoints and the progress line.
Every worker prints its test accuracy at the end.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader

import paratrain
from paratrain.data import digits

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "--strategy", default=None, help="dist_sync, dist_async, collective, ... (default: the launch's)"
)
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--batch-size", type=int, default=32, help="per worker")
parser.add_argument("--lr", type=float, default=2e-3)
parser.add_argument("--seed", type=int, default=0, help="the model's initial weights and the data order")
parser.add_argument("--checkpoint-dir", default=None, help="checkpoint every epoch here; a rerun resumes")
parser.add_argument("--metrics-dir", default=None, help="JSON lines and TensorBoard scalars")
parser.add_argument(
    "--elastic",
    type=int,
    default=None,
    metavar="MIN_WORKERS",
    help="go on while at least MIN_WORKERS workers live (launch with --elastic or --max-restarts N)",
)
parser.add_argument(
    "--compile",
    nargs="?",
    const="inductor",
    metavar="BACKEND",
    help="train torch.compile(model, backend=BACKEND) (default inductor). torch 2.13's inductor on the CPU "
    "computes zero conv weight gradients for this model at batch sizes 16 and 32 (64 is right; without "
    "paratrain too): use --compile aot_eager there",
)
args = parser.parse_args()

elastic = None if args.elastic is None else paratrain.ElasticConfig(min_workers=args.elastic)
ctx = paratrain.init(paratrain.JobConfig(elastic=elastic))  # the scheduler and servers serve in here
torch.manual_seed(args.seed)
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
if args.compile:
    model = torch.compile(model, backend=args.compile)
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
loader = DataLoader(digits(train=True), batch_size=args.batch_size, shuffle=True)
trainer = paratrain.Trainer(
    model,
    optimizer,
    loader,
    strategy=args.strategy,
    checkpoint_dir=args.checkpoint_dir,
    checkpoint_every=len(loader) // ctx.num_workers if args.checkpoint_dir else 0,
    metrics_dir=args.metrics_dir,
    seed=args.seed,
)
for _epoch in trainer.epochs(args.epochs):
    for images, labels in trainer.loader:
        trainer.step(nn.functional.cross_entropy(trainer.model(images), labels))
trainer.close()

test = digits(train=False)
trainer.model.eval()
with torch.no_grad():
    predicted = trainer.model(test.tensors[0]).argmax(1)
accuracy = (predicted == test.tensors[1]).float().mean().item()
strategy = trainer.strategy
print(
    f"worker {ctx.rank}: test accuracy {accuracy:.3f} on {len(test)} digits after {trainer.steps} steps "
    f"({strategy.architecture}, {strategy.consistency}, {ctx.num_workers} workers)"
)
