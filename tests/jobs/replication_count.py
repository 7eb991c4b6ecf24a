"""The counting job of tests/test_replication.py: every applied push adds exactly one.

    replication_count.py MODE ROUNDS SEED DIR [rejoin] [sums]

W workers push -1 to three keys (one sliced over the servers) for ROUNDS rounds under a server-side
SGD at lr 1, with JobConfig.replication=2. A server dies at a round chosen by SEED
(server_deaths.py). Every worker counts its acknowledged pushes; at the end each checks that every
key holds exactly the job's acknowledged pushes, and prints `count ok <total>`.

With `sums` (sync only) there is no server optimizer: a round's sum is the value, as when the update
runs on the workers, and same-host backups take it in the primary's memory (mirror.py, lending).
Each worker pushes (its last pulled value + 1) / W, so every round applied adds exactly one: the
keys end at the acknowledged pushes / W.

With `rejoin` the dead server is restarted, rejoins as a backup and catches up while the workers go
on pushing; then ANOTHER server dies (server_deaths.py).
"""

from __future__ import annotations

import os
import sys

import torch
from server_deaths import ServerDeaths  # beside this script

import paratrain
from paratrain.cluster.config import JobConfig
from paratrain.kvstore import KVStoreConfig, create

sums = "sums" in sys.argv[1:]
deaths = ServerDeaths([a for a in sys.argv[1:] if a != "sums"])
ctx = paratrain.init(JobConfig(replication=2))
# Frames of one slice each: a push comes to each server in several frames, as a big model's does,
# whose completed slices same-host backups get together (outbox.py).
kv = create(KVStoreConfig(consistency=deaths.mode, slice_elements=64, frame_bytes=256), ctx)
sizes = {"a": 8, "b": 3, "big": 200}  # "big" is sliced over the servers
kv.init(list(sizes), [torch.zeros(n) for n in sizes.values()])
if not sums:
    kv.set_optimizer("torch.optim.SGD", lr=1.0)
outs = {k: torch.zeros(n) for k, n in sizes.items()}
workers = int(os.environ["PARATRAIN_NUM_WORKERS"])


def one_round(step: int) -> None:
    if sums:
        values = [(out + 1) / workers for out in outs.values()]
    else:
        values = [torch.full((n,), -1.0) for n in sizes.values()]
    kv.pushpull(list(sizes), values, out=list(outs.values()))  # acknowledged once it returned


acknowledged = deaths.run(ctx, one_round, timeout_s=120)  # one push per key and round
total = sum(ctx.barrier(name="counted", data=acknowledged).values())
kv.pull(list(sizes), out=list(outs.values()))
expected = total / workers if sums else total
for key, out in outs.items():
    assert out.eq(expected).all(), f"key {key!r} holds {out.unique().tolist()}, expected {expected}"
print(f"count ok {total}", flush=True)
