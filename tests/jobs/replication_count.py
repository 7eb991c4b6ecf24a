"""The counting job of tests/test_replication.py: every applied push adds exactly one.

    replication_count.py MODE ROUNDS SEED DIR

W workers push -1 to three keys (one sliced over the servers) for ROUNDS rounds under a server-side
SGD at lr 1, with JobConfig.replication=2. The server chosen by SEED kills itself (SIGKILL) at a
moment chosen by SEED: once worker 0 has reached a round (it writes a file in DIR), after a short
random delay. Every worker counts its acknowledged pushes; at the end each checks that every key
holds exactly the job's acknowledged pushes, and prints `count ok <total>`.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import torch

import paratrain
from paratrain.cluster.config import JobConfig
from paratrain.kvstore import KVStoreConfig, create

mode, rounds, seed, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
chance = random.Random(seed)
victim = chance.randrange(int(os.environ["PARATRAIN_NUM_SERVERS"]))
kill_round, delay_s = chance.randrange(1, rounds - 1), chance.uniform(0.0, 0.02)
signal_file = folder / f"round-{kill_round}"

if os.environ.get("PARATRAIN_ROLE") == "server" and os.environ.get("PARATRAIN_RANK") == str(victim):

    def die() -> None:
        while not signal_file.exists():
            time.sleep(0.002)
        time.sleep(delay_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die, daemon=True).start()

ctx = paratrain.init(JobConfig(replication=2))
kv = create(KVStoreConfig(consistency=mode, slice_elements=64), ctx)
sizes = {"a": 8, "b": 3, "big": 200}  # "big" is sliced over the servers
kv.init(list(sizes), [torch.zeros(n) for n in sizes.values()])
kv.set_optimizer("torch.optim.SGD", lr=1.0)
outs = {k: torch.empty(n) for k, n in sizes.items()}
acknowledged = 0
for r in range(rounds):
    if ctx.rank == 0 and r == kill_round:
        signal_file.touch()
    kv.pushpull(list(sizes), [torch.full((n,), -1.0) for n in sizes.values()], out=list(outs.values()))
    acknowledged += 1  # one push per key, acknowledged once pushpull returned
total = sum(ctx.barrier(name="counted", data=acknowledged).values())
kv.pull(list(sizes), out=list(outs.values()))
for key, out in outs.items():
    assert out.eq(total).all(), f"key {key!r} holds {out.unique().tolist()}, acknowledged {total}"
print(f"count ok {total}", flush=True)
