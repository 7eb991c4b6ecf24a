"""A job whose metrics go to every logger at once and whose /metrics the test scrapes while it waits.

argv: FOLDER   Two workers train a sparse table and a dense head (dist_sync) for STEPS steps with
Trainer(loggers=["jsonl", "mlflow", "wandb"]) (MLflow and W&B configured by the test's environment),
close the Trainer, print "trained", and wait for FOLDER/end (the test creates it once it has scraped
the dashboard's /metrics) or a deadline.
"""

import sys
import time
from pathlib import Path

import torch
from torch import nn

import paratrain
from paratrain.kvstore import DistributedEmbedding, TableConfig

STEPS = 30
ctx = paratrain.init()
folder = Path(sys.argv[1])
torch.manual_seed(0)
table = DistributedEmbedding(
    "ids", 4, mode="sum", config=TableConfig("zeros"), optimizer=torch.optim.SGD, optimizer_args={"lr": 0.1}
)
model = nn.ModuleDict({"table": table, "head": nn.Linear(4, 1)})
optimizer = torch.optim.SGD(model["head"].parameters(), lr=0.05)
trainer = paratrain.Trainer(
    model,
    optimizer,
    strategy="dist_sync",
    metrics_dir=folder / "metrics",
    loggers=["jsonl", "mlflow", "wandb"],
    log_every=5,
    progress=False,
)
weights = torch.randn(50)
generator = torch.Generator().manual_seed(ctx.rank)
for _ in range(STEPS):
    ids = torch.randint(0, 50, (16, 3), generator=generator)
    target = weights[ids].sum(1, keepdim=True)
    trainer.step(nn.functional.mse_loss(model["head"](table(ids)), target))
    time.sleep(0.02)  # a few heartbeats carry the figures while training
trainer.close()
print("trained", flush=True)
deadline = time.monotonic() + 60
while not (folder / "end").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
