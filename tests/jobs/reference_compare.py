"""A known schedule of pushes to a dense key and a sparse table; each worker saves what its last pulls
got, for tests/test_reference.py to replay through kvstore/reference.py and compare.

Worker w's push in round r is a function of (w, r), so the test knows every push. Where the model
applies pushes in arrival order (async), the workers push one at a time (a barrier between), so the
order is known too; in round models they push at once. argv: consistency out
"""

import sys

import torch

import paratrain
import paratrain.kvstore
from paratrain.kvstore import KVStoreConfig, TableConfig

ROUNDS, SIZE, DIM = 3, 6, 2
IDS = [[1, 4, 9], [4, 7, 9]]  # per worker: rows that overlap


def grad(rank: int, r: int) -> torch.Tensor:
    return torch.arange(SIZE, dtype=torch.float32) * (rank + 1) + r - 1.5


def row_grads(rank: int, r: int) -> torch.Tensor:
    return torch.ones(len(IDS[rank]), DIM) * (rank + 1) * (r + 1) * 0.5


def main() -> None:
    consistency, out = sys.argv[1], sys.argv[2]
    # Generous heartbeats: a server's first sparse update may compile its kernels (numba), which
    # holds its GIL for seconds on a loaded machine.
    ctx = paratrain.init(paratrain.JobConfig(heartbeat_timeout_s=30.0))
    staleness = 1 if consistency == "bounded" else 0
    kv = paratrain.kvstore.create(KVStoreConfig(consistency=consistency, staleness=staleness))
    ordered = not kv.config.policy.holds_pushes()  # pushes apply in arrival order: make it known
    kv.set_optimizer(torch.optim.Adagrad, lr=0.1)
    kv.init("w", torch.linspace(-1, 1, SIZE))
    kv.init_table("t", DIM, TableConfig(initializer="zeros"))
    kv.set_table_optimizer("t", torch.optim.SGD, lr=0.1)
    rank = ctx.rank
    for r in range(ROUNDS):
        rows = torch.empty(len(IDS[rank]), DIM)
        kv.row_sparse_pull("t", rows, torch.tensor(IDS[rank]))
        for w in range(ctx.num_workers) if ordered else [rank]:
            if w == rank:
                kv.push("w", grad(rank, r)).wait()
                kv.push_sparse("t", torch.tensor(IDS[rank]), row_grads(rank, r)).wait()
            if ordered:
                kv.barrier()
    kv.barrier()
    value, rows = torch.empty(SIZE), torch.empty(len(IDS[rank]), DIM)
    kv.pull("w", out=value)
    kv.row_sparse_pull("t", rows, torch.tensor(IDS[rank]), train=False)
    torch.save({"value": value, "rows": rows}, f"{out}.{rank}")
    print("done")


if __name__ == "__main__":  # the test imports the schedule above
    main()
