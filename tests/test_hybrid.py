"""The hybrid strategy's consistency reaches the embedding tables (train/strategy.py is the one
translation point): dense parameters by all-reduce, tables on the servers with the strategy's model."""

from __future__ import annotations

from paratrain.testing import run_job

STEPS = 4
JOB = f"""
import torch
from torch import nn

import paratrain
from paratrain.kvstore import DistributedEmbedding, TableConfig

ctx = paratrain.init()
torch.manual_seed(0)
table = DistributedEmbedding("ids", 4, mode="sum", config=TableConfig("zeros"), optimizer=torch.optim.SGD,
                             optimizer_args={{"lr": 0.5}})
model = nn.ModuleDict({{"table": table, "head": nn.Linear(4, 1)}})
optimizer = torch.optim.SGD(model["head"].parameters(), lr=0.1)
trainer = paratrain.Trainer(model, optimizer, progress=False)  # strategy from PARATRAIN_STRATEGY
assert str(table.kv.config.consistency) == "async", table.kv.config
ids = torch.tensor([[ctx.rank, 2 + ctx.rank]])
for _ in range({STEPS}):
    rows = table(ids)
    trainer.step(model["head"](rows).pow(2).sum() + rows.sum())
table.flush()
ctx.barrier(name="pushed")  # every worker's pushes have arrived
rows = torch.empty(4, 4)
table.kv.row_sparse_pull("ids", out=rows, row_ids=torch.arange(4), train=False)
stats = table.kv.table_stats("ids")[0]
print("result", trainer.strategy.consistency, stats["version"], stats["open_rounds"], rows.sum().item())
trainer.close()
"""


def test_hybrid_async_trains_and_its_table_pushes_are_applied_on_arrival():
    outcome = run_job(
        JOB, workers=2, servers=1, env={"PARATRAIN_STRATEGY": "hybrid:consistency=async"}, timeout_s=120
    )
    for rank in (0, 1):
        result = [line for line in outcome.lines("worker", rank) if line.startswith("result")][-1].split()
        consistency, version, open_rounds, total = result[1], int(result[2]), int(result[3]), float(result[4])
        assert consistency == "async"
        # every push applied on arrival: one version per push (2 workers x STEPS), no round held open;
        # in sync the version would count rounds (STEPS)
        assert (version, open_rounds) == (2 * STEPS, 0), result
        assert total < 0  # the rows trained: their gradient is at least 1 per element and step
