"""The counting job of tests/test_replication_sparse.py: every applied sparse push adds exactly one.

    replication_sparse_count.py MODE ROUNDS SEED DIR [rejoin]

Two tables on replicated servers (JobConfig.replication=2): "count" under SGD at lr 1, where a
gradient of -1 adds one to a row, and "state" under Adagrad, whose per-row sum of squared gradients
(optimizer state) counts the updates: +1 per async push, +k**2 per sync round that k workers pushed.
Each round every worker pulls (training) the rows it pushes, which overlap the other workers', plus
rows it never pushes, then pushes -1 to those rows of both tables and waits for the
acknowledgement. A server dies at a round chosen by SEED (server_deaths.py). At the end every
worker checks that each row holds its initial value (a function of its id) plus exactly its
acknowledged pushes, that rows never pushed hold their initial value, and worker 0 that the
Adagrad sums count the updates; each prints `count ok <acknowledged>`.

With `rejoin` (server_deaths.py) the dead server is restarted and rejoins as a backup, getting
every row of the tables it backs up (their optimizer state too) while the workers go on pushing;
then ANOTHER server dies. With r=2 the rows of the second server to die are then only on the
restarted one.
"""

from __future__ import annotations

import random
import sys
from collections import Counter

import torch
from server_deaths import ServerDeaths  # beside this script

import paratrain
from paratrain.cluster.config import JobConfig
from paratrain.kvstore import KVStoreConfig, TableConfig, create
from paratrain.kvstore.server.rowstore import initial_rows

deaths = ServerDeaths(sys.argv[1:])
mode, seed = deaths.mode, deaths.seed
DIM, SHARED, PER_ROUND = 4, 24, 6  # pushed ids come from 0..SHARED-1: the workers' overlap


def pushed_ids(worker: int, round_: int) -> list[int]:
    return random.Random(f"{seed}-{worker}-{round_}").sample(range(SHARED), PER_ROUND)


def pulled_only(worker: int) -> list[int]:
    return [1000 + 10 * worker + i for i in range(3)]  # made by a pull on the primary, never pushed


ctx = paratrain.init(JobConfig(replication=2))
workers = ctx.num_workers
kv = create(KVStoreConfig(consistency=mode), ctx)
config = TableConfig(initializer="uniform", init_scale=0.5, init_seed=seed)
for table in ("count", "state"):
    kv.init_table(table, DIM, config)
kv.set_optimizer("torch.optim.SGD", lr=1.0)  # the tables' default: "count"
kv.set_table_optimizer("state", "torch.optim.Adagrad", lr=0.01)


def one_round(r: int) -> None:
    """Pull the round's rows of both tables, push -1 to some, wait for the acknowledgements."""
    ids = torch.tensor(pushed_ids(ctx.rank, r) + pulled_only(ctx.rank))
    for table in ("count", "state"):
        kv.row_sparse_pull(table, torch.empty(len(ids), DIM), ids)
    pushed = ids[:PER_ROUND]
    handles = [kv.push_sparse(t, pushed, torch.full((PER_ROUND, DIM), -1.0)) for t in ("count", "state")]
    for handle in handles:
        handle.wait()


rounds = acknowledged = deaths.run(ctx, one_round, timeout_s=90)  # the same on every worker
total = sum(ctx.barrier(name="counted", data=acknowledged).values())
assert total == workers * rounds, f"{total} pushes acknowledged, {workers * rounds} made"

counts = Counter(i for w in range(workers) for r in range(rounds) for i in pushed_ids(w, r))
never = [2000 + i for i in range(5)]  # no worker ever named them
ids = list(range(SHARED)) + [i for w in range(workers) for i in pulled_only(w)] + never
rows = torch.empty(len(ids), DIM)
kv.row_sparse_pull("count", rows, torch.tensor(ids))
added = torch.tensor([float(counts[i]) for i in ids])[:, None].expand(-1, DIM)
expected = initial_rows(torch.tensor(ids).numpy(), DIM, config) + added
wrong = (rows - expected).abs().amax(1) > 1e-3
assert not wrong.any(), (
    f"rows {[ids[i] for i in wrong.nonzero().flatten().tolist()]} hold "
    f"{(rows - initial_rows(torch.tensor(ids).numpy(), DIM, config))[wrong, 0].tolist()} over their "
    f"initial value; acknowledged {added[wrong, 0].tolist()}"
)
if ctx.rank == 0:  # the optimizer state: Adagrad's sums of squared gradients, per row
    entry = kv.tables.gather("state")[0]
    per_update = Counter()
    for r in range(rounds):
        in_round = Counter(i for w in range(workers) for i in pushed_ids(w, r))
        for i, k in in_round.items():
            per_update[i] += k * k if mode == "sync" else k
    sums = {int(i): float(s[0]) for i, s in zip(entry["ids"], entry["state"]["sum"], strict=True)}
    bad = {i: (sums.get(i), n) for i, n in per_update.items() if sums.get(i) != float(n)}
    assert not bad, f"Adagrad sums (held, expected) differ: {bad}"
    assert all(sums.get(i, 0.0) == 0.0 for w in range(workers) for i in pulled_only(w)), sums
print(f"count ok {total}", flush=True)
