"""The counting job of tests/test_replication_sparse.py: every applied sparse push adds exactly one.

    replication_sparse_count.py MODE ROUNDS SEED DIR [rejoin]

Two tables on replicated servers (JobConfig.replication=2): "count" under SGD at lr 1, where a
gradient of -1 adds one to a row, and "state" under Adagrad, whose per-row sum of squared gradients
(optimizer state) counts the updates: +1 per async push, +k**2 per sync round that k workers pushed.
Each round every worker pulls (training) the rows it pushes, which overlap the other workers', plus
rows it never pushes, then pushes -1 to those rows of both tables and waits for the
acknowledgement. The server chosen by SEED kills itself (SIGKILL) once worker 0 reached a round
chosen by SEED (a file in DIR), after a short random delay. At the end every worker checks that each
row holds its initial value (a function of its id) plus exactly its acknowledged pushes, that rows
never pushed hold their initial value, and worker 0 that the Adagrad sums count the updates; each
prints `count ok <acknowledged>`.

With `rejoin` (launched with --max-restarts 1), as in replication_count.py: the launcher restarts the
dead server, which rejoins as a backup and gets every row of the tables it backs up (their optimizer
state too) while the workers go on pushing. Once worker 0 heard it is back, ANOTHER server, chosen by
SEED, kills itself, and the job goes on until worker 0 saw that one die, plus ROUNDS rounds; the
workers agree at a barrier every ROUNDS rounds whether to go on. With r=2 the rows of the second
server to die are then only on the restarted one.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import torch

import paratrain
from paratrain.cluster.config import JobConfig
from paratrain.kvstore import KVStoreConfig, TableConfig, create
from paratrain.kvstore.server.rowstore import initial_rows

mode, rounds, seed, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
rejoin = sys.argv[5:] == ["rejoin"]
chance = random.Random(seed)
servers = int(os.environ["PARATRAIN_NUM_SERVERS"])
victim = chance.randrange(servers)
kill_round, delay_s = chance.randrange(1, rounds - 1), chance.uniform(0.0, 0.02)
second = chance.choice([s for s in range(servers) if s != victim])
signal_file, back_file, second_pid = folder / f"round-{kill_round}", folder / "back", folder / "second-pid"


def die_after(path: Path) -> None:
    while not path.exists():
        time.sleep(0.002)
    time.sleep(delay_s)
    os.kill(os.getpid(), signal.SIGKILL)


role, rank = os.environ.get("PARATRAIN_ROLE"), os.environ.get("PARATRAIN_RANK")
if role == "server" and rank == str(victim) and not (folder / "victim-started").exists():
    (folder / "victim-started").touch()  # its restarted process lives on
    threading.Thread(target=die_after, args=(signal_file,), daemon=True).start()
if rejoin and role == "server" and rank == str(second):
    second_pid.write_text(str(os.getpid()))
    threading.Thread(target=die_after, args=(back_file,), daemon=True).start()

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
back = threading.Event()
if rejoin and ctx.link is not None:
    ctx.link.on_server_back(lambda *_: back.set())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


seen: list[int] = []  # the steps at which worker 0 found the second server dead


def go_on(step: int, deadline: float) -> bool:
    """Worker 0's say after `step` rounds: go on while the second death is to come (rejoin)."""
    if not rejoin or step < rounds:
        return step < rounds
    if back.is_set():
        back_file.touch()
    if time.monotonic() > deadline:
        raise TimeoutError(f"the restarted server was not back, or server {second} not dead, in time")
    if back.is_set() and not alive(int(second_pid.read_text())):
        seen.append(step)
    return len(seen) < 2  # ROUNDS more rounds after worker 0 saw the second death


def one_round(r: int) -> None:
    """Pull the round's rows of both tables, push -1 to some, wait for the acknowledgements."""
    ids = torch.tensor(pushed_ids(ctx.rank, r) + pulled_only(ctx.rank))
    for table in ("count", "state"):
        kv.row_sparse_pull(table, torch.empty(len(ids), DIM), ids)
    pushed = ids[:PER_ROUND]
    handles = [kv.push_sparse(t, pushed, torch.full((PER_ROUND, DIM), -1.0)) for t in ("count", "state")]
    for handle in handles:
        handle.wait()


acknowledged, step, more, deadline = 0, 0, True, time.monotonic() + 90
while more:
    for _ in range(rounds):
        if ctx.rank == 0 and step == kill_round:
            signal_file.touch()
        one_round(step)
        acknowledged += 1  # one push of PER_ROUND rows per table, acknowledged once wait() returned
        step += 1
        if rejoin and ctx.rank == 0 and step > rounds and not back.is_set():
            time.sleep(0.005)  # while the restarted server catches up: rounds go on, slower
    says = ctx.barrier(name=f"go on {step}", data=go_on(step, deadline) if ctx.rank == 0 else None)
    more = bool(says[0]) if rejoin else False
rounds = step  # every worker made as many
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
