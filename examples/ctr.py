"""A wide-and-deep click model on Criteo-format logs, its embedding tables on the parameter servers.

    paratrain launch -w 2 -s 2 examples/ctr.py [--train day_0.tsv --test day_1.tsv] [--epochs 2]
    python examples/ctr.py                   # alone: one process, tables in this process

Without --train, every worker writes the same synthetic logs (power-law ids, see
paratrain.data.criteo) to a temporary folder and reads them back with the Criteo reader. Each worker
trains on its own shard of the lines (the Trainer's sampler). The 26 categorical features share two
sparse tables on the servers, sharded by id, with Adagrad running there: "deep" (16 values a row, one
lookup per feature) and "wide" (1 value a row, summed per line). The dense part (an MLP over the 13
integer features and the looked-up rows) is synced by all-reduce (strategy "hybrid"; "ps" sends it
through the servers too, "local" not at all). Worker 0 prints the held-out AUC at the end.
"""

import argparse
import os
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
import paratrain.kvstore
from paratrain.data.criteo import NUM_CATEGORICAL, NUM_DENSE, read_criteo, write_synthetic_criteo
from paratrain.errors import MissingExtraError
from paratrain.kvstore import DistributedEmbedding, TableConfig

try:
    from sklearn.metrics import roc_auc_score
except ImportError as exc:  # the examples' extra
    raise MissingExtraError("scikit-learn", "examples", "examples/ctr.py") from exc

parser = argparse.ArgumentParser()
parser.add_argument("--train", help="Criteo-format TSV to train on (default: synthetic)")
parser.add_argument("--test", help="held-out TSV (default: synthetic)")
parser.add_argument("--rows", type=int, default=40_000, help="synthetic training lines")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch", type=int, default=512)
parser.add_argument("--dim", type=int, default=16)
parser.add_argument("--kind", default="dist_sync", help="kvstore kind for the tables")
parser.add_argument(
    "--strategy", default="hybrid", help="hybrid: dense part by all-reduce; ps: on servers too"
)
args = parser.parse_args()

ctx = paratrain.init()  # the scheduler and the servers serve inside this call, then exit
torch.set_num_threads(1)
if args.train is None:
    folder = tempfile.mkdtemp(prefix="ctr-")
    args.train, args.test = os.path.join(folder, "train.tsv"), os.path.join(folder, "test.tsv")
    write_synthetic_criteo(args.train, args.rows, seed=1)
    write_synthetic_criteo(args.test, args.rows // 4, seed=2)
labels, dense, ids = read_criteo(args.train).tensors  # the Trainer gives each worker its shard


class WideAndDeep(nn.Module):
    def __init__(self, kv: object, dim: int) -> None:
        super().__init__()
        tables = TableConfig(initializer="normal", init_scale=0.05, admit_after=1)
        adagrad = {"optimizer": torch.optim.Adagrad, "optimizer_args": {"lr": 0.05}, "kv": kv}
        self.deep = DistributedEmbedding("deep", dim, config=tables, **adagrad)
        self.wide = DistributedEmbedding("wide", 1, mode="sum", config=TableConfig("zeros"), **adagrad)
        self.dense = nn.Sequential(nn.Linear(NUM_DENSE, dim), nn.ReLU())
        width = (NUM_CATEGORICAL + 1) * dim
        self.top = nn.Sequential(nn.Linear(width, 128), nn.ReLU(), nn.Linear(128, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        deep = torch.cat([self.deep(ids).flatten(1), self.dense(dense)], dim=1)
        return (self.top(deep) + self.wide(ids)).squeeze(1)


torch.manual_seed(0)  # every worker starts from the same dense weights
kv = paratrain.kvstore.create(args.kind)
model = WideAndDeep(kv, args.dim)
optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)  # the dense part; the tables step on the servers
trainer = paratrain.Trainer(  # hybrid: dense by all-reduce, tables on the servers
    model,
    optimizer,
    DataLoader(TensorDataset(dense, ids, labels), batch_size=args.batch, shuffle=True),
    strategy=args.strategy,
    progress=False,
)
start = time.perf_counter()
for epoch in trainer.epochs(args.epochs):
    for step, (dense_batch, id_batch, label_batch) in enumerate(trainer.loader):
        logits = trainer.model(dense_batch, id_batch)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, label_batch)
        trainer.step(loss)  # the tables' row gradients are pushed during backward
        if ctx.rank == 0 and step % 20 == 0:
            print(f"epoch {epoch} step {step:4d}  loss {loss.item():.4f}", flush=True)
trainer.close()

test_labels, test_dense, test_ids = read_criteo(args.test).tensors
model.eval()
with torch.no_grad():  # held-out ids the tables never saw read as zeros
    scores = torch.cat(
        [model(test_dense[i : i + 4096], test_ids[i : i + 4096]) for i in range(0, len(test_ids), 4096)]
    )
auc = roc_auc_score(test_labels.numpy(), scores.numpy())
rows = sum(s["rows"] for s in kv.table_stats("deep"))
if ctx.rank == 0:
    print(
        f"held-out AUC {auc:.4f} ({len(test_labels)} lines; {rows} rows in table 'deep'; "
        f"{time.perf_counter() - start:.1f} s training, strategy {trainer.strategy.architecture})"
    )
