"""Loads the tables that sparse_exact.py saved, into however many servers this job has, and goes on.

The same tables and optimizers are declared, the state file loaded; every worker pulls every pool
row (the saved values must come back), then pushes a known gradient for all of them to "ada" (one
sync round, whose Adagrad step needs the saved per-row state) and pulls again. Worker 0 saves what it
saw, with each server's row count, for the test. Last, a module made without `kv` checks that it gets
one default sync store on the job's servers.

argv: state out
"""

import sys

import torch

import paratrain
import paratrain.kvstore
from paratrain.kvstore import TableConfig
from paratrain.kvstore.worker.embedding import DistributedEmbedding

state, out = sys.argv[1], sys.argv[2]
DIM, POOL = 6, 48

ctx = paratrain.init()
kv = paratrain.kvstore.create("dist_sync")
kv.set_optimizer(torch.optim.Adagrad, lr=0.1)
DistributedEmbedding("sgd", DIM, config=TableConfig(initializer="normal", init_scale=0.5), kv=kv)
DistributedEmbedding("ada", DIM, mode="mean", config=TableConfig(init_scale=0.5), kv=kv)
kv.set_table_optimizer("sgd", torch.optim.SGD, lr=0.1)
kv.load_state(state)

pool = torch.randint(-(2**63), 2**63 - 1, (POOL,), generator=torch.Generator().manual_seed(5))
loaded = {key: torch.empty(POOL, DIM) for key in ("sgd", "ada")}
for key, rows in loaded.items():
    kv.row_sparse_pull(key, out=rows, row_ids=pool, train=False)
grads = torch.arange(POOL * DIM, dtype=torch.float32).reshape(POOL, DIM) / 100 * (ctx.rank + 1)
kv.push_sparse("ada", torch.cat([pool, pool[:5]]), torch.cat([grads, grads[:5]])).wait()  # repeats sum
after = torch.empty(POOL, DIM)
kv.row_sparse_pull("ada", out=after, row_ids=pool)
rows_per_server = [s["rows"] for s in kv.table_stats("ada")]

# a module without kv= gets the process's default store: sync, on this job's servers
plain = DistributedEmbedding("plain", 2, config=TableConfig("zeros"), optimizer=torch.optim.SGD)
assert plain.kv is not kv and type(plain.kv) is type(kv) and str(plain.kv.config.consistency) == "sync"
assert DistributedEmbedding("plain2", 2).kv is plain.kv
plain(pool[:4]).sum().backward()
plain.flush()
seen = torch.empty(4, 2)
plain.kv.row_sparse_pull("plain", out=seen, row_ids=pool[:4], train=False)
assert torch.allclose(seen, torch.full((4, 2), -2e-3)), seen  # both workers' gradient 1, lr 1e-3

if ctx.rank == 0:
    torch.save({"pool": pool, "loaded": loaded, "after": after, "rows_per_server": rows_per_server}, out)
print("done", ctx.rank)
