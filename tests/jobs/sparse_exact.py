"""Sparse tables trained by several workers on overlapping ids; the test replays it on torch.nn.

Two tables on the servers: "sgd" (lookup, SGD of its own) and "ada" (mean bags, Adagrad from
kv.set_optimizer). Every worker draws batches of 64-bit ids (negative ones too) from one shared pool,
so workers and rows overlap, runs forward and backward, and its DistributedEmbeddings push. At the
end each worker pulls every pool row without training and saves its batches and those rows for the
test, which recomputes them with torch.nn.Embedding / EmbeddingBag and the same optimizers.

argv: kind loss out [state]   kind: dist_sync | dist_async | bounded; loss: quadratic | linear (its
gradients do not depend on the rows, so async results do not depend on arrival order). With `state`,
the job also saves the kvstore state there and exports "ada" to state + ".export".
"""

import sys

import torch

import paratrain
import paratrain.kvstore
from paratrain.kvstore import KVStoreConfig, TableConfig
from paratrain.kvstore.worker.embedding import DistributedEmbedding, modules

kind, loss_kind, out = sys.argv[1], sys.argv[2], sys.argv[3]
state = sys.argv[4] if len(sys.argv) > 4 else None
STEPS, DIM, POOL = 5, 6, 48

ctx = paratrain.init()
config = KVStoreConfig(consistency="bounded", staleness=1) if kind == "bounded" else kind
kv = paratrain.kvstore.create(config)
kv.set_optimizer(torch.optim.Adagrad, lr=0.1)  # dense keys and tables without their own
model = torch.nn.ModuleDict(
    {
        "sgd": DistributedEmbedding(
            "sgd", DIM, config=TableConfig(initializer="normal", init_scale=0.5), kv=kv
        ),
        "ada": DistributedEmbedding("ada", DIM, mode="mean", config=TableConfig(init_scale=0.5), kv=kv),
    }
)
kv.set_table_optimizer("sgd", torch.optim.SGD, lr=0.1)
pool = torch.randint(-(2**63), 2**63 - 1, (POOL,), generator=torch.Generator().manual_seed(5))
targets = torch.randn(8, DIM, generator=torch.Generator().manual_seed(6))

batches = []
for step in range(STEPS):
    g = torch.Generator().manual_seed(1000 * step + ctx.rank)
    lookup = pool[torch.randint(0, POOL // 2, (8, 3), generator=g)]  # half the pool: more overlap
    bags = pool[torch.randint(0, POOL, (8, 4), generator=g)]
    batches.append((lookup, bags))
    a, b = model["sgd"](lookup), model["ada"](bags)
    if loss_kind == "linear":
        loss = (a * targets[:, None]).sum() + (b * targets).sum()
    else:
        loss = ((a - targets[:, None]) ** 2).sum() + ((b - targets) ** 2).sum()
    loss.backward()
for module in modules(model):
    module.flush()
kv.barrier()  # every push sent; the pulls below wait for the last round (sync) or see all (async)
rows = {key: torch.empty(POOL, DIM) for key in ("sgd", "ada")}
for key, out_rows in rows.items():
    kv.row_sparse_pull(key, out=out_rows, row_ids=pool, train=False)
stats = {key: kv.table_stats(key) for key in rows}
torch.save({"pool": pool, "batches": batches, "rows": rows, "stats": stats}, f"{out}.{ctx.rank}")
if state:
    kv.save_state(state)
    kv.export_table("ada", state + ".export")
print("done", ctx.rank)
